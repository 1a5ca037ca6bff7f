"""QAT and fine-tuning after pruning of a Hugging Face folder, measured on held-out bits per byte.

    .venv/bin/python bench/hf_train.py [--seeds 0,1,2] [--steps 20] [--pretrain 60] [--tokens 8192]

The folder is tests/test_hf_train.py's tiny random-weight Llama (llama3 fixture tokenizer), given `--pretrain`
plain training steps, with and without its outlier channels (a function-preserving rescale that makes int4's
rounding cost what it costs trained LLMs). For each seed and both variants it prints, in bits per byte on
the first `--tokens` tokens of the held-out text (`modelkit eval`'s default split):
  float; int4 g32 (PTQ); QAT int4 g32 (`--steps` steps); the float model trained the same steps, then int4
  (the control: QAT's gain beyond its extra training); structured pruning 50%; the same + `--steps` steps of
  fine-tuning; the float model trained the same steps (what fine-tuning could reach without pruning);
and the CPU seconds (process time) of the QAT and fine-tuning runs. One torch thread.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_hf_train import make_folder  # noqa: E402

import modelkit  # noqa: E402
from modelkit.pipeline.compress import prune_file  # noqa: E402
from modelkit.pipeline.lm_train import LMTrainConfig, train_causal_lm  # noqa: E402
from modelkit.pipeline.load import load_language_model  # noqa: E402
from modelkit.pipeline.quantize import make_config, quantize, quantize_module  # noqa: E402
from modelkit.quantizers.prune import PruneConfig  # noqa: E402

LR = 1e-3
COLUMNS = ("float", "ptq", "qat", "float+steps->ptq", "pruned", "pruned+ft", "float+steps", "qat s", "ft s")


def measure(folder: Path, scratch: Path, *, steps: int, tokens: int) -> dict[str, float]:
    def bits(model_or_path, tokenizer=None) -> float:
        return modelkit.evaluate(model_or_path, tokenizer=tokenizer, max_tokens=tokens, device="cpu")["bits_per_byte"]

    out: dict[str, float] = {"float": bits(folder)}
    quantize(folder, scratch / "ptq", scheme="int4", group_size=32, force=True)
    out["ptq"] = bits(scratch / "ptq")
    started = time.process_time()
    quantize(folder, scratch / "qat", scheme="int4", group_size=32, qat=True, steps=steps, lr=LR, force=True)
    out["qat s"] = time.process_time() - started
    out["qat"] = bits(scratch / "qat")
    loaded = load_language_model(folder)
    train_causal_lm(loaded.model, loaded.tokenizer, LMTrainConfig(steps_per_epoch=steps, lr=LR, device="cpu"))
    out["float+steps"] = bits(loaded.model, loaded.tokenizer)
    config = make_config("int4", group_size=32, skip=("model.embed_tokens", "lm_head"))
    out["float+steps->ptq"] = bits(quantize_module(loaded.model, config), loaded.tokenizer)
    started = time.process_time()
    report = prune_file(folder, scratch / "pruned", PruneConfig(method="structured", sparsity=0.5), finetune_epochs=1,
                        steps=steps, lr=LR, device="cpu", max_tokens=tokens, force=True)
    out["ft s"] = time.process_time() - started
    out["pruned"], out["pruned+ft"] = report.values["after"], report.values["finetuned"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pretrain", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"bits/byte on {args.tokens} held-out tokens; {args.pretrain} pretraining steps; QAT and fine-tuning: "
          f"{args.steps} steps of 8 x 64 tokens at lr {LR:g}")
    print("variant   seed  " + "  ".join(f"{c:>16}" for c in COLUMNS))
    for outliers in (True, False):
        rows = []
        for seed in seeds:
            with tempfile.TemporaryDirectory() as scratch:
                folder = make_folder(Path(scratch) / "llama", seed=seed, steps=args.pretrain, outliers=outliers)
                row = measure(folder, Path(scratch), steps=args.steps, tokens=args.tokens)
            rows.append(row)
            label = "outliers" if outliers else "plain"
            print(f"{label:9} {seed:4}  " + "  ".join(f"{row[c]:16.4f}" for c in COLUMNS), flush=True)
        mean = {c: statistics.mean(r[c] for r in rows) for c in COLUMNS}
        print(f"{'mean':9} {'':4}  " + "  ".join(f"{mean[c]:16.4f}" for c in COLUMNS))
        print(f"  QAT - PTQ {mean['qat'] - mean['ptq']:+.4f}; QAT - (same steps in float, then PTQ) "
              f"{mean['qat'] - mean['float+steps->ptq']:+.4f}; PTQ cost {mean['ptq'] - mean['float']:+.4f}; "
              f"fine-tuned - pruned {mean['pruned+ft'] - mean['pruned']:+.4f}; fine-tuned pruned - float+steps "
              f"{mean['pruned+ft'] - mean['float+steps']:+.4f}")


if __name__ == "__main__":
    main()
