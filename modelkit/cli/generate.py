"""`modelkit generate`: continue a prompt with a tinylm checkpoint."""
from __future__ import annotations

import click

from modelkit.cli.options import output_options, read_options
from modelkit.cli.output import emit_json


@click.command()
@click.argument("checkpoint", type=click.Path(dir_okay=True))
@click.option("--prompt", default="def ", show_default=True, help="Text to continue.")
@click.option("--max-bytes", "max_bytes", type=click.IntRange(0, 100_000), default=200, show_default=True, help="Bytes to generate.")
@click.option("--temperature", type=click.FloatRange(0.0), default=0.0, show_default=True, help="0 is greedy; higher samples more freely.")
@click.option("--top-k", type=click.IntRange(1), help="Sample only from the K most likely bytes.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for sampling.")
@read_options()
@output_options
def generate(checkpoint: str, prompt: str, max_bytes: int, temperature: float, top_k: int | None,
             seed: int, source_format: str | None, trust: bool, key: str | None, arch: str | None,
             as_json: bool) -> None:
    """Print PROMPT and its continuation by the tinylm in CHECKPOINT.

    \b
    Examples:
      modelkit generate runs/tinylm/model.safetensors --prompt "def "
      modelkit generate runs/tinylm/model.safetensors --prompt "import " --temperature 0.8 --top-k 20
    """
    from modelkit.api import generate as run_generate

    data = run_generate(checkpoint, prompt, max_new_bytes=max_bytes, temperature=temperature, top_k=top_k, seed=seed,
                        format=source_format, trust=trust, key=key, arch=arch)
    text = data.decode("utf-8", errors="replace")
    if as_json:
        emit_json({"schema": "modelkit.generate/1", "ok": True, "prompt": prompt, "completion": text})
        return
    click.echo(prompt + text)
