"""`modelkit scan`: check model files for code that runs on load and headers that lie, without loading them.

Standard library only (argparse, not click; modelkit.scan is standard-library only too): CI systems
run this over many files, and start-up is most of the time a scan takes. `modelkit scan ...` reaches
`run` straight from the console script; through the click group (`modelkit -q scan ...`,
`CliRunner`) the arguments are forwarded here unchanged.
"""
from __future__ import annotations

import argparse
import os
import sys

from modelkit import __version__
from modelkit.cli import EXIT_ERROR, EXIT_OK, EXIT_UNSAFE
from modelkit.cli.logs import configure_logging
from modelkit.cli.progress import Progress
from modelkit.scan import ScanReport, Severity, scan_paths

_FAIL_ON = {"suspicious": Severity.SUSPICIOUS, "dangerous": Severity.DANGEROUS}

_DESCRIPTION = """\
Check model files for code that runs when they are loaded, and for headers that lie.

Reads pickles (torch .pt/.bin/.ckpt, joblib, numpy object arrays) opcode by opcode without
unpickling, TorchScript code, zip/tar containers, Keras configs, ONNX external data,
safetensors and GGUF headers. Formats are recognised by content, not by file name."""

_EPILOG = """\
Exit codes: 0 nothing at or above --fail-on; 1 unsafe content found;
            2 a file could not be scanned, or nothing matched (fail closed).

Examples:
  modelkit scan pytorch_model.bin
  modelkit scan models/ --recursive --fail-on suspicious
  modelkit scan downloads/*.pt --json
  modelkit scan checkpoints/ -r --sarif scan.sarif"""


def _formatter(prog: str) -> argparse.HelpFormatter:
    """argparse's formatter at the terminal's width, found with os, not shutil (argparse builds one per
    add_argument, and shutil's import, with bz2 and lzma, is a tenth of this command's start-up)."""
    columns = os.environ.get("COLUMNS", "")
    try:
        width = int(columns) if columns.isdigit() else os.get_terminal_size(sys.__stdout__.fileno()).columns
    except (AttributeError, ValueError, OSError):
        width = 80
    return argparse.RawDescriptionHelpFormatter(prog, width=max(width - 2, 40))


def build_parser(prog: str = "modelkit scan") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION, epilog=_EPILOG, formatter_class=_formatter)
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or folders to scan")
    parser.add_argument("-r", "--recursive", action="store_true", help="scan folders' sub-folders too")
    parser.add_argument("--fail-on", choices=sorted(_FAIL_ON), default="dangerous",
                        help="lowest severity that makes the exit code 1 (default: dangerous)")
    parser.add_argument("--strict", action="store_true", help="same as --fail-on suspicious")
    parser.add_argument("--sarif", metavar="FILE",
                        help="also write the findings as SARIF 2.1.0 to FILE (for CI code scanning)")
    parser.add_argument("--json", dest="as_json", action="store_true",
                        help="print one JSON document on stdout (also on error)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress display; results only")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log lines on stderr (-vv for debug)")
    parser.add_argument("--debug", action="store_true", help="log internal scanner errors with tracebacks")
    return parser


def run(argv: list[str], *, prog: str = "modelkit scan") -> int:
    """Parse `argv` (the words after `scan`), scan, print the report; returns the exit code."""
    args = build_parser(prog).parse_args(argv)
    if args.verbose or args.debug:
        configure_logging(2 if args.debug else args.verbose)
    threshold = Severity.SUSPICIOUS if args.strict else _FAIL_ON[args.fail_on]
    with Progress("scanning", enabled=not (args.as_json or args.quiet)) as bar:
        def progress(done: int, total: int) -> None:
            if total > 1:     # a bar only when there are many files
                bar(done, total)
        report = scan_paths(args.paths, recursive=args.recursive, progress=progress)
    if args.as_json or args.sarif is not None:
        import json
    if args.sarif is not None:
        from modelkit.scan.sarif import to_sarif

        try:
            with open(args.sarif, "w", encoding="utf-8") as f:
                f.write(json.dumps(to_sarif(report, version=__version__), indent=2) + "\n")
        except OSError as e:
            sys.stderr.write(f"Error: {args.sarif}: cannot write the SARIF file ({e.strerror or e})\n")
            return EXIT_ERROR
    if args.as_json:
        sys.stdout.write(json.dumps(report.to_dict(threshold), indent=2) + "\n")
    else:
        sys.stdout.write(render(report, threshold))
    if report.at_least(threshold):
        return EXIT_UNSAFE
    return EXIT_ERROR if report.errors else EXIT_OK


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
