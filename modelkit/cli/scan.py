"""`modelkit scan`: check model files for code that runs on load and headers that lie, without loading them.

A click command like the others. The scanner itself (modelkit.scan) is standard-library only and never
imports torch; this module adds only click, so the command starts in a few tens of milliseconds.
"""
from __future__ import annotations

import sys

import click

from modelkit import __version__
from modelkit.cli.app import EXIT_ERROR, EXIT_OK, EXIT_UNSAFE
from modelkit.cli.options import output_options
from modelkit.cli.output import Progress
from modelkit.scan import ScanReport, Severity, scan_paths

_FAIL_ON = {"suspicious": Severity.SUSPICIOUS, "dangerous": Severity.DANGEROUS}


@click.command()
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option("-r", "--recursive", is_flag=True, help="Scan folders' sub-folders too.")
@click.option("--fail-on", type=click.Choice(sorted(_FAIL_ON)), default="dangerous", show_default=True,
              help="Lowest severity that makes the exit code 1.")
@click.option("--strict", is_flag=True, help="Same as --fail-on suspicious.")
@click.option("--sarif", metavar="FILE", type=click.Path(dir_okay=False),
              help="Also write the findings as SARIF 2.1.0 to FILE (for CI code scanning).")
@output_options
@click.pass_context
def scan(ctx: click.Context, paths: tuple[str, ...], recursive: bool, fail_on: str, strict: bool, sarif: str | None,
         as_json: bool) -> None:
    """Check model files for code that runs when they are loaded, and for headers that lie.

    Reads pickles (torch .pt/.bin/.ckpt, joblib, numpy object arrays) opcode by opcode without
    unpickling, TorchScript code, zip/tar containers, Keras configs, ONNX external data,
    safetensors and GGUF headers. Formats are recognised by content, not by file name.

    Exit codes: 0 nothing at or above --fail-on; 1 unsafe content found; 2 a file could not be
    scanned, or nothing matched (fail closed).

    \b
    Examples:
      modelkit scan pytorch_model.bin
      modelkit scan models/ --recursive --fail-on suspicious
      modelkit scan downloads/*.pt --json
      modelkit scan checkpoints/ -r --sarif scan.sarif
    """
    threshold = Severity.SUSPICIOUS if strict else _FAIL_ON[fail_on]
    with Progress("scanning", enabled=not as_json) as bar:
        def progress(done: int, total: int) -> None:
            if total > 1:     # a bar only when there are many files
                bar(done, total)
        report = scan_paths(list(paths), recursive=recursive, progress=progress)
    if as_json or sarif is not None:
        import json
    if sarif is not None:
        from pathlib import Path

        from modelkit.scan.sarif import to_sarif
        from modelkit.storage.atomic import atomic_path

        try:    # a report replaced on every run: written aside, fsynced, renamed (never half a file)
            with atomic_path(Path(sarif), force=True) as tmp:
                tmp.write_text(json.dumps(to_sarif(report, version=__version__), indent=2) + "\n", encoding="utf-8")
        except OSError as e:
            raise OSError(e.errno, f"cannot write the SARIF file ({e.strerror or e})", sarif) from e
    if as_json:
        sys.stdout.write(json.dumps(report.to_dict(threshold), indent=2) + "\n")
    else:
        sys.stdout.write(render(report, threshold))
    if report.at_least(threshold):
        ctx.exit(EXIT_UNSAFE)
    ctx.exit(EXIT_ERROR if report.errors else EXIT_OK)


def _belongs(finding_path: str, file: str) -> bool:
    return finding_path == file or finding_path.startswith((file + ":", file + "@"))


def render(report: ScanReport, threshold: Severity) -> str:
    """Per file: the detected format, what was examined, then each finding and why it matters."""
    lines: list[str] = []
    worst_of: dict[str, Severity] = {}
    for scanned in report.files:
        findings = [f for f in report.findings if f.severity > Severity.SAFE and _belongs(f.path, scanned.path)]
        worst = worst_of[scanned.path] = max((f.severity for f in findings), default=Severity.SAFE)
        lines.append(f"{scanned.path}: {scanned.format} - {'clean' if worst == Severity.SAFE else worst.label.upper()}")
        lines.extend(f"  examined {line}" for line in scanned.examined)
        for f in sorted(findings, key=lambda f: -f.severity):
            where = f.path + (f" @ byte {f.offset}" if f.offset is not None else "")
            lines.append(f"  {f.severity.label.upper():10} {f.rule}  {where}" + (f"  {f.callable}" if f.callable else ""))
            lines.append(f"             {f.detail}")
    lines.extend(f"{error.path}: ERROR - {error.message}" for error in report.errors)
    tally = {s: sum(1 for w in worst_of.values() if w == s) for s in Severity}
    lines.append(f"\nScanned {report.scanned} file(s): {tally[Severity.DANGEROUS]} dangerous, "
                 f"{tally[Severity.SUSPICIOUS]} suspicious, {tally[Severity.SAFE]} clean, {len(report.errors)} error(s); "
                 f"exit 1 at {threshold.label} and above.")
    return "\n".join(lines) + "\n"
