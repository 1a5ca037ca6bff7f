"""TF.js conversion speed and memory: a ~1 GiB safetensors to a TF.js Layers model and back, against an
fsynced copy of the same bytes measured in the same rounds (issue 21's bar: <= 1.5x the copy, peak memory
<= one shard plus 64 MiB).

    .venv/bin/python bench/tfjs_convert.py [--size-mib 1024] [--runs 5] [--dir /tmp/bench]
                                           [--baseline-python OTHER/.venv/bin/python]

The model is the zoo's mlp made wide (hidden layers of 4096: 64 MiB Dense kernels, which TF.js stores
transposed, (in, out), in 4 MiB shards), so the conversion does what a real one does: transpose every
kernel and cut the stream into shards, and back. Each run is a fresh subprocess with the source read into
the page cache first and everything synced before it (bench/convert.py's harness, which also gives the
copy baseline: shutil's copy and fsync, a folder file by file). The runs are interleaved in rounds (copy,
conversion without verification, verified conversion, for each direction), `--runs` rounds after one
warm-up round, so each conversion has a copy taken beside it under the same load; the conversions run in
the reverse order every other round. Printed per conversion:
the median of the rounds' ratios to their copy (with the range), the best conversion against the best
copy, the CPU seconds (process time, all threads) as a ratio to the copy's in the same round (median),
and the highest peak of anonymous memory. `--baseline-python` runs each conversion a second time per round
under another install (an earlier commit's checkout), marked [baseline]. The machine may be shared: read the
ratios, not the seconds.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import MEMORY_BAR_MIB, arguments, run_once  # noqa: E402  (bench/convert.py, beside this file)

TIME_BAR_RATIO = 1.5
SHARD_MIB = 4
MEMORY_BAR = SHARD_MIB + 64          # MiB above the baseline: one shard plus 64 MiB


def make_checkpoint(folder: Path, size_mib: int) -> Path:
    """An mlp with 4096-wide hidden layers, about `size_mib` of float32, as safetensors (ArchSpec inside)."""
    import torch

    import modelkit
    from modelkit.checkpoint import ArchSpec, Checkpoint
    from modelkit.models import build_from_spec

    layers = max(2, round(size_mib * 2**20 / (4096 * 4096 * 4)) + 1)
    spec = ArchSpec("mlp", {"in_features": 2, "hidden": [4096] * layers, "num_classes": 2})
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in build_from_spec(spec).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    state = {k: torch.randn(shape, generator=generator) for k, shape in shapes.items()}
    path = folder / "mlp.safetensors"
    modelkit.save(Checkpoint.from_state_dict(state, arch=spec), path, force=True)
    return path


def main() -> None:
    args = arguments(__doc__.splitlines()[0], runs=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        folder = Path(scratch)
        st = make_checkpoint(folder, args.size_mib)
        web = folder / "web" / "model.json"
        __import__("modelkit").convert(st, web)                 # the TF.js model the reverse runs read
        print(f"checkpoint: {st.stat().st_size / 2**20:.0f} MiB of float32 mlp weights (4096-wide Dense kernels)\n")
        plan = (("safetensors -> tfjs", st, folder / "out" / "model.json", st),
                ("tfjs -> safetensors", web, folder / "back.safetensors", web.parent))
        kinds = ["noverify", "verify"] + (["baseline noverify", "baseline verify"] if args.baseline_python else [])
        runs: dict[tuple[str, str], list[dict[str, float]]] = {}
        for round_ in range(args.runs + 1):
            for label, src, dst, copy_src in plan:
                # every other round in the reverse order: a run's place in the round moves its time (at load 3-5,
                # 2026-11-28, whichever of two codes ran second was 6-11% faster), so no code always goes first
                figures = {kind: run_once(src, dst, kind.split()[-1], python=args.baseline_python if "baseline" in kind
                                          else sys.executable) for kind in (kinds if round_ % 2 else kinds[::-1])}
                figures["copy"] = run_once(copy_src, folder / "copy.bin", "copy")
                if round_:                                       # the first round warms up, untimed
                    for kind, f in figures.items():
                        runs.setdefault((label, kind), []).append(f)
        print(f"{'conversion':50s} {'median x copy (range)':>22s} {'best x':>7s} {'CPU x':>6s} {'peak MiB':>9s}  bars")
        for label, _, _, _ in plan:
            copies = runs[(label, "copy")]
            for kind in kinds:
                mine = runs[(label, kind)]
                ratios = [m["seconds"] / c["seconds"] for m, c in zip(mine, copies, strict=True)]
                cpu = statistics.median(m["cpu"] / c["cpu"] for m, c in zip(mine, copies, strict=True))
                best = min(m["seconds"] for m in mine) / min(c["seconds"] for c in copies)
                median = statistics.median(ratios)
                peak = max(m["peak_above_base"] for m in mine) / 2**20
                name = f"{label} ({'verified' if kind.endswith(' verify') or kind == 'verify' else 'no verify'})"
                name = f"{name} [baseline]" if "baseline" in kind else name
                spread = f"{median:.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                print(f"{name:50s} {spread:>22s} {best:7.2f} {cpu:6.2f} {peak:9.1f}  memory "
                      f"{'ok' if peak <= MEMORY_BAR else 'MISSED'}, time {'ok' if median <= TIME_BAR_RATIO else 'MISSED'}")
        seconds = {label: statistics.median(c["seconds"] for c in runs[(label, "copy")]) for label, *_ in plan}
        cpu_s = {label: statistics.median(c["cpu"] for c in runs[(label, "copy")]) for label, *_ in plan}
        print(f"\ncopy baselines (median of {args.runs}): " + "; ".join(
            f"{label.split(' -> ')[0]} {seconds[label]:.2f} s wall, {cpu_s[label]:.2f} s CPU" for label in seconds))
        print(f"bars: time <= {TIME_BAR_RATIO}x the fsynced copy of the same bytes taken in the same round (median); "
              f"peak anonymous memory <= {MEMORY_BAR} MiB above the baseline (one {SHARD_MIB} MiB shard plus 64; "
              f"bench/convert.py's general bar is {MEMORY_BAR_MIB} MiB)")


if __name__ == "__main__":
    main()
