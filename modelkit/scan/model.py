"""The scanner's result types: Severity, Finding, ScannedFile, ScanError and ScanReport. Standard library only."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
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


@dataclass(frozen=True, kw_only=True)
class Finding:
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

    path: str
    severity: Severity
    rule: str
    detail: str
    module: str = ""
    name: str = ""
    offset: int | None = None

    @property
    def callable(self) -> str:
        return f"{self.module}.{self.name}" if self.module else self.name

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "severity": self.severity.label, "rule": self.rule, "module": self.module,
                "name": self.name, "detail": self.detail, "offset": self.offset}


@dataclass(frozen=True, kw_only=True)
class ScannedFile:
    """A file that was scanned: its detected format and what was examined inside it."""

    path: str
    format: str
    examined: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "examined": list(self.examined)}


@dataclass(frozen=True, kw_only=True)
class ScanError:
    """A file that could not be scanned (unreadable, unrecognised): never counted as clean."""

    path: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}


@dataclass(kw_only=True)
class ScanReport:
    """Everything one scan found, for one file or many.

    `worst` is the highest severity among the findings (SAFE when there are none); a report
    with errors is never clean, whatever `worst` says.
    """

    findings: list[Finding] = field(default_factory=list)
    files: list[ScannedFile] = field(default_factory=list)
    errors: list[ScanError] = field(default_factory=list)

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
