"""`modelkit train`: train a reference model and save it as safetensors."""
from __future__ import annotations

import json
import os

import click

from modelkit.cli.options import device_option, force_option, output_options
from modelkit.cli.output import Progress, emit_json, format_metrics, note
from modelkit.errors import ConfigError
from modelkit.models import zoo_models


def _parse_settings(values: tuple[str, ...]) -> dict[str, object]:
    """--set key=value pairs; values are JSON when they parse as JSON, else strings."""
    settings: dict[str, object] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            settings[key] = json.loads(raw)
        except json.JSONDecodeError:
            settings[key] = raw
    return settings


@click.command()
@click.argument("model", type=click.Choice(zoo_models()))
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Folder for model.safetensors and the training state.")
@click.option("--epochs", type=int, help="Passes over the training data (default: the model's own).")
@click.option("--batch-size", type=int, help="Global batch size; split across ranks under torchrun.")
@click.option("--lr", type=float, help="Peak learning rate (AdamW, warm-up then cosine decay).")
@click.option("--weight-decay", type=float, help="AdamW weight decay.")
@click.option("--steps-per-epoch", type=int, help="Cap the steps of each epoch (quick runs).")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same weights.")
@device_option
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help="Model config value, e.g. --set hidden_size=256 (repeatable).")
@click.option("--resume", is_flag=True, help="Continue the run saved in --out.")
@force_option
@output_options
def train(model: str, out: str, epochs: int | None, batch_size: int | None, lr: float | None,
          weight_decay: float | None, steps_per_epoch: int | None, seed: int, device: str,
          settings: tuple[str, ...], resume: bool, force: bool, as_json: bool) -> None:
    """Train reference MODEL (mlp, cnn or tinylm) and save it to OUT/model.safetensors.

    The file carries the ArchSpec, the training recipe and the validation and test metrics
    in its metadata. Launch with torchrun for DistributedDataParallel (gloo on CPU, nccl on GPU).

    \b
    Examples:
      modelkit train cnn --out runs/cnn
      modelkit train tinylm --out runs/tinylm --epochs 2 --set num_hidden_layers=6
      modelkit train mlp --out runs/mlp --resume --epochs 60
      torchrun --nproc-per-node 2 -m modelkit train cnn --out runs/cnn-ddp
    """
    from modelkit.pipeline.train import TrainConfig
    from modelkit.pipeline.train import train as run_training

    is_main = int(os.environ.get("RANK", "0")) == 0
    config = TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, weight_decay=weight_decay,
                         steps_per_epoch=steps_per_epoch, seed=seed, device=device)

    def on_epoch(record) -> None:
        if not as_json:
            note(f"epoch {record['epoch']}: train loss {record['train_loss']:.4f}, "
                 f"val {format_metrics(record['val'])} ({record['seconds']:.1f}s)")

    with Progress(f"train {model}", enabled=not as_json and is_main) as progress:
        result = run_training(model, out, config=config, model_config=_parse_settings(settings),
                              resume=resume, force=force, progress=progress, on_epoch=on_epoch)
    if not is_main:
        return
    if as_json:
        emit_json({"schema": "modelkit.train/1", "ok": True, "model": model, "path": str(result.path),
                   "metrics": result.metrics, "history": result.history, "seconds": round(result.seconds, 3)})
        return
    click.echo(f"saved {result.path} ({result.seconds:.1f}s)")
    click.echo(f"val:  {format_metrics(result.metrics['val'])}")
    click.echo(f"test: {format_metrics(result.metrics['test'])}")
