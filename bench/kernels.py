"""One-thread microbenchmark of the packed-weight kernels (quantizers/_matmul_kernels.c) against fp32 `linear`.

    .venv/bin/python bench/kernels.py [--types q4_0,q4_k,...] [--isa avx2] [--rows 1,16] [--shape 2048x768]
                                      [--rounds 5] [--hot] [--baseline OLD/_matmul_kernels.cpython-311-....so]

Each type's weight is quantized once and copied until the copies hold >= 96 MB (fp32: as many copies as
the quantized type needs, at least 96 MB), so every call streams its weights from memory as a decode step
does (--hot: one copy, kept in cache). One round times float and every type in turn, interleaved, on
one thread, in this thread's CPU time (a shared machine's other work does not count, though it still
shares the caches and memory); the figures are the medians over the rounds (range in brackets) of
the weights' bytes streamed per CPU second and of the time against float's in the same round.
--baseline: another build of _matmul_kernels (say, of the previous commit: gcc -O3 -fPIC -shared -I<python
include> quantizers/_matmul_kernels.c -o /tmp/old/_matmul_kernels<ext suffix>), timed in the same rounds on
the same weights and reported as "old" beside each type.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from modelkit.quantizers import _modules, fast_linear, gguf_blocks, int4, int8

TYPES = ("int8", "int4", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k",
         "q6_k", "iq4_xs")
STREAM_BYTES = 96 << 20


def layer_of(type_name: str, weight: torch.Tensor) -> nn.Module:
    if type_name == "int8":
        return int8.apply(nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=False)), int8.Int8Config())[0]
    if type_name == "int4":
        return int4.apply(nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=False)), int4.Int4Config())[0]
    return _modules.QuantizedLinear(gguf_blocks.quantized_tensor(weight, type_name), None)


def packed_bytes(p: fast_linear.Packed) -> int:
    return sum(t.numel() * t.element_size() for t in (p.data, p.scale, p.zero) if t is not None)


def copies_of(p: fast_linear.Packed, hot: bool) -> list[fast_linear.Packed]:
    n = 1 if hot else max(1, -(-STREAM_BYTES // packed_bytes(p)))
    return [p] + [dataclasses.replace(p, data=p.data.clone(), scale=None if p.scale is None else p.scale.clone(),
                                      zero=None if p.zero is None else p.zero.clone()) for _ in range(n - 1)]


def seconds_per_call(fn, calls: int, min_seconds: float = 0.1) -> float:
    """Median CPU seconds of this thread per call (one thread: time spent descheduled on a shared machine
    does not count)."""
    fn(0)
    times = []
    started = time.thread_time()
    while time.thread_time() - started < min_seconds or len(times) < 3:
        t0 = time.thread_time()
        for i in range(calls):
            fn(i)
        times.append((time.thread_time() - t0) / calls)
    return statistics.median(times)


def load_baseline(path: str):
    """Another build of the kernels module, loaded beside the installed one."""
    spec = importlib.util.spec_from_file_location("baseline._matmul_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def baseline_call(module, x: torch.Tensor, p: fast_linear.Packed, isa: str) -> torch.Tensor:
    """fast_linear.matmul's call, made on the baseline module (one thread)."""
    m, n = x.shape[0], p.rows
    y = x.new_empty((m, n))
    module.linear(isa, 1, *fast_linear.weight_args(p), 0, n, p.cols, x.data_ptr(), m, y.data_ptr(), 0)
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--isa", default=None, help="a name of fast_linear.ISAS (default: the chosen one)")
    parser.add_argument("--rows", default="1,16", help="activation rows per call, comma-separated")
    parser.add_argument("--shape", default="2048x768", help="N x K of the weight")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hot", action="store_true", help="one copy of each weight, in cache")
    parser.add_argument("--baseline", help="a previous build of _matmul_kernels (.so) to time beside this one")
    args = parser.parse_args()
    old = load_baseline(args.baseline) if args.baseline else None
    torch.set_num_threads(1)
    n, k = (int(v) for v in args.shape.split("x"))
    isa = args.isa or fast_linear.ISA
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    floats = [weight] + [weight.clone() for _ in range(0 if args.hot else max(0, -(-STREAM_BYTES // (4 * n * k)) - 1))]
    packs = {}
    for t in args.types.split(","):
        p = layer_of(t, weight).packed()
        if p is None:
            print(f"{t}: no kernel at {n}x{k}")
            continue
        packs[t] = copies_of(p, args.hot)
    print(f"{n}x{k}, isa {isa}, 1 thread, {'hot' if args.hot else 'streamed'}, {args.rounds} rounds interleaved")
    for m in (int(v) for v in args.rows.split(",")):
        x = torch.randn(m, k)
        rates: dict[str, list[float]] = {t: [] for t in ["float", *packs]}
        ratios: dict[str, list[float]] = {t: [] for t in packs}
        old_ratios: dict[str, list[float]] = {t: [] for t in packs}
        for _ in range(args.rounds):
            with torch.no_grad():
                base = seconds_per_call(lambda i, x=x: F.linear(x, floats[i % len(floats)]), len(floats))
            rates["float"].append(4 * n * k / base / 1e9)
            for t, ps in packs.items():
                s = seconds_per_call(lambda i, x=x, ps=ps: fast_linear.matmul(x, ps[i % len(ps)], isa=isa, threads=1), len(ps))
                rates[t].append(packed_bytes(ps[0]) / s / 1e9)
                ratios[t].append(s / base)
                if old is not None:
                    s_old = seconds_per_call(lambda i, x=x, ps=ps: baseline_call(old, x, ps[i % len(ps)], isa), len(ps))
                    old_ratios[t].append(s_old / base)
        print(f"  M={m}: float {statistics.median(rates['float']):.1f} GB/s "
              f"[{min(rates['float']):.1f}-{max(rates['float']):.1f}]")
        for t in packs:
            r = ratios[t]
            was = old_ratios[t]
            print(f"    {t:7s} {statistics.median(rates[t]):6.1f} GB/s  {statistics.median(r):.3f}x float "
                  f"[{min(r):.3f}-{max(r):.3f}]" + (f"   old {statistics.median(was):.3f}x [{min(was):.3f}-{max(was):.3f}]"
                                                     if was else ""))


if __name__ == "__main__":
    main()
