"""Weight-file commands as a user runs them (whole processes), against baselines run alongside.

    .venv/bin/python bench/slim.py [--size-mib 1024] [--dir /tmp/bench-slim] [--runs 3] [--python PYTHON]

`--python` runs the modelkit commands under another interpreter, e.g. a slim install's
(`python -m venv /tmp/slim && /tmp/slim/bin/pip install .`): what a user has, without the editable
install's import hook (about 8 ms of every start here) and without torch installed at all.

Prints, for a ~1 GiB Llama-shaped float32 checkpoint (safetensors, the same as GGUF, as a sharded
Hugging Face folder and as a torch.save .pth):

- `modelkit inspect` of each, wall time of the whole process (bar 0.3 s), next to `gguf-dump` of the GGUF;
- `modelkit convert` safetensors -> GGUF, -> sharded safetensors, -> HDF5, and .pth -> safetensors:
  wall time as a ratio to an fsynced copy of the same bytes (`cp` then `sync FILE`; bar 1.3x), and
  the process's peak anonymous memory (RssAnon sampled every 5 ms; bar 100 MiB); for the .pth,
  also `torch.load(mmap=True)` + `save_file` + fsync as a process, the path to beat;
- import time of `modelkit --help` and of each torch-free command (`python -X importtime`, the sum
  of every module's own time; bar 0.15 s), and whether torch was imported.

Each figure is the best of `--runs` runs after one warm-up, with the source read into the page
cache first (this VM's kernel evicts idle file pages: a run that reads the disk measures the disk).
Figures, not a timed test: bars are reported, never asserted.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

INSPECT_BAR_S = 0.3
CONVERT_BAR_RATIO = 1.3
MEMORY_BAR_MIB = 100
IMPORT_BAR_S = 0.15
MODELKIT = [sys.executable, "-m", "modelkit"]


def make_sources(folder: Path, size_mib: int) -> dict[str, Path]:
    """Llama-shaped float32 tensors of about `size_mib` in four containers."""
    import numpy as np
    import torch
    from safetensors.numpy import save_file

    hidden, inter = 2048, 5632
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, (size_mib << 20) // 4 // per_layer)
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (hidden, hidden)),
                            ("self_attn.v_proj.weight", (hidden, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
                            ("mlp.down_proj.weight", (hidden, inter)), ("input_layernorm.weight", (hidden,)),
                            ("post_attention_layernorm.weight", (hidden,))):
            tensors[p + name] = rng.standard_normal(shape, dtype=np.float32)
    paths = {"safetensors": folder / "model.safetensors", "pth": folder / "model.pth",
             "gguf": folder / "model.gguf", "sharded": folder / "sharded"}
    save_file(tensors, str(paths["safetensors"]), metadata={"format": "pt"})
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, paths["pth"])
    del tensors
    for kind, extra in (("gguf", []), ("sharded", ["--shard-size", "200MB"])):
        subprocess.run([*MODELKIT, "convert", str(paths["safetensors"]), str(paths[kind]), *extra, "-q", "--force"],
                       check=True, capture_output=True)
    return paths


def _warm(path: Path) -> None:
    buffer = bytearray(64 << 20)
    for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def _run(command: list[str], *, env: dict[str, str] | None = None) -> tuple[float, int]:
    """(wall seconds, peak RssAnon bytes) of one process."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    peak = [0]

    def sample() -> None:
        status = Path(f"/proc/{proc.pid}/status")
        while proc.poll() is None:
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        peak[0] = max(peak[0], int(line.split()[1]) * 1024)
            except (OSError, ValueError):
                pass
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    seconds = time.perf_counter() - started
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {err.decode()[-500:]}")
    return seconds, peak[0]


def best(command: list[str], *, source: Path, cleanup: Path | None = None, runs: int) -> tuple[float, int]:
    results = []
    for attempt in range(runs + 1):          # the first is the warm-up
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True) if cleanup.is_dir() else cleanup.unlink(missing_ok=True)
        _warm(source)
        result = _run(command)
        if attempt:
            results.append(result)
    return min(r[0] for r in results), max(r[1] for r in results)


def import_seconds(args: list[str], runs: int = 3) -> tuple[float, bool]:
    """Sum of every module's own import time for `python -m modelkit ARGS` (best of `runs`), and
    whether torch was imported."""
    best_total, torch_seen = float("inf"), False
    for _ in range(runs):
        result = subprocess.run([MODELKIT[0], "-X", "importtime", "-m", "modelkit", *args], capture_output=True,
                                text=True)
        total = 0
        for line in result.stderr.splitlines():
            if line.startswith("import time:") and "|" in line:
                own, _, name = (part.strip() for part in line.removeprefix("import time:").split("|"))
                if own.isdigit():
                    total += int(own)
                    torch_seen |= name == "torch"
        best_total = min(best_total, total / 1e6)
    return best_total, torch_seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs the modelkit commands")
    options = parser.parse_args()
    MODELKIT[0] = options.python
    folder = options.dir or Path(tempfile.mkdtemp(prefix="bench-slim-"))
    folder.mkdir(parents=True, exist_ok=True)
    os.chdir(folder)          # not the checkout: `python -m modelkit` there would import its source folder
    paths = make_sources(folder, options.size_mib)
    size = paths["safetensors"].stat().st_size
    print(f"source: {size / 2**20:.0f} MiB float32, {folder}")

    print(f"\ninspect (whole process; bar {INSPECT_BAR_S} s)")
    gguf_dump = str(Path(sys.executable).with_name("gguf-dump"))
    dump, _ = best([gguf_dump, "--no-tensors", str(paths["gguf"])], source=paths["gguf"], runs=options.runs)
    for kind in ("safetensors", "gguf", "sharded", "pth"):
        seconds, _ = best([*MODELKIT, "inspect", str(paths[kind])], source=paths[kind], runs=options.runs)
        verdict = "met" if seconds <= INSPECT_BAR_S else "MISSED"
        print(f"  {kind:<12} {seconds:6.3f} s   ({seconds / dump:.2f}x gguf-dump's {dump:.3f} s)  {verdict}")

    print(f"\nconvert (whole process vs an fsynced copy of the same bytes; bars {CONVERT_BAR_RATIO}x, "
          f"{MEMORY_BAR_MIB} MiB anonymous)")
    out = folder / "out"
    copy, _ = best(["sh", "-c", f"cp '{paths['safetensors']}' '{out}' && sync '{out}'"], source=paths["safetensors"],
                   cleanup=out, runs=options.runs)
    print(f"  copy + fsync                       {copy:6.3f} s")
    for label, src, dst, extra in (("safetensors -> gguf", "safetensors", "x.gguf", []),
                                   ("safetensors -> sharded", "safetensors", "x-shards", ["--shard-size", "200MB"]),
                                   ("safetensors -> hdf5", "safetensors", "x.h5", []),
                                   (".pth -> safetensors", "pth", "x.safetensors", [])):
        target = folder / dst
        seconds, peak = best([*MODELKIT, "convert", str(paths[src]), str(target), *extra, "-q"], source=paths[src],
                             cleanup=target, runs=options.runs)
        ratio, mib = seconds / copy, peak / 2**20
        verdict = "met" if ratio <= CONVERT_BAR_RATIO and mib <= MEMORY_BAR_MIB else "MISSED"
        print(f"  {label:<24} {seconds:6.3f} s  {ratio:5.2f}x copy  {mib:6.1f} MiB  {verdict}")
    target = folder / "naive.safetensors"
    naive = ("import sys, os, torch; from safetensors.torch import save_file; "
             "save_file(torch.load(sys.argv[1], mmap=True, weights_only=True), sys.argv[2]); "
             "fd = os.open(sys.argv[2], os.O_RDONLY); os.fsync(fd)")
    seconds, peak = best([sys.executable, "-c", naive, str(paths["pth"]), str(target)], source=paths["pth"],
                         cleanup=target, runs=options.runs)
    print(f"  torch.load(mmap) + save_file {seconds:6.3f} s  {seconds / copy:5.2f}x copy  {peak / 2**20:6.1f} MiB")

    print(f"\nimport time (python -X importtime, sum of own times; bar {IMPORT_BAR_S} s)")
    for args in (["--help"], ["inspect", str(paths["safetensors"])], ["scan", str(paths["pth"])],
                 ["convert", "--help"], ["quantize", "--help"]):
        seconds, torch_seen = import_seconds(args)
        verdict = "met" if seconds <= IMPORT_BAR_S and not torch_seen else "MISSED"
        shown = " ".join(a if not a.startswith("/") else Path(a).name for a in args)
        print(f"  modelkit {shown:<30} {seconds:6.3f} s  torch imported: {torch_seen}  {verdict}")
    if options.dir is None:
        shutil.rmtree(folder)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
