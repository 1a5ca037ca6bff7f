"""`modelkit scan`: check model files for code that runs on load and headers that lie, without loading them.

Imports only click and the standard library (plus modelkit.scan, itself standard-library only), so
the command starts fast and never imports torch.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from modelkit import __version__
from modelkit.cli import EXIT_ERROR, EXIT_OK, EXIT_UNSAFE, json_option
from modelkit.cli.output import Progress, emit_json
from modelkit.scan import ScanReport, Severity, scan_paths

_FAIL_ON = {"suspicious": Severity.SUSPICIOUS, "dangerous": Severity.DANGEROUS}


@click.command("scan")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-r", "--recursive", is_flag=True, help="Scan folders' sub-folders too.")
@click.option("--fail-on", type=click.Choice(sorted(_FAIL_ON)), default="dangerous", show_default=True,
              help="Lowest severity that makes the exit code 1.")
@click.option("--strict", is_flag=True, help="Same as --fail-on suspicious.")
@click.option("--sarif", "sarif_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the findings as SARIF 2.1.0 to this file (for CI code scanning).")
@json_option
def scan(paths: tuple[Path, ...], recursive: bool, fail_on: str, strict: bool, sarif_path: Path | None,
         as_json: bool) -> None:
    """Check model files for code that runs when they are loaded, and for headers that lie.

    Reads pickles (torch .pt/.bin/.ckpt, joblib, numpy object arrays) opcode by opcode without
    unpickling, TorchScript code, zip/tar containers, Keras configs, ONNX external data,
    safetensors and GGUF headers. Formats are recognised by content, not by file name.

    \b
    Exit codes: 0 nothing at or above --fail-on; 1 unsafe content found;
                2 a file could not be scanned, or nothing matched (fail closed).

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
        report = scan_paths(paths, recursive=recursive, progress=progress)
    if sarif_path is not None:
        from modelkit.scan.sarif import to_sarif
        sarif_path.write_text(json.dumps(to_sarif(report, version=__version__), indent=2) + "\n")
    if as_json:
        emit_json(report.to_dict(threshold))
    else:
        _show(report, threshold)
    ctx = click.get_current_context()
    if report.at_least(threshold):
        ctx.exit(EXIT_UNSAFE)
    ctx.exit(EXIT_ERROR if report.errors else EXIT_OK)


def _belongs(finding_path: str, file: str) -> bool:
    return finding_path == file or finding_path.startswith((file + ":", file + "@"))


def _show(report: ScanReport, threshold: Severity) -> None:
    """Per file: the detected format, what was examined, then each finding and why it matters."""
    worst_of: dict[str, Severity] = {}
    for scanned in report.files:
        findings = [f for f in report.findings if f.severity > Severity.SAFE and _belongs(f.path, scanned.path)]
        worst = worst_of[scanned.path] = max((f.severity for f in findings), default=Severity.SAFE)
        click.echo(f"{scanned.path}: {scanned.format} - {'clean' if worst == Severity.SAFE else worst.label.upper()}")
        for line in scanned.examined:
            click.echo(f"  examined {line}")
        for f in sorted(findings, key=lambda f: -f.severity):
            where = f.path + (f" @ byte {f.offset}" if f.offset is not None else "")
            click.echo(f"  {f.severity.label.upper():10} {f.rule}  {where}" + (f"  {f.callable}" if f.callable else ""))
            click.echo(f"             {f.detail}")
    for error in report.errors:
        click.echo(f"{error.path}: ERROR - {error.message}")
    tally = {s: sum(1 for w in worst_of.values() if w == s) for s in Severity}
    click.echo(f"\nScanned {report.scanned} file(s): {tally[Severity.DANGEROUS]} dangerous, "
               f"{tally[Severity.SUSPICIOUS]} suspicious, {tally[Severity.SAFE]} clean, {len(report.errors)} error(s); "
               f"exit 1 at {threshold.label} and above.")
