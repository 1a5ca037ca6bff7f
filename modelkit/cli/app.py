"""The click side of the `modelkit` command: a lazy group (each command imports on first use) and the one error handler.

Exit codes and the command table live in `modelkit/cli/__init__.py`, which imports no click.
"""
from __future__ import annotations

import importlib
import json
import os
import sys

import click

from modelkit import __version__
from modelkit.cli import COMMANDS, EXIT_ERROR, JSON_META_KEY, STDLIB_COMMANDS
from modelkit.cli.logs import configure_logging
from modelkit.errors import ModelkitError


def debug_enabled(ctx: click.Context | None = None) -> bool:
    if os.environ.get("MODELKIT_DEBUG", "") not in ("", "0"):
        return True
    obj = (ctx.find_root().obj if ctx else None) or {}
    return bool(obj.get("debug"))


class LazyGroup(click.Group):
    """Imports a command's module only when that command runs or its help is shown."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in STDLIB_COMMANDS:
            return _forwarding_command(name)
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
        except OSError as e:        # the system's refusal (a full disk, a file size limit, permissions)
            _report(ctx, e, f"{e.filename}: {e.strerror}" if e.filename and e.strerror
                    else f"the system refused a read or write: {e.strerror or e}; no output was left behind")
            ctx.exit(EXIT_ERROR)


def _report(ctx: click.Context, error: Exception, message: str | None = None) -> None:
    """The one place a library error becomes output: a JSON document or one line on stderr."""
    if debug_enabled(ctx):
        import traceback

        traceback.print_exception(error, file=sys.stderr)
    if ctx.meta.get(JSON_META_KEY):
        doc = {"schema": "modelkit.error/1", "ok": False,
               "error": {"type": type(error).__name__, "message": message or str(error)}}
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(f"Error: {message or error}", err=True)


def set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    """Callback for every command's --json flag: errors then come out as JSON too."""
    ctx.meta[JSON_META_KEY] = value
    return value


json_option = click.option("--json", "as_json", is_flag=True, is_eager=True, callback=set_json,
                           help="Print one JSON document on stdout (also on error).")


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="modelkit")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv for debug).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars or log lines; results only.")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors (same as MODELKIT_DEBUG=1).")
@click.pass_context
def main(ctx: click.Context, verbose: int, quiet: bool, debug: bool) -> None:
    """Move trained models between formats safely, make them smaller, check untrusted files.

    \b
    Examples:
      modelkit train cnn --out runs/cnn
      modelkit eval runs/cnn/model.safetensors
      modelkit inspect runs/cnn/model.safetensors --json
      modelkit generate runs/tinylm/model.safetensors --prompt "def "
    """
    ctx.obj = {"quiet": quiet, "debug": debug, "verbose": verbose}
    if ctx.invoked_subcommand in STDLIB_COMMANDS:
        return      # they set up their own logging (only at -v: importing logging costs start-up time)
    configure_logging(verbose, quiet)


def _forwarding_command(name: str) -> click.Command:
    """A command written without click (STDLIB_COMMANDS): its arguments pass through untouched.

    It parses them itself, so `modelkit scan --help` and `modelkit --quiet scan` mean the same through
    click as through the fast path in `modelkit.cli.run`.
    """
    module_name, short_help = STDLIB_COMMANDS[name]

    @click.command(name, short_help=short_help, add_help_option=False,
                   context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    @click.pass_context
    def command(ctx: click.Context, args: tuple[str, ...]) -> None:
        obj = ctx.find_root().obj or {}
        options = ["--quiet"] * bool(obj.get("quiet")) + ["--debug"] * bool(obj.get("debug")) + \
            ["-v"] * int(obj.get("verbose") or 0)
        try:
            code = importlib.import_module(module_name).run([*options, *args], prog=f"modelkit {name}")
        except SystemExit as e:       # argparse's --help and usage errors
            code = e.code if isinstance(e.code, int) else EXIT_ERROR
        ctx.exit(code)

    return command
