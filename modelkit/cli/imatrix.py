"""`modelkit imatrix`: an importance matrix from calibration text, for `quantize --imatrix` and llama.cpp."""
from __future__ import annotations

import click

from modelkit.cli.options import device_option, force_option, output_options, read_options
from modelkit.cli.output import Progress, emit_json, human_bytes

SCHEMA = "modelkit.imatrix/1"


@click.command("imatrix")
@click.argument("model", type=click.Path(dir_okay=True))
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Calibration text (UTF-8), cut into chunks of --context tokens.")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False),
              help="Where to write the importance matrix (llama-imatrix's GGUF form, e.g. imatrix.gguf).")
@click.option("--context", type=click.IntRange(1),
              help="Tokens per chunk (default: the model's context length, at most 512 as llama-imatrix).")
@click.option("--chunks", type=click.IntRange(1), help="Run at most this many chunks (default: all the text holds).")
@device_option
@read_options()
@force_option
@output_options
def imatrix(model: str, data: str, out: str, context: int | None, chunks: int | None, device: str,
            source_format: str | None, trust: bool, key: str | None, arch: str | None, force: bool,
            as_json: bool) -> None:
    """Run MODEL (tinylm, or a Hugging Face causal language model) on calibration text and write its
    importance matrix: for each attention and feed-forward weight (llama.cpp's blk.N.* names), the sum of
    the squared activations entering each input column, and the tokens counted, as llama-imatrix writes
    them. `modelkit quantize --imatrix` and llama.cpp's `llama-quantize --imatrix` both read the file.

    \b
    Examples:
      modelkit imatrix runs/tinylm/model.safetensors --data calibration.txt --out imatrix.gguf
      modelkit quantize runs/tinylm/model.safetensors tinylm-q3_k.gguf --scheme q3_k --imatrix imatrix.gguf
      modelkit imatrix ./Qwen2.5-0.5B --data wiki.txt --out qwen.imatrix.gguf --chunks 100 --json
    """
    from modelkit.pipeline.imatrix import compute_imatrix

    with Progress("imatrix (chunks)", enabled=not as_json) as progress:
        report = compute_imatrix(model, data, out, context=context, chunks=chunks, force=force, device=device,
                                 progress=progress, source_format=source_format, trust=trust, key=key, arch=arch)
    if as_json:
        emit_json({"schema": SCHEMA, "ok": True, **report.to_dict()})
        return
    click.echo(f"{report.path}: {report.entries} weights of {report.model}, {report.chunks} chunks of "
               f"{report.chunk_size} tokens ({report.tokens:,} tokens) from {data}, {human_bytes(report.bytes)}, "
               f"{report.seconds:.3g} s")
