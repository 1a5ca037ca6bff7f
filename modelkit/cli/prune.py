"""`modelkit prune`: make a model sparse or smaller, with the accuracy cost measured."""
from __future__ import annotations

import click

from modelkit.cli.options import device_option, force_option, output_options, read_options
from modelkit.cli.output import Progress, emit_json, human_bytes, table
from modelkit.formats import FORMATS


def _value(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


@click.command()
@click.argument("src", type=click.Path(dir_okay=True))
@click.argument("dst", type=click.Path(dir_okay=True))
@click.option("--to", "to", type=click.Choice(sorted(FORMATS)),
              help="Output format (default: from DST's suffix; hf for a model folder).")
@click.option("--method", type=click.Choice(["magnitude", "2:4", "structured"]), default="magnitude", show_default=True)
@click.option("--sparsity", type=click.FloatRange(0.0, 1.0, max_open=True), default=0.5, show_default=True,
              help="Fraction of weights (magnitude) or of units (structured) to remove; 2:4 is always 0.5.")
@click.option("--scope", type=click.Choice(["layer", "global"]), default="layer", show_default=True,
              help="magnitude: prune each layer to the sparsity, or rank all weights together.")
@click.option("--skip", multiple=True, metavar="PATTERN", help="Module names to leave dense (fnmatch, repeatable).")
@click.option("--finetune-epochs", type=click.IntRange(0), default=0, show_default=True,
              help="Recover accuracy by training after pruning; pruned weights stay zero (a Hugging Face language "
                   "model trains on text: --data, or the standard library's train split).")
@click.option("--steps", type=click.IntRange(1), help="Fine-tuning: stop each epoch after this many steps.")
@click.option("--data", type=click.Path(dir_okay=False, exists=True),
              help="Hugging Face language models: fine-tune on this UTF-8 text file.")
@click.option("--max-tokens", "max_tokens", type=click.IntRange(1),
              help="Hugging Face language models: score at most this many tokens of the evaluation text.")
@click.option("--lr", type=float, help="Fine-tuning learning rate (default: the model's own; 2e-05 for a Hugging "
                                       "Face language model).")
@click.option("--seed", type=int, default=0, show_default=True)
@device_option
@read_options()
@force_option
@output_options
def prune(src: str, dst: str, to: str | None, method: str, sparsity: float, scope: str, skip: tuple[str, ...], finetune_epochs: int,
          steps: int | None, data: str | None, max_tokens: int | None, lr: float | None, seed: int, device: str, source_format: str | None, trust: bool, key: str | None,
          arch: str | None, force: bool, as_json: bool) -> None:
    """Prune the model in SRC and save it to DST (any format, from DST's suffix).

    Prints parameters and file size before and after, the sparsity of each layer, and the metric
    before pruning, after pruning and after fine-tuning. structured pruning removes whole units,
    so DST is a smaller model that rebuilds from its ArchSpec.

    SRC may be a Hugging Face model folder (or a GGUF of one). structured pruning removes query heads
    (the same number under each key/value head; under multi-head attention whole heads with their keys
    and values) and MLP hidden units of llama, mistral, qwen2, qwen3, gemma2, gemma3 and phi3 models
    (phi3's fused qkv_proj and gate_up_proj are cut inside), and DST's config.json gets the new
    num_attention_heads, head_dim and intermediate_size, so transformers loads it. gpt2 loses MLP hidden
    units only (n_inner): transformers' GPT-2 cannot hold fewer heads at the same width, and a phi3 with
    longrope keeps its heads too; a "kept:" line says so. magnitude and 2:4 work on every family. The metric is
    bits per byte on the held-out standard-library text, with the model's tokenizer; --finetune-epochs
    trains it on text (next-token loss on windows of its tokenizer's ids, from --data or the standard
    library's train split, which shares no file with the held-out text).

    \b
    Examples:
      modelkit prune runs/cnn/model.safetensors cnn-s50.safetensors --method structured --sparsity 0.5 --finetune-epochs 10
      modelkit prune runs/cnn/model.safetensors cnn-24.safetensors --method 2:4 --finetune-epochs 10
      modelkit prune runs/tinylm/model.safetensors lm-m80.safetensors --sparsity 0.8 --scope global --json
      modelkit prune ./Qwen2.5-0.5B qwen-s25 --to hf --method structured --sparsity 0.25 --max-tokens 20000
      modelkit prune ./Qwen2.5-0.5B qwen-s25 --method structured --sparsity 0.25 --finetune-epochs 1 --steps 200
    """
    from modelkit.pipeline.compress import prune_file
    from modelkit.quantizers.prune import PruneConfig

    config = PruneConfig(method=method, sparsity=sparsity, scope=scope, skip=skip)
    with Progress("fine-tune", enabled=not as_json) as progress:
        report = prune_file(src, dst, config, finetune_epochs=finetune_epochs, lr=lr, seed=seed, device=device,
                            force=force, progress=progress, source_format=source_format, trust=trust, key=key,
                            arch=arch, max_tokens=max_tokens, to=to, steps=steps, data=data)
    if report is None:                  # a rank other than 0 under torchrun: rank 0 reports
        return
    if as_json:
        emit_json({"schema": "modelkit.prune/1", "ok": True, **report.to_dict()})
        return
    p, b, v = report.parameters, report.bytes, report.values
    click.echo(f"{report.source} -> {report.target}: {method}"
               + (f" {sparsity:.0%}" if method != "2:4" else "") + (f" + {finetune_epochs} fine-tune epochs" if finetune_epochs else ""))
    click.echo(table(["", "before", "after"], [
        ("parameters", f"{p['before']:,}", f"{p['after']:,}"),
        ("file", human_bytes(b["before"]), human_bytes(b["after"])),
        (report.metric, _value(v["before"]), f"{_value(v['after'])} pruned, {_value(v['finetuned'])} fine-tuned"),
    ], align="lrl"))
    for line in report.kept:
        click.echo(f"kept: {line}")
    click.echo(table(["layer", "sparsity", "zeros"], [(r["layer"], f"{r['sparsity']:.1%}", f"{r['zeros']:,}/{r['total']:,}")
                                                     for r in report.layers], align="lrr"))
