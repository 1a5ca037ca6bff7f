"""Trials of tinylm training recipes: quality (validation and test bits/byte against the unigram
baseline) and time, on one thread, one trial after another.

Quality is deterministic under a seed, so the ratios hold on a loaded machine; the seconds do not
(compare them only within one run).

    .venv/bin/python bench/tinylm_recipe.py                                   # the model's defaults
    .venv/bin/python bench/tinylm_recipe.py --bytes 700000 --batch 16 --lr 3e-3 --warmup 30 --seeds 0 1 2
    .venv/bin/python bench/tinylm_recipe.py --bytes 700000 --batch 16 --lr 3e-3 --json runs/trials.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile

import torch

from modelkit.models import tinylm
from modelkit.pipeline.train import TrainConfig, train


def trial(*, train_bytes: int | None, block: int | None, batch: int | None, lr: float | None,
          warmup: int | None, seed: int) -> dict:
    """Train tinylm once with these recipe values (None: the model's default) and return its figures."""
    default_task = tinylm.TASK
    tinylm.TASK = dataclasses.replace(default_task, train_bytes=train_bytes or default_task.train_bytes,
                                      block=block or default_task.block)
    try:
        config = TrainConfig(batch_size=batch, lr=lr, warmup_steps=warmup, seed=seed, device="cpu")
        with tempfile.TemporaryDirectory() as out:
            losses: list[float] = []
            steps: list[int] = []

            def progress(step: int, total: int, stats) -> None:
                steps.append(total)
                losses.append(stats["loss"])

            result = train("tinylm", out, config=config, progress=progress)
        resolved = config.resolved("tinylm")
        return {"bytes": tinylm.TASK.train_bytes, "block": tinylm.TASK.block, "lr": resolved.lr,
                "warmup": resolved.warmup_steps, "batch": resolved.batch_size, "seed": seed,
                "val": round(result.metrics["val"]["ratio_to_unigram"], 4),
                "test": round(result.metrics["test"]["ratio_to_unigram"], 4),
                "steps": steps[-1], "seconds": round(result.seconds, 1),
                # mean training loss (nats) of each tenth of the run: shows spikes and where it flattens
                "loss_tenths": [round(sum(chunk) / len(chunk), 3) for chunk in _tenths(losses)]}
    finally:
        tinylm.TASK = default_task


def _tenths(values: list[float]) -> list[list[float]]:
    n = len(values)
    return [values[i * n // 10:(i + 1) * n // 10] for i in range(10) if (i + 1) * n // 10 > i * n // 10]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, help="training text (default: the model's TASK.train_bytes)")
    parser.add_argument("--block", type=int, help="window length (default: TASK.block)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="append each trial as a JSON line to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for seed in args.seeds:
        row = trial(train_bytes=args.bytes, block=args.block, batch=args.batch, lr=args.lr, warmup=args.warmup,
                    seed=seed)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
