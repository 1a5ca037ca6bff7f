"""`modelkit models`: the reference models modelkit can build and train."""
from __future__ import annotations

import click

from modelkit.cli.options import output_options
from modelkit.cli.output import emit_json, table
from modelkit.models import MODELS


@click.command()
@output_options
def models(as_json: bool) -> None:
    """List the reference models (the zoo).

    \b
    Example:
      modelkit models
    """
    if as_json:
        emit_json({"schema": "modelkit.models/1", "ok": True,
                   "models": [{"name": m.name, "summary": m.summary} for m in MODELS.values()]})
        return
    click.echo(table(["name", "what"], [(m.name, m.summary) for m in MODELS.values()]))
