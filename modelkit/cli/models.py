"""`modelkit models`: the models modelkit knows: the zoo it builds and trains, and the Hugging Face families it reads."""
from __future__ import annotations

import click

from modelkit.cli.options import output_options
from modelkit.cli.output import emit_json, table
from modelkit.models import MODELS, hf_families


@click.command()
@output_options
def models(as_json: bool) -> None:
    """List the reference models (the zoo: train, eval, demo) and the Hugging Face families (folders
    and their GGUF files: inspect, convert, quantize).

    \b
    Example:
      modelkit models
      modelkit models --json | jq '.models[] | select(.kind == "hf") | .model_types'
    """
    families = hf_families()
    rows = [{"name": name, "kind": "hf" if name in families else "topology" if info.topology else "zoo", "summary": info.summary,
             **({"model_types": list(families[name].model_types), "gguf_architecture": families[name].architecture}
                if name in families else {})}
            for name, info in MODELS.items()]
    rows.sort(key=lambda r: (r["kind"] != "zoo", r["name"]))
    if as_json:
        emit_json({"schema": "modelkit.models/1", "ok": True, "models": rows})
        return
    click.echo(table(["name", "kind", "what"],
                     [(r["name"], r["kind"], r["summary"] + (f"; model_type {', '.join(r['model_types'])}" if r["kind"] == "hf" else ""))
                      for r in rows]))
