"""The options commands share, defined once so every command spells them the same way.

- read options, on every command that reads a model file: `--format`, `--trust`, `--key`, `--arch`
- the write option, on every command that writes: `--force`
- input options, on every command that exports a user's module: `--input-shape` (also `--example-input`), `--dynamic`
- `--kv-cache`, on every command that exports a causal LM's graph (convert)
- output options, on every command (and on the group, before the command): `--json`, `-q`, `-v`, `--debug`

Choices come from the tables (FORMATS, MODELS, the runtimes); nothing here imports torch.
docs/cli.md lists the grammar.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

JSON_META_KEY = "modelkit.json"    # set by --json, read by the error handler (modelkit/cli/app.py)
DEVICES = ("auto", "cpu", "cuda", "mps")

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class TableChoice(click.Choice):
    """A choice from one of modelkit's tables; a wrong name gets "did you mean" as the library's errors do."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter as e:
            from modelkit.errors import did_you_mean

            e.message = f"{e.message}{did_you_mean(str(value), self.choices)}"
            raise


def _root_obj(ctx: click.Context) -> dict[str, Any]:
    root = ctx.find_root()
    if root.obj is None:
        root.obj = {}
    return root.obj


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.meta[JSON_META_KEY] = True       # ctx.meta is shared by the whole invocation
    return bool(value or ctx.meta.get(JSON_META_KEY))   # `modelkit --json CMD` counts for CMD too


def _set_quiet(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        obj = _root_obj(ctx)
        obj["quiet"] = True
        _relog(obj)


def _add_verbose(ctx: click.Context, _param: click.Parameter, value: int) -> None:
    if value:
        obj = _root_obj(ctx)
        obj["verbose"] = int(obj.get("verbose") or 0) + value
        _relog(obj)


def _set_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        _root_obj(ctx)["debug"] = True


def _relog(obj: dict[str, Any]) -> None:
    from modelkit.cli.logs import configure_logging

    configure_logging(int(obj.get("verbose") or 0), bool(obj.get("quiet")))


def json_flag(f: Callable[..., Any]) -> Callable[..., Any]:
    """`--json`, passed to the command as `as_json`; errors then come out as JSON too."""
    return click.option("--json", "as_json", is_flag=True, is_eager=True, callback=_set_json,
                        help="Print one JSON document on stdout (also on error).")(f)


def output_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """`--json` (as `as_json`), and `-q`, `-v`, `--debug`, which take effect for the whole invocation
    whether they come before the command (`modelkit -q convert ...`) or after it."""
    f = click.option("--debug", is_flag=True, expose_value=False, callback=_set_debug,
                     help="Show tracebacks for errors (same as MODELKIT_DEBUG=1).")(f)
    f = click.option("-v", "--verbose", count=True, expose_value=False, callback=_add_verbose,
                     help="More log output on stderr (-vv for debug).")(f)
    f = click.option("-q", "--quiet", is_flag=True, expose_value=False, callback=_set_quiet,
                     help="No progress display or log lines; results only.")(f)
    return json_flag(f)


def read_options(*, arch: bool = True) -> Decorator:
    """`--format`, `--trust`, `--key` and (with `arch`) `--arch`, passed as source_format, trust, key, arch."""
    from modelkit.formats import FORMATS

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        if arch:
            f = click.option("--arch", metavar="NAME|MODULE:FACTORY",
                             help="The model to rebuild when the file names none (or to override it): a "
                                  "registered model or a factory module:function / module:Class of your own, "
                                  "imported from the current directory first.")(f)
        f = click.option("--key", metavar="ENTRY",
                         help="Nested checkpoints: the entry holding the state_dict (e.g. model, state_dict).")(f)
        f = click.option("--trust", is_flag=True,
                         help="Allow inputs that run code when loaded (whole-module pickles, TorchScript); "
                              "dangerous findings are refused even then.")(f)
        return click.option("--format", "--from", "source_format", type=TableChoice(sorted(FORMATS)),
                            help="Read the input as this format (default: detected from its content).")(f)

    return decorate


def input_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """`--input-shape` (also spelled `--example-input`) and `--dynamic`, passed as example_inputs and dynamic
    (tuples of strings; modelkit.pipeline.inputs reads them)."""
    f = click.option("--dynamic", "dynamic", multiple=True, metavar="NAME:AXIS",
                     help="ONNX: leave this axis of input NAME free (input:0, ids:1); repeat for several. "
                          "Default: axis 0 of every input.")(f)
    return click.option("--input-shape", "--example-input", "example_inputs", multiple=True,
                        metavar="[NAME=]DIMS[:DTYPE][:LOW..HIGH]",
                        help="An example input for a user's module (--arch module:function), in forward's order; "
                             "repeat for several: input=1x3x224x224:float32, ids=1x16:int64. Seeded random "
                             "values: floats standard normal, bool 0/1, integers in LOW..HIGH (HIGH excluded), "
                             "else [0, smallest nn.Embedding size), else [0, 100).")(f)


def kv_cache_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """`--kv-cache`, passed as kv_cache: ONNX of a Hugging Face causal LM with past/present key-value tensors."""
    return click.option("--kv-cache", "kv_cache", is_flag=True,
                        help="ONNX of a Hugging Face causal LM: also take past_key_values.N.key/value and return "
                             "present.N.key/value (a decode step with the cache); checked on a prefill and a decode step.")(f)


def force_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """`--force`: replace an existing output (outputs are still written aside, verified, then renamed)."""
    return click.option("--force", is_flag=True, help="Overwrite the output if it exists.")(f)


def device_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--device", type=TableChoice(DEVICES), default="auto", show_default=True,
                        help="Where to run (auto: cuda, then mps, then cpu).")(f)
