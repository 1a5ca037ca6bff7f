"""Quantization bars: accuracy on the zoo, kernel speed against gguf-py and float, peers side by side.

    .venv/bin/python bench/quantize.py [--runs runs] [--skip-tinylm] [--speed-only] [--json out.json]

Prints, each next to its baseline measured in the same run:

1. cnn (digits test accuracy): int8 drop <= 0.3 pt; int4 g32 round-to-nearest <= 2 pt;
   GPTQ int4 g32 and QAT int4 g32 each <= 0.5 pt.
2. tinylm (validation bits per byte): q8_0 within 0.5% of float; q4_0 within 5%; GPTQ int4 g32
   strictly better than RTN int4 g32; QAT int4 g32 better than RTN int4 g32.
3. Speed on 64 M parameters, byte-identical output checked: q8_0, q4_1, q5_1 at least 10x
   `gguf.quants.quantize`, q4_0 and q5_0 at least 4x; each also as a fraction of the machine's
   memory bandwidth (a 256 MB copy timed here). The bars use the fastest implementation here
   (gguf_blocks.IMPLEMENTATIONS[0]: the C kernels, avx2 where the CPU has it); the others
   (generic C, eager torch) are timed and checked byte for byte too. int8-dynamic Linear 2048x2048 at batch 64 at most
   0.5x the float latency.
4. Peers on the same models: torch.ao.quantization.quantize_dynamic (deprecated in torch 2.13,
   run here only as the baseline) and onnxruntime's quantize_dynamic, against int8-dynamic.

Reference models come from `--runs` when a trained model with the default config and recipe is
there (`modelkit demo` writes them); otherwise they are trained here with the default recipes.
Bars are reported, never asserted: the exit code is 0 either way.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from modelkit import schemes
from modelkit.api import evaluate, load, load_module
from modelkit.models import config_from_dict, load_model_module
from modelkit.pipeline.measure import latencies
from modelkit.pipeline.quantize import quantize_module, train_qat
from modelkit.pipeline.train import TRAIN_KEY, TrainConfig, train

RESULTS: dict[str, Any] = {"bars": []}


def bar(name: str, value: str, ok: bool, detail: str = "") -> None:
    RESULTS["bars"].append({"bar": name, "value": value, "met": ok, "detail": detail})
    print(f"  [{'met' if ok else 'MISSED'}] {name}: {value}{f'  ({detail})' if detail else ''}", flush=True)


def reference_model(name: str, runs: Path) -> torch.nn.Module:
    """The default-config model trained with the default recipe: from `runs` if it is there, else trained now."""
    path = runs / name / "model.safetensors"
    recipe = json.loads(json.dumps({**TrainConfig().resolved(name).__dict__}))
    if path.is_file():
        ckpt = load(path)
        stored = json.loads(ckpt.metadata.get(TRAIN_KEY, "{}"))
        same_recipe = {k: stored.get(k) for k in recipe if k != "device"} == {k: v for k, v in recipe.items() if k != "device"}
        default = load_model_module(name).CONFIG()
        same_arch = ckpt.arch is not None and ckpt.arch.name == name and config_from_dict(name, ckpt.arch.config) == default
        if same_arch and same_recipe:
            print(f"{name}: using {path} (default config and recipe)", flush=True)
            return load_module(path)
    out = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    print(f"{name}: training with the default recipe into {out} ...", flush=True)
    train(name, out, config=TrainConfig(seed=0))
    return load_module(out / "model.safetensors")


def metric_of(model: torch.nn.Module) -> dict[str, float]:
    return evaluate(model, device="cpu")


# ------------------------------------------------------------------------------------ accuracy


def zoo(name: str, model: torch.nn.Module, qat_epochs: int, qat_steps: int | None) -> dict[str, Any]:
    task = load_model_module(name).TASK
    key = task.metric
    rows: dict[str, Any] = {}

    def run(label: str, make) -> None:
        started = time.perf_counter()
        quantized = make()
        seconds = time.perf_counter() - started
        value = metric_of(quantized)[key]
        rows[label] = {"metric": value, "seconds": seconds}
        print(f"  {label:<22} {key} {value:.4f}  ({seconds:.1f} s to quantize)", flush=True)

    rows["float"] = {"metric": metric_of(model)[key], "seconds": 0.0}
    print(f"  {'float':<22} {key} {rows['float']['metric']:.4f}", flush=True)
    cfg = schemes.config_from_dict
    plans = [
        ("int8", lambda: quantize_module(model, cfg({"scheme": "int8"}))),
        ("int8-dynamic", lambda: quantize_module(model, cfg({"scheme": "int8-dynamic"}))),
        ("int4 g32 (RTN)", lambda: quantize_module(model, cfg({"scheme": "int4", "group_size": 32}))),
        ("gptq int4 g32", lambda: quantize_module(model, cfg({"scheme": "gptq", "group_size": 32}))),
        ("q8_0", lambda: quantize_module(model, cfg({"scheme": "q8_0"}))),
        ("q4_0", lambda: quantize_module(model, cfg({"scheme": "q4_0"}))),
        ("qat int4 g32", lambda: train_qat(model, cfg({"scheme": "int4", "group_size": 32}), epochs=qat_epochs,
                                           steps=qat_steps)),
    ]
    if name == "cnn":
        plans += [(s, lambda s=s: quantize_module(model, cfg({"scheme": s}))) for s in ("q4_1", "q5_0", "q5_1", "fp16", "bf16")]
    for label, make in plans:
        run(label, make)
    return rows


def cnn_bars(rows: dict[str, Any]) -> None:
    base = rows["float"]["metric"]

    def drop(label: str) -> float:
        return 100 * (base - rows[label]["metric"])

    for label, limit in (("int8", 0.3), ("int4 g32 (RTN)", 2.0), ("gptq int4 g32", 0.5), ("qat int4 g32", 0.5)):
        bar(f"cnn {label} accuracy drop <= {limit} pt", f"{drop(label):+.2f} pt",
            drop(label) <= limit + 1e-9, f"float {100 * base:.2f}%, quantized {100 * rows[label]['metric']:.2f}%")


def tinylm_bars(rows: dict[str, Any]) -> None:
    base = rows["float"]["metric"]

    def rel(label: str) -> float:
        return 100 * (rows[label]["metric"] - base) / base

    bar("tinylm q8_0 bits/byte within 0.5% of float", f"{rel('q8_0'):+.3f}%", abs(rel("q8_0")) <= 0.5,
        f"float {base:.4f}, q8_0 {rows['q8_0']['metric']:.4f}")
    bar("tinylm q4_0 bits/byte within 5% of float", f"{rel('q4_0'):+.3f}%", abs(rel("q4_0")) <= 5,
        f"q4_0 {rows['q4_0']['metric']:.4f}")
    rtn = rows["int4 g32 (RTN)"]["metric"]
    for label, text in (("gptq int4 g32", "GPTQ int4 g32 strictly better than RTN int4 g32"),
                        ("qat int4 g32", "QAT int4 g32 better than RTN int4 g32")):
        value = rows[label]["metric"]
        bar(f"tinylm {text}", f"{value:.4f} vs {rtn:.4f} bits/byte", value < rtn, f"float {base:.4f}")


# ------------------------------------------------------------------------------------ speed


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def _fresh(n: int) -> None:
    """Allocate n bytes of new memory and touch every page (an anonymous mmap: never recycled)."""
    import mmap

    buffer = mmap.mmap(-1, n)
    torch.frombuffer(buffer, dtype=torch.uint8).fill_(0)
    buffer.close()


def block_speed(millions: int = 64) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    from modelkit.quantizers import gguf_blocks

    rows = millions * 2**20 // 4096
    x = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(0))
    source = torch.empty(256 * 2**20, dtype=torch.uint8).fill_(1)
    target = torch.empty_like(source).fill_(0)                         # both touched: no page faults timed
    copy = _best(lambda: target.copy_(source), 5)
    bandwidth = 2 * source.numel() / copy                                # bytes read + written per second
    print(f"  memcpy 256 MB: {1e3 * copy:.1f} ms -> {bandwidth / 1e9:.1f} GB/s (read + write)", flush=True)
    speed: dict[str, Any] = {"memcpy_gb_s": bandwidth / 1e9, "types": {}}
    print(f"  implementations here, fastest first: {', '.join(gguf_blocks.IMPLEMENTATIONS)} "
          f"(the bars use {gguf_blocks.IMPLEMENTATIONS[0]})", flush=True)
    speed["implementation"] = gguf_blocks.IMPLEMENTATIONS[0]
    for name, need in (("q8_0", 10), ("q4_0", 4), ("q4_1", 10), ("q5_0", 4), ("q5_1", 10)):
        kind = GGMLQuantizationType[name.upper()]
        reference = gguf_quantize(x.numpy(), kind)
        theirs = _best(lambda kind=kind: gguf_quantize(x.numpy(), kind), 5)   # best of 5 for both
        times, same = {}, True
        for implementation in gguf_blocks.IMPLEMENTATIONS:
            gguf_blocks.quantize(x[:64], name, implementation=implementation)   # warm-up
            times[implementation] = _best(lambda n=name, i=implementation: gguf_blocks.quantize(x, n, implementation=i), 5)
            out = gguf_blocks.quantize(x, name, implementation=implementation)
            same = same and bool(np.array_equal(out.numpy(), reference))
        ours = times[gguf_blocks.IMPLEMENTATIONS[0]]
        others = "; ".join(f"{i}: {1e3 * t:.0f} ms = {theirs / t:.1f}x" for i, t in list(times.items())[1:])
        traffic = x.numel() * 4 + out.numel()
        fraction = traffic / ours / bandwidth
        # The floor no implementation avoids: the output is new memory, and first touching it costs
        # page faults (expensive in a VM); timed the same way here.
        fresh = _best(lambda n=out.numel(): _fresh(n), 3)
        speed["types"][name] = {"ours_ms": 1e3 * ours, "gguf_py_ms": 1e3 * theirs, "ratio": theirs / ours,
                                "bandwidth_fraction": fraction, "byte_identical": same,
                                "fresh_output_ms": 1e3 * fresh,
                                "implementations_ms": {i: 1e3 * t for i, t in times.items()}}
        bar(f"{name} on {millions} M parameters >= {need}x gguf.quants.quantize",
            f"{theirs / ours:.1f}x", same and theirs / ours >= need,
            f"{1e3 * ours:.0f} ms vs {1e3 * theirs:.0f} ms; {100 * fraction:.0f}% of memory bandwidth; "
            f"first touching {out.numel() / 2**20:.0f} MiB of fresh 4 KiB pages alone (we use huge pages): {1e3 * fresh:.0f} ms; "
            f"byte-identical (every implementation): {same}; other implementations: {others or 'none'}")
    RESULTS["block_speed"] = speed


def dynamic_speed() -> None:
    from modelkit.quantizers.int8_dynamic import Int8DynamicConfig, apply

    torch.manual_seed(0)
    linear = torch.nn.Linear(2048, 2048).eval()
    quantized = apply(linear, Int8DynamicConfig())
    x = torch.randn(64, 2048)
    with torch.no_grad():
        for _ in range(3):
            linear(x), quantized(x)
        floats, ints = [], []
        for _ in range(40):                               # interleaved, so load changes hit both alike
            started = time.perf_counter()
            linear(x)
            floats.append(time.perf_counter() - started)
            started = time.perf_counter()
            quantized(x)
            ints.append(time.perf_counter() - started)
        err = float((quantized(x) - linear(x)).abs().max() / linear(x).abs().max())
    f, q = statistics.median(floats), statistics.median(ints)
    RESULTS["int8_dynamic_linear"] = {"float_ms": 1e3 * f, "int8_ms": 1e3 * q, "ratio": q / f, "relative_err": err}
    bar("int8-dynamic Linear 2048x2048 batch 64 <= 0.5x float latency", f"{q / f:.2f}x", q / f <= 0.5,
        f"{1e3 * q:.2f} ms vs float {1e3 * f:.2f} ms; relative output error {err:.4f}")


# ------------------------------------------------------------------------------------ peers


def peers(name: str, model: torch.nn.Module, ours: float, folder: Path) -> None:
    """torch.ao and onnxruntime dynamic int8 on the same model, next to modelkit's int8-dynamic."""
    from modelkit.api import save
    from modelkit.checkpoint import Checkpoint
    from modelkit.pipeline.convert import convert
    from modelkit.pipeline.quantize import quantize

    key = load_model_module(name).TASK.metric
    table = []
    float_path = folder / f"{name}.safetensors"
    save(Checkpoint.from_module(model), float_path, force=True)
    mine = quantize_module(model, schemes.config_from_dict({"scheme": "int8-dynamic"}))
    table.append(("modelkit int8-dynamic", ours, latencies(mine)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                   # torch.ao announces its own removal
        from torch.ao.quantization import quantize_dynamic

        ao = quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    table.append(("torch.ao quantize_dynamic", metric_of(ao)[key], latencies(ao)))
    onnx_path = folder / f"{name}.onnx"
    convert(float_path, onnx_path, force=True)
    report = quantize(onnx_path, folder / f"{name}-ort-int8.onnx", scheme="int8-dynamic", evaluate=True, force=True)
    table.append(("onnxruntime float", report.metric["float"], report.latency_ms["float"]))
    table.append(("onnxruntime quantize_dynamic", report.metric["quantized"], report.latency_ms["quantized"]))
    table.insert(0, ("torch float", metric_of(model)[key], latencies(model)))
    print(f"  {'method':<30} {key:>14} {'ms batch 1':>11} {'ms batch 64':>12}")
    for label, value, lat in table:
        print(f"  {label:<30} {value:>14.4f} {lat['batch_1']:>11.3f} {lat['batch_64']:>12.3f}", flush=True)
    RESULTS.setdefault("peers", {})[name] = [{"method": m, key: v, **lat} for m, v, lat in table]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="runs", help="folder with trained reference models (modelkit demo's)")
    parser.add_argument("--skip-tinylm", action="store_true", help="cnn bars and speed only")
    parser.add_argument("--speed-only", action="store_true")
    parser.add_argument("--qat-steps", type=int, default=150, help="tinylm QAT steps (one partial epoch)")
    parser.add_argument("--json", help="also write every figure to this file")
    args = parser.parse_args()
    runs = Path(args.runs)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    if not args.speed_only:
        print("\n== cnn: digits test accuracy", flush=True)
        cnn = load_module_cached("cnn", runs)
        rows = zoo("cnn", cnn, qat_epochs=6, qat_steps=None)
        cnn_bars(rows)
        RESULTS["cnn"] = rows
        if not args.skip_tinylm:
            print("\n== tinylm: validation bits per byte", flush=True)
            tinylm = load_module_cached("tinylm", runs)
            rows = zoo("tinylm", tinylm, qat_epochs=1, qat_steps=args.qat_steps)
            tinylm_bars(rows)
            RESULTS["tinylm"] = rows
    print("\n== speed", flush=True)
    block_speed()
    dynamic_speed()
    if not args.speed_only:
        with tempfile.TemporaryDirectory() as folder:
            for name in ("cnn",) if args.skip_tinylm else ("cnn", "tinylm"):
                print(f"\n== peers on {name}: dynamic int8", flush=True)
                peers(name, load_module_cached(name, runs), RESULTS[name]["int8-dynamic"]["metric"], Path(folder))
    met = sum(b["met"] for b in RESULTS["bars"])
    print(f"\n{met} of {len(RESULTS['bars'])} bars met", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=2, default=str) + "\n")
    return 0


_MODELS: dict[str, torch.nn.Module] = {}


def load_module_cached(name: str, runs: Path) -> torch.nn.Module:
    if name not in _MODELS:
        _MODELS[name] = reference_model(name, runs)
    return _MODELS[name]


if __name__ == "__main__":
    sys.exit(main())
