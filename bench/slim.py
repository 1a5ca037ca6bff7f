"""Weight-file commands as a user runs them (whole processes), against baselines run alongside.

    .venv/bin/python bench/slim.py [--size-mib 1024] [--dir /tmp/bench-slim] [--runs 7] [--python PYTHON]
                                   [--only convert] [--reuse]

`--python` runs the modelkit commands under another interpreter, e.g. a slim install's
(`python -m venv /tmp/slim && /tmp/slim/bin/pip install .`): what a user has, without the editable
install's import hook (about 8 ms of every start here) and without torch installed at all.

Prints, for a ~1 GiB Llama-shaped float32 checkpoint (safetensors, the same as GGUF, as a sharded
Hugging Face folder and as a torch.save .pth):

- `modelkit inspect` of each, wall time of the whole process (bar 0.3 s), next to `gguf-dump` of the GGUF;
- `modelkit convert` safetensors -> GGUF, -> sharded safetensors, -> HDF5, and .pth -> safetensors:
  wall time as a ratio to an fsynced copy of the conversion's source (`cp` then `sync FILE`; bar 1.3x),
  and the process's peak anonymous memory (RssAnon sampled every 5 ms; bar 100 MiB); for the .pth,
  also `torch.load(mmap=True)` + `save_file` + fsync as a process, the path to beat;
- import time of `modelkit --help` and of each torch-free command (`python -X importtime`, the sum
  of every module's own time; bar 0.15 s), and whether torch was imported.

The conversions are timed in pairs, copy then conversion, `--runs` pairs after one warm-up pair;
before every run both outputs are deleted, everything is synced (`os.sync`, so no run pays for an
earlier one's write-back) and the source is read into the page cache (this VM's kernel evicts idle
file pages: a run that reads the disk measures the disk). Printed: the median of the pairs' ratios
(with their range), which follows the machine's load as it drifts, and as before the best
conversion against the best copy. Inspect and import figures are the best of `--runs`. Figures,
not a timed test: bars are reported, never asserted.

Every modelkit process runs with its bytecode cached (PYTHONPYCACHEPREFIX in the bench's folder: modelkit's
modules compiled before anything is timed, the rest written on the warm-up runs even where
PYTHONDONTWRITEBYTECODE is set), as in an installed package, where pip compiles every module at install time. Without it an editable install under PYTHONDONTWRITEBYTECODE
compiles each of modelkit's ~55 modules from source at every start: 0.5-0.7 s of CPU per conversion,
measured 2026-11-27 on the loaded 2-core VM, more than the fsynced copy's whole run (0.35 s).
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
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
MODELKIT = [sys.executable, "-m", "modelkit"]     # [0]: the interpreter given last by --python
ENV: dict[str, str] = {}                         # the environment of the processes timed (set by main)
COMPILE = ("import compileall, importlib.util, os\n"
           "for package in ('modelkit', 'modelkit.converters', 'modelkit.quantizers'):\n"
           "    compileall.compile_dir(os.path.dirname(importlib.util.find_spec(package).origin), quiet=1)")


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
                       check=True, capture_output=True, env=ENV or None)
    return paths


def _warm(path: Path) -> None:
    buffer = bytearray(64 << 20)
    for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def _run(command: list[str], *, env: dict[str, str] | None = None) -> tuple[float, int, float]:
    """(wall seconds, peak RssAnon bytes, CPU seconds: user + system, its children's included) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env or ENV or None)
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
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return seconds, peak[0], after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def _clear(*paths: Path) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def best(command: list[str], *, source: Path, cleanup: Path | None = None, runs: int) -> tuple[float, int]:
    results = []
    for attempt in range(runs + 1):          # the first is the warm-up
        if cleanup is not None:
            _clear(cleanup)
        _warm(source)
        result = _run(command)
        if attempt:
            results.append(result)
    return min(r[0] for r in results), max(r[1] for r in results)


def paired(baseline: list[str], commands: list[list[str]], *, source: Path, outputs: tuple[Path, ...],
           runs: int) -> tuple[list[float], list[list[float]], list[int], list[float]]:
    """`runs` rounds (the baseline, then each command, their order reversed every other round) after a
    warm-up round, each run from the same state: outputs deleted, everything synced, source in the page
    cache. Returns the baseline's seconds, each command's seconds, each command's peak anonymous memory, and
    the median CPU seconds of the baseline and of each command."""
    base: list[float] = []
    ours: list[list[float]] = [[] for _ in commands]
    peaks = [0] * len(commands)
    cpu: list[list[float]] = [[] for _ in range(len(commands) + 1)]
    for attempt in range(runs + 1):
        order = list(range(len(commands)))[::-1 if attempt % 2 else 1]     # no command always right after the copy
        results = [(0.0, 0, 0.0)] * (len(commands) + 1)
        for slot in (0, *(i + 1 for i in order)):
            _clear(*outputs)
            os.sync()
            _warm(source)
            results[slot] = _run((baseline, *commands)[slot])
            if attempt:
                cpu[slot].append(results[slot][2])
        if attempt:
            base.append(results[0][0])
            for i, (seconds, peak, _) in enumerate(results[1:]):
                ours[i].append(seconds)
                peaks[i] = max(peaks[i], peak)
    return base, ours, peaks, [statistics.median(c) for c in cpu]


def import_seconds(args: list[str], runs: int = 3) -> tuple[float, bool]:
    """Sum of every module's own import time for `python -m modelkit ARGS` (best of `runs`), and
    whether torch was imported."""
    best_total, torch_seen = float("inf"), False
    for _ in range(runs):
        result = subprocess.run([MODELKIT[0], "-X", "importtime", "-m", "modelkit", *args], capture_output=True,
                                text=True, env=ENV or None)
        total = 0
        for line in result.stderr.splitlines():
            if line.startswith("import time:") and "|" in line:
                own, _, name = (part.strip() for part in line.removeprefix("import time:").split("|"))
                if own.isdigit():
                    total += int(own)
                    torch_seen |= name == "torch"
        best_total = min(best_total, total / 1e6)
    return best_total, torch_seen


def convert_figures(paths: dict[str, Path], folder: Path, pythons: list[str], runs: int) -> None:
    print(f"\nconvert (whole process vs an fsynced copy of its source; {runs} rounds of copy, then each "
          f"interpreter's conversion; bars {CONVERT_BAR_RATIO}x, {MEMORY_BAR_MIB} MiB anonymous)")
    print(f"  {'':<24} {'median pair ratio':>18}   {'best':>7} {'best copy':>9} {'ratio':>6}   {'peak':>10}   "
          f"median CPU s (copy's)")
    copy = folder / "copy.bin"
    copies: list[float] = []
    for label, src, dst, extra in (("safetensors -> gguf", "safetensors", "x.gguf", []),
                                   ("safetensors -> sharded", "safetensors", "x-shards", ["--shard-size", "200MB"]),
                                   ("safetensors -> hdf5", "safetensors", "x.h5", []),
                                   (".pth -> safetensors", "pth", "x.safetensors", [])):
        target = folder / dst
        commands = [[python, "-m", "modelkit", "convert", str(paths[src]), str(target), *extra, "-q"]
                    for python in pythons]
        base, ours, peaks, cpu = paired(["sh", "-c", f"cp '{paths[src]}' '{copy}' && sync '{copy}'"], commands,
                                   source=paths[src], outputs=(copy, target), runs=runs)
        copies += base
        for number, (seconds, peak) in enumerate(zip(ours, peaks, strict=True), start=1):
            ratios = [o / b for b, o in zip(base, seconds, strict=True)]
            median, mib = statistics.median(ratios), peak / 2**20
            verdict = "met" if median <= CONVERT_BAR_RATIO and mib <= MEMORY_BAR_MIB else "MISSED"
            shown = label if len(pythons) == 1 else f"{label} [{number}]"
            print(f"  {shown:<28} {median:5.2f}x ({min(ratios):.2f}-{max(ratios):.2f})  {min(seconds):6.3f} s "
                  f"{min(base):6.3f} s {min(seconds) / min(base):5.2f}x  {mib:6.1f} MiB  {verdict:<6}  "
                  f"{cpu[number]:.2f} ({cpu[0]:.2f})")
    _clear(copy)
    print(f"  copy + fsync: median {statistics.median(copies):.3f} s, best {min(copies):.3f} s")
    if len(pythons) > 1:
        print("  " + "; ".join(f"[{i}] {python}" for i, python in enumerate(pythons, start=1)))
    target = folder / "naive.safetensors"
    naive = ("import sys, os, torch; from safetensors.torch import save_file; "
             "save_file(torch.load(sys.argv[1], mmap=True, weights_only=True), sys.argv[2]); "
             "fd = os.open(sys.argv[2], os.O_RDONLY); os.fsync(fd)")
    seconds, peak = best([sys.executable, "-c", naive, str(paths["pth"]), str(target)], source=paths["pth"],
                         cleanup=target, runs=min(runs, 3))
    print(f"  torch.load(mmap) + save_file {seconds:6.3f} s  {seconds / min(copies):5.2f}x the best copy  "
          f"{peak / 2**20:6.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--python", action="append", default=None,
                        help="interpreter that runs the modelkit commands; give it twice (before, after) to "
                             "interleave two installs' conversions in the same rounds")
    parser.add_argument("--only", choices=("inspect", "convert", "imports"), action="append", default=None,
                        help="measure only these sections (default: all)")
    parser.add_argument("--reuse", action="store_true", help="keep the sources already in --dir")
    options = parser.parse_args()
    pythons = options.python or [sys.executable]
    sections = options.only or ["inspect", "convert", "imports"]
    MODELKIT[0] = pythons[-1]
    folder = options.dir or Path(tempfile.mkdtemp(prefix="bench-slim-"))
    folder.mkdir(parents=True, exist_ok=True)
    ENV.update({k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
               PYTHONPYCACHEPREFIX=str(folder / "pycache"))
    folder = folder.resolve()
    os.chdir(folder)          # not the checkout: `python -m modelkit` there would import its source folder
    for python in pythons:        # modelkit's own modules compiled now, the rest on the warm-up runs
        subprocess.run([python, "-c", COMPILE], check=True, capture_output=True, env=ENV)
    names = {"safetensors": "model.safetensors", "pth": "model.pth", "gguf": "model.gguf", "sharded": "sharded"}
    if options.reuse and all((folder / name).exists() for name in names.values()):
        paths = {kind: folder / name for kind, name in names.items()}
    else:
        paths = make_sources(folder, options.size_mib)
    size = paths["safetensors"].stat().st_size
    print(f"source: {size / 2**20:.0f} MiB float32, {folder}")

    if "inspect" in sections:
        print(f"\ninspect (whole process, best of {options.runs}; bar {INSPECT_BAR_S} s)")
        gguf_dump = str(Path(sys.executable).with_name("gguf-dump"))
        dump, _ = best([gguf_dump, "--no-tensors", str(paths["gguf"])], source=paths["gguf"], runs=options.runs)
        for kind in ("safetensors", "gguf", "sharded", "pth"):
            seconds, _ = best([*MODELKIT, "inspect", str(paths[kind])], source=paths[kind], runs=options.runs)
            verdict = "met" if seconds <= INSPECT_BAR_S else "MISSED"
            print(f"  {kind:<12} {seconds:6.3f} s   ({seconds / dump:.2f}x gguf-dump's {dump:.3f} s)  {verdict}")

    if "convert" in sections:
        convert_figures(paths, folder, pythons, options.runs)

    if "imports" in sections:
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
