"""The safety scanner: what a model file would import, call or mislead a reader into, found without loading it.

`scan(path)` reads a file's (or a folder's) bytes, picks the analysis by content, never by
extension, and returns a `ScanReport`. It imports only the standard library and never unpickles,
imports or runs anything from the file. `gate(path, trust=...)` is the check loaders run first.

`modelkit.scan` is both this package and a function: the package object is callable, so
`modelkit.scan(path)`, `modelkit.scan.scan(path)` and `from modelkit.scan import scan` all work,
whichever of `import modelkit.scan` and `modelkit.scan(...)` a process does first.

Example:
    >>> import modelkit
    >>> report = modelkit.scan("model.pt")                         # doctest: +SKIP
    >>> [(f.severity.label, f.rule, f.callable) for f in report.findings]   # doctest: +SKIP
    [('dangerous', 'pickle.global.denied', 'os.system')]
"""
from __future__ import annotations

import mmap
import os
import sys
import time
import types
from collections.abc import Callable, Iterable

from modelkit.errors import UnsafeFileError
from modelkit.scan.containers import Context, ScanFailure, polyglot_zip, scan_buffer
from modelkit.scan.model import Finding, ScanError, ScannedFile, ScanReport, Severity
from modelkit.scan.pickle import Limits
from modelkit.scan.policy import NEEDS_TRUST_RULES

__all__ = ["Finding", "Limits", "ScanError", "ScanReport", "ScannedFile", "Severity", "gate", "iter_files",
           "needs_trust", "scan", "scan_paths"]

PathLike = str | os.PathLike[str]
_NO_PICKLE = {"safetensors": "safetensors", "onnx": "ONNX", "gguf": "GGUF", "hdf5": "HDF5", "openvino": "OpenVINO IR",
              "tf-checkpoint": "A TensorFlow checkpoint index", "ggml": "A legacy llama.cpp file"}


def scan(path: PathLike, *, recursive: bool = False, limits: Limits = Limits(),
         progress: Callable[[int, int], None] | None = None) -> ScanReport:
    """Scan a file, or the files in a folder, without loading anything.

    Args:
        path: A model file, or a folder (its files; with `recursive`, everything beneath it).
        recursive: Descend into sub-folders of a folder.
        limits: Per-pickle bounds (opcodes, memo, depth, seconds); reaching one is a DANGEROUS finding.
        progress: Called as progress(done, total) after each file.

    Returns:
        A ScanReport: findings (severity, rule, location, callable, why), the files with their
        detected format and what was examined, and errors for files that could not be scanned.
        A report with errors is never clean; a folder with no files is an error.

    Example:
        >>> from modelkit.scan import scan
        >>> scan("model.pt").worst                                   # doctest: +SKIP
        <Severity.SAFE: 0>
    """
    return scan_paths([path], recursive=recursive, limits=limits, progress=progress)


def scan_paths(paths: Iterable[PathLike], *, recursive: bool = False, limits: Limits = Limits(),
               progress: Callable[[int, int], None] | None = None) -> ScanReport:
    """Scan several paths into one report (see `scan`)."""
    report = ScanReport()
    files: list[str] = []
    for given in paths:
        path = os.fspath(given)
        found, error = iter_files(path, recursive=recursive)
        if error:
            report.errors.append(ScanError(path=path, message=error))
        files.extend(found)
    if not files and not report.errors:
        report.errors.append(ScanError(path=", ".join(str(p) for p in paths) or ".",
                                       message="no files to scan (a scan that looks at nothing is not clean)"))
    named: dict[str, str] = {}          # real path of a raw tensor-data file -> the model file that names it
    for done, file in enumerate(files, 1):
        one, data_files = _scan_file(file, limits=limits)
        report.extend(one)
        named.update((data, file) for data in data_files)
        if progress is not None:
            progress(done, len(files))
    _accept_named_data(report, named)
    _accept_sibling_data(report, limits, scanned={os.path.realpath(f) for f in files})
    return report


_MAX_SIBLINGS = 16


def _accept_sibling_data(report: ScanReport, limits: Limits, *, scanned: set[str]) -> None:
    """An ONNX external-data file scanned without its model (`modelkit scan model.onnx.data`) is data, not an
    unknown model: the .onnx files beside it (up to 16, not already in this scan) are read for the files
    they name, and a file one of them names is accepted as `_accept_named_data` accepts it."""
    waiting = [e for e in report.errors if e.message.startswith(_UNRECOGNISED)]
    folders = {os.path.dirname(os.path.realpath(e.path)) for e in waiting}
    named: dict[str, str] = {}
    for folder in folders:
        try:
            models = sorted(entry.path for entry in os.scandir(folder)
                            if entry.name.lower().endswith(".onnx") and entry.is_file())[:_MAX_SIBLINGS]
        except OSError:
            continue
        for model in models:
            if os.path.realpath(model) in scanned:
                continue
            _, data_files = _scan_file(model, limits=limits)
            named.update((data, model) for data in data_files)
    _accept_named_data(report, named)


_UNRECOGNISED = "unrecognised content"


def _accept_named_data(report: ScanReport, named: dict[str, str]) -> None:
    """A file that is nothing but raw bytes ("unrecognised content") is not an error when a model in the
    same scan names it as its tensor data (TF.js shards, ONNX external data): it was scanned by content
    like every file (a pickle or archive there is judged as one), and the model's scan checked its size."""
    if not named:
        return
    kept = []
    for error in report.errors:
        owner = named.get(os.path.realpath(error.path)) if error.message.startswith(_UNRECOGNISED) else None
        if owner is None:
            kept.append(error)
        else:
            report.files.append(ScannedFile(path=error.path, format="tensor data", examined=(
                f"raw tensor bytes named by {owner}: no pickle, archive or code found in them; the model's own "
                "scan checks their size",)))
    report.errors[:] = kept


def iter_files(path: PathLike, *, recursive: bool) -> tuple[list[str], str | None]:
    """The files `path` names (itself, or a folder's files, sorted); an error message if there are none.

    Paths are strings (os.path, not pathlib: pathlib's import alone is a tenth of a scan's start-up).
    """
    path = os.fspath(path)
    try:
        if os.path.isfile(path):
            return [path], None
        if not os.path.exists(path):
            return [], "no such file or folder"
        if not os.path.isdir(path):
            return [], "not a regular file or folder"
        if recursive:
            found = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
        else:
            found = [entry.path for entry in os.scandir(path)]
    except OSError as e:
        return [], f"cannot be listed ({e.strerror or e})"
    found = sorted(p for p in found if os.path.isfile(p))
    if not found:
        return [], "folder has no files" + ("" if recursive else " (pass --recursive / recursive=True for sub-folders)")
    return found, None


def scan_file(path: PathLike, *, limits: Limits = Limits()) -> ScanReport:
    """Scan one file; never raises for what the file contains."""
    return _scan_file(path, limits=limits)[0]


def _scan_file(path: PathLike, *, limits: Limits) -> tuple[ScanReport, list[str]]:
    """scan_file's report, and the raw tensor-data files the file names (real paths)."""
    report = ScanReport()
    display = os.fspath(path)
    ctx = Context(display=display, directory=os.path.dirname(os.path.realpath(display)), limits=limits,
                  deadline=time.monotonic() + limits.seconds)
    try:
        with open(display, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ScanFailure("empty file: nothing to scan")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                fmt = scan_buffer(buf, 0, size, ctx, display, hint=os.path.basename(display))
                polyglot_zip(buf, fmt, ctx, display)
            if fmt in _NO_PICKLE:
                ctx.sink(display).add(Severity.SAFE, "container.no_pickle",
                                      f"{_NO_PICKLE[fmt]} holds no pickle and no code; its header was checked")
    except ScanFailure as e:
        report.errors.append(ScanError(path=display, message=str(e)))
        return report, []
    except OSError as e:
        report.errors.append(ScanError(path=display, message=f"cannot be read ({e.strerror or e})"))
        return report, []
    except Exception as e:  # noqa: BLE001 - a scanner bug must fail closed, not pass a file as clean
        import logging  # here, not at the top: start-up time of `modelkit scan`

        logging.getLogger(__name__).debug("internal error scanning %s", display, exc_info=True)
        report.errors.append(ScanError(path=display, message=f"internal scanner error ({type(e).__name__}: {e})"))
        return report, []
    report.findings.extend(ctx.findings)
    report.files.append(ScannedFile(path=display, format=fmt, examined=tuple(ctx.examined)))
    return report, ctx.data_files


def needs_trust(finding: Finding) -> bool:
    """True for SUSPICIOUS findings that mean "loading runs the file's own code" (whole-module pickles,
    TorchScript code, custom Keras objects): the gate accepts them only with trust=True."""
    return finding.severity == Severity.SUSPICIOUS and finding.rule in NEEDS_TRUST_RULES


def gate(path: PathLike, *, trust: bool, limits: Limits = Limits()) -> ScanReport:
    """The check every loader of a pickle-bearing format runs before it reads anything.

    Args:
        path: The file about to be loaded.
        trust: The user's --trust / trust=True: allow content that runs the file's own code
            (whole-module pickles, TorchScript). DANGEROUS findings are refused even then.
        limits: Scan limits.

    Returns:
        The ScanReport, when the file may be loaded.

    Raises:
        UnsafeFileError: (carries .path and .report) when the scan has errors (the file could not
            be scanned), any DANGEROUS finding, or, without trust, any finding that needs trust.
    """
    report = scan(path, limits=limits)
    if report.errors:
        raise UnsafeFileError(path, report, f"{path}: refused: it could not be scanned ({report.errors[0].message})")
    dangerous = report.at_least(Severity.DANGEROUS)
    if dangerous:
        raise UnsafeFileError(path, report, f"{path}: refused: {_summary(dangerous)} "
                                            f"(run `modelkit scan {path}` for the full report)")
    trusted = [f for f in report.findings if needs_trust(f)]
    if trusted and not trust:
        raise UnsafeFileError(path, report, f"{path}: loading it runs code from the file: {_summary(trusted)}; "
                                            "pass --trust (API: trust=True) if you trust where it came from")
    return report


def gate_template(path: PathLike, template: str) -> None:
    """The chat-template check of `gate` for a template kept in a file of its own (a Hugging Face folder's
    chat_template.jinja), which is not a format the scanner reads: a template-injection payload is refused.

    Raises:
        UnsafeFileError: the template holds a DANGEROUS pattern.
    """
    from modelkit.scan import headers

    label = str(path)
    ctx = Context(display=label, directory=None, limits=Limits(), deadline=time.monotonic() + 60)
    headers.check_template(template, os.path.basename(label), ctx, label)
    report = ScanReport(findings=ctx.findings)
    dangerous = report.at_least(Severity.DANGEROUS)
    if dangerous:
        raise UnsafeFileError(path, report, f"{path}: refused: {_summary(dangerous)}")


def _summary(findings: list[Finding]) -> str:
    shown = "; ".join(f"{f.rule} {f.callable or f.name}".rstrip() + f" in {f.path}" for f in findings[:3])
    return shown + (f" and {len(findings) - 3} more" if len(findings) > 3 else "")


class _CallablePackage(types.ModuleType):
    """Lets the package stand for its main function: modelkit.scan(path) is modelkit.scan.scan(path)."""

    def __call__(self, path: PathLike, **kwargs) -> ScanReport:
        return scan(path, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
# What modelkit/__init__.py's lazy table resolves `modelkit.scan` to: this package (the same object the
# import system binds), so the attribute never flips between the package and the function.
_PACKAGE = sys.modules[__name__]
