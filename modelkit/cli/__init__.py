"""The `modelkit` command: exit codes, the command table and the console-script entry point.

This module imports no click: `modelkit scan`, which CI systems run over many files and which must
start fast, is parsed with the standard library (modelkit/cli/scan.py) and never loads click. Every
other command goes through the click group in modelkit/cli/app.py; `modelkit.cli.main` is that
group (resolved on first use), for `CliRunner` and for anyone embedding the CLI.

Exit codes (ClamAV-compatible, like picklescan and fickling):
  0  success; for `scan`, nothing at or above the failing severity
  1  `scan` only: unsafe content found
  2  any error: bad usage, a bad or unsupported file, a failed verification
"""
from __future__ import annotations

import sys

EXIT_OK = 0
EXIT_UNSAFE = 1
EXIT_ERROR = 2
JSON_META_KEY = "modelkit.json"    # set by a command's --json option, read by the error handler

# command name -> "module:attribute"; nothing here is imported until the command is used.
COMMANDS = {
    "convert": "modelkit.cli.convert:convert",
    "demo": "modelkit.cli.demo:demo",
    "distill": "modelkit.cli.distill:distill",
    "eval": "modelkit.cli.evaluate:eval_command",
    "generate": "modelkit.cli.generate:generate",
    "inspect": "modelkit.cli.inspect:inspect",
    "models": "modelkit.cli.models:models",
    "prune": "modelkit.cli.prune:prune",
    "quantize": "modelkit.cli.quantize:quantize",
    "scan": "modelkit.cli.scan:run",
    "train": "modelkit.cli.train:train",
}
# Commands written with argparse, not click: name -> (module with run(argv, prog=...), one-line help).
STDLIB_COMMANDS = {
    "scan": ("modelkit.cli.scan", "Check model files for code that runs on load, and headers that lie."),
}
_APP = ("main", "json_option", "debug_enabled", "set_json", "LazyGroup")


def run(argv: list[str] | None = None) -> None:
    """The console script: `modelkit ARGS...`.

    `modelkit scan ...` goes straight to the scanner's own parser (no click, about half the start-up
    time of the scan itself on a 1 GiB checkpoint); everything else, including global options before
    `scan`, goes through the click group.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] and args[0] in STDLIB_COMMANDS:
        import importlib

        name = args[0]
        sys.exit(importlib.import_module(STDLIB_COMMANDS[name][0]).run(args[1:], prog=f"modelkit {name}"))
    from modelkit.cli.app import main as group

    group(args=args, prog_name="modelkit")


def __getattr__(name: str):
    if name in _APP:
        from modelkit.cli import app

        return getattr(app, name)
    raise AttributeError(f"module 'modelkit.cli' has no attribute {name!r}")
