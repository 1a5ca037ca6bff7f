"""`modelkit generate`: continue a prompt with a language model (tinylm or a Hugging Face family's)."""
from __future__ import annotations

import click

from modelkit.cli.options import output_options, read_options
from modelkit.cli.output import emit_json


@click.command()
@click.argument("checkpoint", type=click.Path(dir_okay=True))
@click.option("--prompt", default="def ", show_default=True, help="Text to continue.")
@click.option("--max-new-tokens", "max_new_tokens", type=click.IntRange(0, 100_000),
              help="Tokens to generate (default 64; tinylm's tokens are bytes: --max-bytes).")
@click.option("--max-bytes", "max_bytes", type=click.IntRange(0, 100_000),
              help="tinylm: bytes to generate (default 200).")
@click.option("--temperature", type=click.FloatRange(0.0), default=0.0, show_default=True, help="0 is greedy; higher samples more freely.")
@click.option("--top-k", type=click.IntRange(1), help="Sample only from the K most likely tokens.")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True),
              help="Sample only from the most likely tokens whose probabilities add up to P (Hugging Face models).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for sampling.")
@click.option("--chat", is_flag=True,
              help="Render the prompt as a user message with the model's chat template (Hugging Face models).")
@read_options()
@output_options
def generate(checkpoint: str, prompt: str, max_new_tokens: int | None, max_bytes: int | None, temperature: float,
             top_k: int | None, top_p: float | None, seed: int, chat: bool, source_format: str | None, trust: bool,
             key: str | None, arch: str | None, as_json: bool) -> None:
    """Print PROMPT and its continuation by the language model in CHECKPOINT.

    CHECKPOINT is a tinylm checkpoint (byte tokens) or a causal language model of a Hugging Face family:
    a model folder, a GGUF of one or a quantized output, run by transformers with the model's own tokenizer
    and KV cache. Greedy by default; generation stops at the end-of-sequence token. With --json, the
    prompt and new token counts and tokens per second for the prompt and for decoding.

    \b
    Examples:
      modelkit generate runs/tinylm/model.safetensors --prompt "def "
      modelkit generate runs/tinylm/model.safetensors --prompt "import " --temperature 0.8 --top-k 20
      modelkit generate ./Qwen2.5-0.5B-Instruct --prompt "Name three rivers." --chat --max-new-tokens 100
      modelkit generate model-q8_0.gguf --prompt "Once upon a time" --temperature 0.7 --top-p 0.9 --json
    """
    from modelkit.api import complete

    out = complete(checkpoint, prompt, max_new_tokens=max_new_tokens, max_new_bytes=max_bytes, temperature=temperature,
                   top_k=top_k, top_p=top_p, seed=seed, chat=chat, format=source_format, trust=trust, key=key,
                   arch=arch)
    if as_json:
        emit_json({"schema": "modelkit.generate/1", "ok": True, **out.to_dict()})
        return
    click.echo(out.text if chat else prompt + out.text)

