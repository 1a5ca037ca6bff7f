"""The exceptions modelkit raises. The CLI turns each into a one-line message and exit code 2.

Dual bases (ValueError, ImportError, FileExistsError) let callers who catch builtins keep working.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any


class ModelkitError(Exception):
    """Base for errors the CLI reports as a message plus exit code 2, without a traceback."""


def _as_path(path: str | Path) -> Path:
    from pathlib import Path  # here, not at the top: the scanner imports this module and starts without pathlib

    return Path(path)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """' (did you mean 'onnx'?)' when a close match exists, else ''."""
    import difflib  # only on this error path: keeps `modelkit scan`'s start-up short

    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class UnknownFormatError(ModelkitError, ValueError):
    """A format name that is not in the FORMATS table."""

    def __init__(self, name: str, *, known: Iterable[str]) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(
            f"unknown format {name!r}; known: {', '.join(self.known)}{did_you_mean(name, self.known)}"
        )


class UnknownModelError(ModelkitError, ValueError):
    """A reference-model name that is not in the MODELS table."""

    def __init__(self, name: str, *, known: Iterable[str], message: str | None = None) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(
            message or f"unknown model {name!r}; known: {', '.join(self.known)}{did_you_mean(name, self.known)}"
        )


class FormatError(ModelkitError, ValueError):
    """A file that is malformed, truncated or not what it claims to be."""

    def __init__(self, path: str | Path, message: str) -> None:
        self.path = _as_path(path)
        self.reason = message
        super().__init__(f"{self.path}: {message}")


class ParseError(FormatError):
    """Untrusted bytes that do not hold the structure they claim (modelkit.parse): carries where.

    `source` names the file (or archive member) when the caller gave one; `offset` is the byte where
    the structure broke, when known. Built without pathlib, so the scanner can raise and catch it.
    """

    def __init__(self, message: str, *, offset: int | None = None, source: str | None = None) -> None:
        self.reason = message
        self.offset = offset
        self.source = source
        where = f" (at byte {offset})" if offset is not None else ""
        ModelkitError.__init__(self, f"{source}: {message}{where}" if source else f"{message}{where}")

    @property
    def path(self) -> Path:  # type: ignore[override] - FormatError's attribute, made lazily here
        return _as_path(self.source or "")


class UnsupportedConversionError(ModelkitError):
    """A conversion modelkit cannot do; the message says why and what would make it possible."""

    def __init__(self, source: str, target: str, reason: str) -> None:
        self.source = source
        self.target = target
        self.reason = reason
        super().__init__(f"cannot convert {source} to {target}: {reason}")


class MissingDependencyError(ModelkitError, ImportError):
    """An optional dependency is not installed; the message names the pip extra."""


class ConfigError(ModelkitError, ValueError):
    """An invalid option or configuration value."""


class RequestError(ModelkitError, ValueError):
    """A request `modelkit serve` refuses: its HTTP status (400 bad input, 404 unknown model, 413 too large,
    503 queue full) and a one-line reason, sent as {"error": reason}."""

    def __init__(self, message: str, status: int = 400) -> None:
        self.status = status
        super().__init__(message)


class OutputExistsError(ModelkitError, FileExistsError):
    """The output path exists and overwriting was not asked for."""

    def __init__(self, path: str | Path) -> None:
        self.path = _as_path(path)
        super().__init__(f"{self.path} already exists; pass --force (API: force=True) to overwrite it")


class UnsafeFileError(ModelkitError):
    """The scanner found content that would run code on load; carries the report."""

    def __init__(self, path: str | Path, report: Any, message: str | None = None) -> None:
        self.path = _as_path(path)
        self.report = report
        super().__init__(message or f"{self.path}: refused to load unsafe content (run `modelkit scan {self.path}`)")


class VerificationError(ModelkitError):
    """A converted or quantized model does not reproduce its source within tolerance."""

    def __init__(self, message: str, *, max_abs_err: float, atol: float) -> None:
        self.max_abs_err = max_abs_err
        self.atol = atol
        super().__init__(f"{message}: max abs error {max_abs_err:.3g} > atol {atol:.3g}")


@contextmanager
def reading(path: str | Path, what: str | None = None) -> Iterator[None]:
    """Errors of reading `path` inside the block as one FormatError naming it: the file system's
    ("cannot read it (...)") and the parser's (after "not a readable WHAT: " where `what` is given)."""
    try:
        yield
    except ParseError as e:
        raise FormatError(path, f"not a readable {what}: {e}" if what else str(e)) from e
    except OSError as e:
        raise FormatError(path, f"cannot read it ({e.strerror or e})") from e
