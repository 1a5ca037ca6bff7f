"""`modelkit eval`: a reference model's metric on a split of its own data."""
from __future__ import annotations

import click

from modelkit.cli.options import device_option, output_options, read_options
from modelkit.cli.output import emit_json, format_metrics
from modelkit.formats import RUNTIMES


@click.command("eval")
@click.argument("checkpoint", type=click.Path(dir_okay=True))
@click.option("--split", type=click.Choice(["train", "val", "test"]),
              help="Data split (default: test for classifiers, val for tinylm).")
@device_option
@click.option("--runtime", type=click.Choice(RUNTIMES), default="torch", show_default=True,
              help="onnxruntime: run an ONNX file in an onnxruntime session instead of torch.")
@read_options()
@output_options
def eval_command(checkpoint: str, split: str | None, device: str, runtime: str, source_format: str | None,
                 trust: bool, key: str | None, arch: str | None, as_json: bool) -> None:
    """Evaluate CHECKPOINT: accuracy for mlp/cnn; bits per byte, perplexity and the unigram baseline for tinylm.

    \b
    Examples:
      modelkit eval runs/cnn/model.safetensors
      modelkit eval runs/tinylm/model.safetensors --split test --json
      modelkit eval cnn.onnx --runtime onnxruntime
    """
    from modelkit.api import evaluate

    result = evaluate(checkpoint, split=split, arch=arch, device=device, runtime=runtime, format=source_format,
                      trust=trust, key=key)
    if as_json:
        emit_json({"schema": "modelkit.eval/1", "ok": True, "path": checkpoint, **result})
        return
    click.echo(f"{result['model']} on {result['split']}: {format_metrics(result)}")
