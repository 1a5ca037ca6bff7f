"""TF.js conversion speed and memory: a ~1 GiB safetensors to a TF.js Layers model and back, against an
fsynced copy of the same bytes measured in the same run (issue 21's bar: <= 1.5x the copy, peak memory
<= one shard plus 64 MiB).

    .venv/bin/python bench/tfjs_convert.py [--size-mib 1024] [--runs 5] [--dir /tmp/bench]

The model is the zoo's mlp made wide (hidden layers of 4096: 64 MiB Dense kernels, which TF.js stores
transposed, (in, out), in 4 MiB shards), so the conversion does what a real one does: transpose every
kernel and cut the stream into shards, and back. Each figure is the fastest of `--runs` runs after a
warm-up, each run in a fresh subprocess with the source in the page cache (bench/convert.py's harness,
which also gives the copy baseline: shutil's copy and fsync, a folder file by file). The machine may be
shared: read the ratios, which compare runs taken side by side, not the seconds.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import MEMORY_BAR_MIB, arguments, measure  # noqa: E402  (bench/convert.py, beside this file)

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
        rows = []
        for label, src, dst, copy_src in (("safetensors -> tfjs", st, folder / "out" / "model.json", st),
                                          ("tfjs -> safetensors", web, folder / "back.safetensors", web.parent)):
            copy = measure(copy_src, folder / "copy.bin", "copy", runs=args.runs)
            for kind in ("noverify", "verify"):
                figures = measure(src, dst, kind, runs=args.runs)
                rows.append((f"{label} ({'verified' if kind == 'verify' else 'no verify'})", figures, copy))
        print(f"{'conversion':40s} {'seconds':>8s} {'copy s':>7s} {'x copy':>7s} {'peak MiB':>9s}  bars")
        for label, figures, copy in rows:
            ratio = figures["seconds"] / copy["seconds"]
            peak = figures["peak_above_base"] / 2**20
            print(f"{label:40s} {figures['seconds']:8.2f} {copy['seconds']:7.2f} {ratio:7.2f} {peak:9.1f}  "
                  f"memory {'ok' if peak <= MEMORY_BAR else 'MISSED'}, time {'ok' if ratio <= TIME_BAR_RATIO else 'MISSED'}")
        print(f"\nbars: time <= {TIME_BAR_RATIO}x the fsynced copy of the same bytes in the same run; peak anonymous "
              f"memory <= {MEMORY_BAR} MiB above the baseline (one {SHARD_MIB} MiB shard plus 64; bench/convert.py's "
              f"general bar is {MEMORY_BAR_MIB} MiB)")


if __name__ == "__main__":
    main()
