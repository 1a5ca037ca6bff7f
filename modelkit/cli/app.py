"""The `modelkit` command: the click group (each command imports on first use), exit codes, and the one
place where errors become output.

Exit codes (ClamAV-compatible, like picklescan and fickling):
  0  success; for `scan`, nothing at or above the failing severity
  1  `scan` only: unsafe content found
  2  any error: bad usage, a bad or unsupported file, a failed verification
"""
from __future__ import annotations

import importlib
import os
import sys

import click

from modelkit import __version__
from modelkit.cli.logs import configure_logging
from modelkit.cli.options import JSON_META_KEY, output_options
from modelkit.errors import ModelkitError

# Packages of the optional extras (pyproject.toml) -> the extra that installs them; the slim install's own.
CORE = ("numpy", "safetensors", "gguf", "h5py", "click")
EXTRAS = {"torch": "torch", "onnx": "onnx", "onnxruntime": "onnx", "onnxscript": "onnx", "matplotlib": "plot",
          "starlette": "serve", "uvicorn": "serve", "prometheus_client": "serve"}

EXIT_OK = 0
EXIT_UNSAFE = 1
EXIT_ERROR = 2

# command name -> "module:attribute"; nothing here is imported until the command is used.
COMMANDS = {
    "convert": "modelkit.cli.convert:convert",
    "demo": "modelkit.cli.demo:demo",
    "distill": "modelkit.cli.distill:distill",
    "eval": "modelkit.cli.evaluate:eval_command",
    "generate": "modelkit.cli.generate:generate",
    "imatrix": "modelkit.cli.imatrix:imatrix",
    "inspect": "modelkit.cli.inspect:inspect",
    "models": "modelkit.cli.models:models",
    "prune": "modelkit.cli.prune:prune",
    "quantize": "modelkit.cli.quantize:quantize",
    "scan": "modelkit.cli.scan:scan",
    "serve": "modelkit.cli.serve:serve",
    "train": "modelkit.cli.train:train",
}

# Commands run over many files by CI systems, where start-up is most of the time: logging is set up
# for them only when -v or -q asks for it (warnings still reach stderr through logging's last resort).
LIGHT_COMMANDS = frozenset({"scan"})


def debug_enabled(ctx: click.Context | None = None) -> bool:
    if os.environ.get("MODELKIT_DEBUG", "") not in ("", "0"):
        return True
    obj = (ctx.find_root().obj if ctx else None) or {}
    return bool(obj.get("debug"))


def error_document(error_type: str, message: str) -> str:
    """The modelkit.error/1 JSON document every failure prints under --json."""
    import json  # here: `modelkit scan` without --json never needs it

    return json.dumps({"schema": "modelkit.error/1", "ok": False, "error": {"type": error_type, "message": message}},
                      indent=2)


class LazyGroup(click.Group):
    """Imports a command's module only when that command runs or its help is shown; turns library
    errors into one line (or one JSON document) and exit code 2."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        return getattr(importlib.import_module(module_name), attribute)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ModelkitError as e:
            _report(ctx, e)
            ctx.exit(EXIT_ERROR)
        except ModuleNotFoundError as e:    # a slim install: the command reached code that needs an extra
            package = (e.name or "").partition(".")[0]
            if package in CORE:
                fix = "it is part of every install: reinstall modelkit (pip install --force-reinstall modelkit)"
            elif package in EXTRAS:
                fix = f"pip install 'modelkit[{EXTRAS[package]}]'"
            else:
                raise
            _report(ctx, e, f"this needs {package!r}, which is not installed: {fix}")
            ctx.exit(EXIT_ERROR)
        except OSError as e:        # the system's refusal (a full disk, a file size limit, permissions)
            _report(ctx, e, f"{e.filename}: {e.strerror}" if e.filename and e.strerror
                    else f"the system refused a read or write: {e.strerror or e}; no output was left behind")
            ctx.exit(EXIT_ERROR)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """As click's, except that under --json a usage error is a modelkit.error/1 document (exit 2)."""
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode or "--json" not in argv:
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:        # usage errors and bad parameters, before any command ran
            kind = "UsageError" if isinstance(e, click.UsageError) else type(e).__name__
            click.echo(error_document(kind, e.format_message()))
            sys.exit(EXIT_ERROR)
        except click.Abort:
            click.echo(error_document("Aborted", "aborted"))
            sys.exit(EXIT_ERROR)
        sys.exit(code if isinstance(code, int) else EXIT_OK)


def _report(ctx: click.Context, error: Exception, message: str | None = None) -> None:
    """The one place a library error becomes output: a JSON document or one line on stderr."""
    if debug_enabled(ctx):
        import traceback

        traceback.print_exception(error, file=sys.stderr)
    if ctx.meta.get(JSON_META_KEY):
        click.echo(error_document(type(error).__name__, message or str(error)))
    else:
        click.echo(f"Error: {message or error}", err=True)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="modelkit")
@output_options
@click.pass_context
def main(ctx: click.Context, as_json: bool) -> None:
    """Move trained models between formats safely, make them smaller, check untrusted files.

    Options shared by the commands (docs/cli.md): --format, --trust, --key, --arch where a model
    file is read; --force where one is written; --json, -q, -v, --debug everywhere, before or
    after the command.

    \b
    Examples:
      modelkit train cnn --out runs/cnn
      modelkit eval runs/cnn/model.safetensors
      modelkit inspect runs/cnn/model.safetensors --json
      modelkit scan downloads/ --recursive
      modelkit generate runs/tinylm/model.safetensors --prompt "def "
    """
    obj = ctx.ensure_object(dict)
    if ctx.invoked_subcommand in LIGHT_COMMANDS and not (obj.get("verbose") or obj.get("quiet")):
        return          # importing logging is a tenth of a scan's start-up; -v/-q set it up when given
    configure_logging(int(obj.get("verbose") or 0), bool(obj.get("quiet")))


# Commands whose numpy work is copies, casts and comparisons, never BLAS: numpy's OpenBLAS starts no thread pool
# for them (OPENBLAS_NUM_THREADS=1 unless the user set it), 0.02 s of CPU of each start (numpy's import 0.10-0.12 s
# -> 0.08-0.10 s, measured 2026-11-28 on the 2-core VM).
NO_BLAS_COMMANDS = frozenset({"convert", "inspect", "scan"})


def run(argv: list[str] | None = None) -> None:
    """The console script: `modelkit ARGS...`; the process ends as soon as the command is done (`_exit_now`).
    Given `argv`, it is a caller's in-process run (a script, a test): SystemExit reaches the caller as usual."""
    args = sys.argv[1:] if argv is None else list(argv)
    if next((a for a in args if not a.startswith("-")), None) in NO_BLAS_COMMANDS and "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        main(args=args, prog_name="modelkit")
    except SystemExit as done:
        if argv is None:
            _exit_now(done.code)
        raise


def _exit_now(code: object) -> None:
    """End the process with `code` without the interpreter's teardown, where nothing needs it.

    The teardown frees every module and object one by one and joins numpy's BLAS threads: about 50 ms of
    CPU after `modelkit convert` (measured 2026-11-28 on the 2-core VM), 5% of a 1 GiB conversion, for
    memory the kernel frees anyway. What the teardown would still do is done here: atexit handlers run
    (logging's flush) and stdout and stderr are flushed. Returns, leaving the usual exit to the caller,
    when the code is a message to print, a thread that is not a daemon still runs (it would be joined),
    torch is loaded (its C++ destructors run at teardown), or stdout cannot be flushed (a closed pipe:
    the interpreter reports that itself)."""
    import threading

    if not (code is None or isinstance(code, int)) or sys.modules.get("torch") is not None:
        return
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    if not _flushed():
        return
    import atexit

    atexit._run_exitfuncs()          # noqa: SLF001  (what the interpreter calls; it clears them: they run once)
    if _flushed():
        os._exit(code or 0)


def _flushed() -> bool:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):       # a closed pipe, a closed file, no stdout at all
        return False
    return True
