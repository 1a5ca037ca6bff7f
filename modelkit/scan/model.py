"""The scanner's result types: Severity, Finding, ScannedFile, ScanError and ScanReport. Standard library only.

They are plain slotted classes rather than dataclasses: importing dataclasses (inspect, ast, dis,
tokenize) would add a sixth to `modelkit scan`'s start-up, which is most of its run time. `Record`
gives them what frozen dataclasses would: keyword construction, equality, hashing, a repr, immutability.
"""
from __future__ import annotations

from enum import IntEnum

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

SCHEMA = "modelkit.scan/1"


class Severity(IntEnum):
    """How bad a finding is; an IntEnum, so severities compare and sort directly."""

    SAFE = 0
    SUSPICIOUS = 1
    DANGEROUS = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class Record:
    """Base of immutable value objects: equality, hash and repr over the fields named in `__slots__`."""

    __slots__: tuple[str, ...] = ()

    def _set(self, **fields: object) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._values() == self._values()   # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._values()))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({fields})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __reduce__(self):
        return _rebuild, (type(self), dict(zip(self.__slots__, self._values(), strict=True)))


def _rebuild(cls: type[Record], fields: dict[str, object]) -> Record:
    record = object.__new__(cls)
    record._set(**fields)
    return record


class Finding(Record):
    """One thing the scanner saw.

    Args:
        path: The file, or `archive.pt:archive/data.pkl` for a member inside a container.
        severity: SAFE (informational), SUSPICIOUS or DANGEROUS.
        rule: A stable id such as "pickle.global.denied"; docs/security.md lists them.
        module: For pickle globals, the module named (else "").
        name: For pickle globals, the attribute named (else "").
        detail: Why it matters, in one sentence.
        offset: Byte offset inside `path` (the member for archive members), when known.
    """

    __slots__ = ("path", "severity", "rule", "detail", "module", "name", "offset")
    path: str
    severity: Severity
    rule: str
    detail: str
    module: str
    name: str
    offset: int | None

    def __init__(self, *, path: str, severity: Severity, rule: str, detail: str, module: str = "", name: str = "",
                 offset: int | None = None) -> None:
        self._set(path=path, severity=severity, rule=rule, detail=detail, module=module, name=name, offset=offset)

    @property
    def callable(self) -> str:
        return f"{self.module}.{self.name}" if self.module else self.name

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "severity": self.severity.label, "rule": self.rule, "module": self.module,
                "name": self.name, "detail": self.detail, "offset": self.offset}


class ScannedFile(Record):
    """A file that was scanned: its detected format and what was examined inside it."""

    __slots__ = ("path", "format", "examined")
    path: str
    format: str
    examined: tuple[str, ...]

    def __init__(self, *, path: str, format: str, examined: tuple[str, ...] = ()) -> None:  # noqa: A002
        self._set(path=path, format=format, examined=tuple(examined))

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "examined": list(self.examined)}


class ScanError(Record):
    """A file that could not be scanned (unreadable, unrecognised): never counted as clean."""

    __slots__ = ("path", "message")
    path: str
    message: str

    def __init__(self, *, path: str, message: str) -> None:
        self._set(path=path, message=message)

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}


class ScanReport:
    """Everything one scan found, for one file or many.

    `worst` is the highest severity among the findings (SAFE when there are none); a report
    with errors is never clean, whatever `worst` says.
    """

    def __init__(self, *, findings: list[Finding] | None = None, files: list[ScannedFile] | None = None,
                 errors: list[ScanError] | None = None) -> None:
        self.findings: list[Finding] = list(findings or [])
        self.files: list[ScannedFile] = list(files or [])
        self.errors: list[ScanError] = list(errors or [])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScanReport) and (self.findings, self.files, self.errors) == (
            other.findings, other.files, other.errors)

    __hash__ = None     # type: ignore[assignment]  # mutable, like a non-frozen dataclass

    def __repr__(self) -> str:
        return f"ScanReport(findings={self.findings!r}, files={self.files!r}, errors={self.errors!r})"

    @property
    def scanned(self) -> int:
        return len(self.files)

    @property
    def worst(self) -> Severity:
        return max((f.severity for f in self.findings), default=Severity.SAFE)

    def ok(self, fail_on: Severity = Severity.DANGEROUS) -> bool:
        """True when nothing reaches `fail_on` and every file could be scanned."""
        return not self.errors and self.worst < fail_on

    def at_least(self, severity: Severity) -> list[Finding]:
        return [f for f in self.findings if f.severity >= severity]

    def extend(self, other: ScanReport) -> None:
        self.findings.extend(other.findings)
        self.files.extend(other.files)
        self.errors.extend(other.errors)

    def to_dict(self, fail_on: Severity = Severity.DANGEROUS) -> dict[str, Any]:
        """The `modelkit.scan/1` JSON document (STYLE.md)."""
        return {"schema": SCHEMA, "ok": self.ok(fail_on), "worst": self.worst.label, "fail_on": fail_on.label,
                "scanned": self.scanned, "files": [f.to_dict() for f in self.files],
                "findings": [f.to_dict() for f in self.findings], "errors": [e.to_dict() for e in self.errors]}
