"""Conversion speed and memory on a ~1 GiB Llama-shaped checkpoint, against baselines run alongside.

    .venv/bin/python bench/convert.py [--size-mib 1024] [--dir /tmp/bench]

For each conversion (pt -> safetensors, safetensors -> gguf, safetensors -> hdf5, and each back)
it prints, next to baselines measured in the same run:

- wall time, and its ratio to a plain copy of the source's bytes with fsync (the floor: any
  conversion reads and writes at least that much), each the fastest of five runs after a warm-up (see `measure`);
- peak anonymous memory above the process's baseline after imports (RssAnon sampled every
  5 ms; page-cache and mmap'd file pages do not count), where the naive path
  (`torch.load` + `safetensors.torch.save_file`) holds the whole model.

Each measurement runs in a fresh subprocess so one does not inherit another's memory.
Figures, not a timed test: the bars (at most 300 MiB above baseline; at most 1.5x the copy;
faster than the naive path) are checked and reported, never asserted.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

MEMORY_BAR_MIB = 300
TIME_BAR_RATIO = 1.5

# Runs inside each subprocess: import, measure the baseline, sample RssAnon while `work` runs.
_HARNESS = textwrap.dedent('''
    import json, os, shutil, sys, threading, time
    import torch, safetensors.torch, modelkit, modelkit.pipeline.convert
    from modelkit.formats import load_format
    for name in ("gguf", "hdf5", "pth", "safetensors", "tfjs"):
        load_format(name)

    def rss_anon():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    src, dst, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    # Warm the page cache with the source, untimed, for the copy and every conversion alike: this VM's
    # kernel runs DAMON_RECLAIM, which evicts file pages idle for a while, and a run that happens to
    # re-read the source from the virtual disk measures the disk, not the conversion.
    buffer = bytearray(64 << 20)
    for file in ([src] if os.path.isfile(src) else [os.path.join(src, n) for n in sorted(os.listdir(src))]):
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    del buffer
    peak = [0]
    done = threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.005)
    base = rss_anon()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    started, cpu = time.perf_counter(), time.process_time()
    if kind == "copy" and os.path.isdir(src):     # a folder (TF.js shards): each file copied and fsynced
        tmp = dst + ".tmp"
        shutil.copytree(src, tmp)
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dst)
    elif kind == "copy":     # as a careful copy writes: a new file, fsync, rename (what modelkit does too)
        tmp = dst + ".tmp"
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    elif kind == "naive":
        state = torch.load(src, map_location="cpu", weights_only=True)
        safetensors.torch.save_file(state, dst, metadata={"format": "pt"})
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())
    else:
        modelkit.convert(src, dst, verify=(kind == "verify"))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    done.set()
    thread.join()
    peak[0] = max(peak[0], rss_anon())
    print(json.dumps({"seconds": seconds, "cpu": cpu, "peak_above_base": peak[0] - base, "base": base}))
''')


def make_checkpoint(folder: Path, size_mib: int) -> dict[str, Path]:
    """A Llama-shaped fp32 state_dict of about `size_mib`, saved as .pt and .safetensors."""
    import torch

    import modelkit
    from modelkit.checkpoint import Checkpoint

    hidden, ffn = 2048, 5632
    per_layer = (4 * hidden * hidden + 3 * hidden * ffn) * 4
    layers = max(1, round(size_mib * 2**20 / per_layer))
    generator = torch.Generator().manual_seed(0)
    state = {}
    for i in range(layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"model.layers.{i}.self_attn.{name}.weight"] = torch.randn(hidden, hidden, generator=generator)
        state[f"model.layers.{i}.mlp.gate_proj.weight"] = torch.randn(ffn, hidden, generator=generator)
        state[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(ffn, hidden, generator=generator)
        state[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(hidden, ffn, generator=generator)
        state[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(hidden)
    paths = {"pt": folder / "model.pt", "safetensors": folder / "model.safetensors"}
    torch.save(state, paths["pt"])
    modelkit.save(Checkpoint.from_state_dict(state), paths["safetensors"], force=True)
    return paths


def measure(src: Path, dst: Path, kind: str, runs: int = 5) -> dict[str, float]:
    """The fastest of `runs` runs after an untimed one, each with the source read into the page cache
    first (untimed). On this VM the same 1 GiB copy varies 0.5-3 s from run to run (fresh page-cache
    memory from the host, DAMON_RECLAIM evicting the source), so one sample of each says little. The
    copy baseline and every conversion get the same treatment."""
    best: dict[str, float] | None = None
    for attempt in range(runs + 1):
        figures = run_once(src, dst, kind)
        if attempt and (best is None or figures["seconds"] < best["seconds"]):
            best = {**figures, "peak_above_base": max(figures["peak_above_base"],
                                                      best["peak_above_base"] if best else 0)}
    assert best is not None
    return best


def run_once(src: Path, dst: Path, kind: str, python: str = sys.executable) -> dict[str, float]:
    """One run in a fresh subprocess after `sync` (no run pays for an earlier one's write-back), the output
    deleted first: wall seconds, CPU seconds of the process (all threads, user + system), peak anonymous
    memory above its baseline. `python`: the interpreter (another install of modelkit to compare with)."""
    folder = dst.parent if dst.name == "model.json" else dst        # a TF.js model is its folder
    if folder.exists():
        folder.unlink() if folder.is_file() else __import__("shutil").rmtree(folder)
    subprocess.run(["sync"], check=False)
    # -P: nothing put before the install's own path; `python -c` puts the current folder first, so a run from a
    # checkout (the bench's own folder) imported that checkout's modelkit under any `python`: until 2026-11-28
    # --baseline-python run from a branch's worktree measured the branch against itself
    result = subprocess.run([python, "-P", "-c", _HARNESS, str(src), str(dst), kind],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{kind} {src.name} -> {dst.name} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def arguments(description: str, *, runs: bool = False) -> argparse.Namespace:
    """--size-mib, --dir (and --runs, --baseline-python): the options of this bench and of those that reuse its harness."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size-mib", type=int, default=1024)
    if runs:
        parser.add_argument("--runs", type=int, default=5, help="timed runs of each conversion (after a warm-up)")
        parser.add_argument("--baseline-python", default=None,
                            help="also run each conversion under this interpreter (another modelkit install), "
                                 "in the same rounds")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    return parser.parse_args()


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        folder = Path(scratch)
        paths = make_checkpoint(folder, args.size_mib)
        size = paths["safetensors"].stat().st_size
        print(f"checkpoint: {size / 2**20:.0f} MiB of fp32 Llama-shaped tensors ({len(paths)} source files)\n")
        rows = []
        naive = measure(paths["pt"], folder / "naive.safetensors", "naive")
        rows.append(("pt -> safetensors (naive: torch.load + save_file)", naive, measure(paths["pt"], folder / "copy.bin", "copy")))
        st = paths["safetensors"]
        plan = [
            ("pt -> safetensors", paths["pt"], folder / "a.safetensors"),
            ("safetensors -> pt", st, folder / "b.pt"),
            ("safetensors -> gguf", st, folder / "c.gguf"),
            ("gguf -> safetensors", folder / "c.gguf", folder / "d.safetensors"),
            ("safetensors -> hdf5", st, folder / "e.h5"),
            ("hdf5 -> safetensors", folder / "e.h5", folder / "f.safetensors"),
        ]
        results = {}
        for label, src, dst in plan:
            copy = measure(src, folder / "copy.bin", "copy")
            for kind in ("noverify", "verify"):
                figures = measure(src, dst, kind)
                results[(label, kind)] = figures
                rows.append((f"{label} ({'verified' if kind == 'verify' else 'no verify'})", figures, copy))
        print(f"{'conversion':58s} {'seconds':>8s} {'x copy':>7s} {'peak MiB':>9s}  bars")
        for label, figures, copy in rows:
            ratio = figures["seconds"] / copy["seconds"]
            peak = figures["peak_above_base"] / 2**20
            ok_mem = peak <= MEMORY_BAR_MIB
            ok_time = ratio <= TIME_BAR_RATIO and ("naive" in label or figures["seconds"] < naive["seconds"])
            verdict = "" if "naive" in label else f"memory {'ok' if ok_mem else 'MISSED'}, time {'ok' if ok_time else 'MISSED'}"
            print(f"{label:58s} {figures['seconds']:8.2f} {ratio:7.2f} {peak:9.1f}  {verdict}")
        print(f"\nbars: peak anonymous memory <= {MEMORY_BAR_MIB} MiB above baseline; time <= {TIME_BAR_RATIO}x "
              f"the copy of the same source with fsync, and below the naive path ({naive['seconds']:.2f}s, "
              f"{naive['peak_above_base'] / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
