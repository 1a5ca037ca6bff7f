"""Pruning and distillation bars on the reference models, measured in one run.

    .venv/bin/python bench/compress.py [--runs runs] [--seeds 0,1,2] [--skip-tinylm]

Uses the trained models in RUNS/{cnn,tinylm}/model.safetensors (trained with the default
recipes first when missing, as `make demo` does). Prints, for cnn: structured pruning (>= 40%
of parameters removed) + fine-tune, 2:4 + fine-tune and magnitude 80% + fine-tune, each with
its accuracy drop against the bar of 1 point; and for cnn and tinylm: a distilled student (at
most a quarter of the teacher's parameters) against the same student trained alone with the
same recipe and seed, over several seeds.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from modelkit.pipeline.compress import distill_file, prune_file
from modelkit.pipeline.train import MODEL_FILE, train
from modelkit.quantizers.prune import PruneConfig

FINETUNE_EPOCHS = 10
PRUNE_CASES = [  # (label, config, bar on parameters removed)
    ("structured 50%", PruneConfig(method="structured", sparsity=0.5), 0.40),
    ("2:4", PruneConfig(method="2:4"), None),
    ("magnitude 80%", PruneConfig(method="magnitude", sparsity=0.8), None),
]


def trained(runs: Path, name: str) -> Path:
    path = runs / name / MODEL_FILE
    if not path.exists():
        print(f"training {name} (default recipe) ...", flush=True)
        train(name, runs / name, force=True)
    return path


def bench_pruning(cnn: Path, scratch: Path) -> bool:
    print(f"\ncnn pruning, then {FINETUNE_EPOCHS} fine-tune epochs (bar: accuracy drop <= 1 point)")
    print(f"{'method':16s} {'params':>17s} {'removed':>8s} {'before':>7s} {'pruned':>7s} {'tuned':>7s} {'drop':>6s}  bar")
    ok = True
    for label, config, removed_bar in PRUNE_CASES:
        report = prune_file(cnn, scratch / f"pruned-{label.split()[0]}.safetensors", config,
                            finetune_epochs=FINETUNE_EPOCHS, force=True)
        v, p = report.values, report.parameters
        removed = 1 - p["after"] / p["before"]
        zeros = sum(r["zeros"] for r in report.layers) / sum(r["total"] for r in report.layers)
        drop = 100 * (v["before"] - v["finetuned"])
        passed = drop <= 1.0 and (removed_bar is None or removed >= removed_bar)
        ok &= passed
        shown = f"{removed:.0%}" if config.method == "structured" else f"{zeros:.0%} 0s"
        print(f"{label:16s} {p['before']:>8,}->{p['after']:<8,} {shown:>8s} {v['before']:7.4f} {v['after']:7.4f} "
              f"{v['finetuned']:7.4f} {drop:+6.2f}  {'ok' if passed else 'MISSED'}")
    return ok


def bench_distillation(name: str, teacher: Path, scratch: Path, seeds: list[int]) -> bool:
    print(f"\n{name} distillation (student <= 1/4 of the teacher; bar: distilled beats the student alone)")
    gaps = []
    for seed in seeds:
        report = distill_file(teacher, name, scratch / f"distill-{name}-{seed}", None, seed=seed, force=True)
        s, b, t = report.student, report.scratch, report.teacher
        gap = (s["value"] - b["value"]) * (1 if report.higher_is_better else -1)
        gaps.append(gap)
        print(f"  seed {seed}: teacher {t['value']:.4f} ({t['parameters']:,} params), distilled {s['value']:.4f}, "
              f"alone {b['value']:.4f} ({s['parameters']:,} params, {s['parameters'] / t['parameters']:.1%}), "
              f"{report.metric}, gap {gap:+.4f} in favour of distillation")
    mean = statistics.mean(gaps)
    spread = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
    passed = mean > 0
    print(f"  mean gap {mean:+.4f} (stdev {spread:.4f} over {len(seeds)} seeds): {'ok' if passed else 'MISSED'}")
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--skip-tinylm", action="store_true")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="modelkit-bench-") as tmp:
        scratch = Path(tmp)
        ok = bench_pruning(trained(args.runs, "cnn"), scratch)
        ok &= bench_distillation("cnn", trained(args.runs, "cnn"), scratch, seeds)
        if not args.skip_tinylm:
            ok &= bench_distillation("tinylm", trained(args.runs, "tinylm"), scratch, seeds[:2])
    print(f"\nall bars {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
