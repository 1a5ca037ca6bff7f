"""The `modelkit` command line: a click group (modelkit/cli/app.py) with one module per command, the
options they share (options.py), and how results are shown (output.py, progress.py, logs.py).

`main` is the click group (for `CliRunner` and anyone embedding the CLI); `run` is the console script.
"""
from modelkit.cli.app import COMMANDS, EXIT_ERROR, EXIT_OK, EXIT_UNSAFE, main, run

__all__ = ["COMMANDS", "EXIT_ERROR", "EXIT_OK", "EXIT_UNSAFE", "main", "run"]
