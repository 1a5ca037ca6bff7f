"""Checks run on a written output before it takes its final name.

- weights: every tensor read back equals the expected one bit for bit (`verify_weights`);
- graphs: the file's own runtime (onnxruntime, the ScriptModule) and torch eager run seeded
  sample inputs, compared by `modelkit.testing.compare_outputs` within the format's tolerance
  (`verify_outputs`).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from modelkit.checkpoint import Checkpoint, LazyTensor, QuantizedTensor, instantiate
from modelkit.errors import ConfigError, VerificationError
from modelkit.storage.copy_check import copied_equal
from modelkit.storage.dtypes import dtype_name, to_numpy, widen_to_float32
from modelkit.storage.tensors import MadeTensor, digest

if TYPE_CHECKING:        # weights are verified without torch; graphs import it where they run
    import torch
    from torch import nn

    from modelkit.formats import WriteOptions

# Largest |eager - runtime| accepted for graph formats, per format and dtype. Measured on the
# reference models on 2026-11-21 (see docs/formats/<name>.md for the figures), then pinned with
# headroom: float32 kernels differ in summation order, not in what they compute.
# Keyed by dtype name: ("onnx", "float32").
GRAPH_ATOL: dict[tuple[str, str], float] = {
    ("onnx", "float32"): 1e-4,
    ("torchscript", "float32"): 1e-5,
    ("pt2", "float32"): 1e-5,
    ("pt2", "float16"): 5e-2,
    ("pt2", "bfloat16"): 2e-1,
    ("onnx", "float16"): 5e-2,
    ("torchscript", "float16"): 5e-2,
    ("onnx", "bfloat16"): 2e-1,
    ("torchscript", "bfloat16"): 2e-1,
    ("openvino", "float32"): 1e-4,          # the ONNX tolerances (docs/formats/openvino.md has the measured figures)
    ("openvino", "float16"): 5e-2,
    ("openvino", "bfloat16"): 2e-1,
}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    x, y = (np.ascontiguousarray(v).reshape(-1).view(np.uint8) for v in (a, b))
    if x.size % 8 == 0 and x.ctypes.data % 8 == 0 and y.ctypes.data % 8 == 0:   # 8x fewer elements to compare
        x, y = x.view(np.int64), y.view(np.int64)

    # in chunks: array_equal's temporary boolean array stays 1 MiB, not a byte per element of the tensor
    def same(i: int) -> bool:
        return bool(np.array_equal(x[i:i + _CHUNK], y[i:i + _CHUNK]))

    starts = range(0, x.size, _CHUNK)
    if x.nbytes < _PARALLEL or _WORKERS < 2:
        return all(map(same, starts))
    # A large tensor's chunks on several threads (numpy compares without the GIL): reading back a file
    # just written is mostly the first touch of its pages and of the source's, which threads share out.
    with ThreadPoolExecutor(_WORKERS, thread_name_prefix="modelkit-verify") as pool:
        return all(pool.map(same, starts))


_CHUNK = 1 << 20
_PARALLEL = 16 << 20                  # bytes from which a comparison is shared out between threads
_WORKERS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _max_error(want: np.ndarray, got: np.ndarray, entry: Any) -> float:
    if want.shape != got.shape or want.dtype != got.dtype or want.dtype == np.bool_:
        return float("inf")
    if not entry.dtype.exact and entry.dtype.name == "bfloat16":
        want, got = widen_to_float32(want, entry.dtype), widen_to_float32(got, entry.dtype)
    elif not entry.dtype.exact:
        return float("inf")
    return float(np.abs(want.astype(np.float64) - got.astype(np.float64)).max()) if want.size else 0.0


def verify_weights(expected: Checkpoint, written: Checkpoint, *, label: str, dropped: set[str] | frozenset[str] = frozenset(),
                   rtol: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Every tensor of `expected` is in `written` with the same dtype, shape and bits (numpy; no torch).

    The writer's own exceptions (a format convention that cannot be undone exactly): `dropped` names it
    leaves out on purpose, and `rtol` per tensor a relative error allowed as |got - want| <= rtol * (1 + |want|)
    (Gemma's norms, stored + 1 in float32, for llama.cpp).
    """
    rtol = rtol or {}
    worst = 0.0
    missing = [n for n in expected.tensors if n not in written.tensors and n not in dropped]
    if missing:
        raise VerificationError(f"{label}: tensor {missing[0]!r} is missing from the output", max_abs_err=float("inf"), atol=0.0)
    for name, entry in expected.tensors.items():
        if name not in dropped:      # one tensor at a time: its arrays are freed before the next is read
            worst = max(worst, _check_tensor(name, entry, written.tensors[name], rtol.get(name), label))
    if rtol or dropped:
        return {"method": "bit-exact except the format's own conventions", "tensors_checked": len(expected.tensors) - len(dropped),
                "max_abs_err": worst, "atol": 0.0, "passed": True}
    return {"method": "bit-exact", "tensors_checked": len(expected.tensors), "max_abs_err": 0.0, "atol": 0.0, "passed": True}


def _check_tensor(name: str, entry: Any, other: Any, rtol: float | None, label: str) -> float:
    """One tensor of verify_weights: 0.0 when the bits are equal, the error when `rtol` allows it; else raises."""
    if entry.dtype is not other.dtype or entry.shape != other.shape:
        raise VerificationError(f"{label}: tensor {name!r} differs ({dtype_name(entry.dtype)} {list(entry.shape)} "
                                f"vs {dtype_name(other.dtype)} {list(other.shape)})", max_abs_err=float("inf"), atol=0.0)
    if _both_quantized(entry, other):      # packed parts compared as stored: no dequantizing, no torch
        if entry.parts.keys() == other.parts.keys() and all(_same_part(entry.parts[p], other.parts[p])
                                                            for p in entry.parts):
            return 0.0
        raise VerificationError(f"{label}: quantized tensor {name!r} differs in its stored parts",
                                max_abs_err=float("inf"), atol=0.0)
    if _copied_unchanged(entry, other) or _equal_in_stored_layout(entry, other):
        return 0.0
    want, got = _stored(entry), _stored(other)
    if _same_bits(want, got):
        return 0.0
    error = _max_error(want, got, entry)
    if rtol is not None and error <= rtol * (1.0 + float(np.abs(want.astype(np.float64)).max(initial=0.0))):
        return error
    raise VerificationError(f"{label}: tensor {name!r} differs ({dtype_name(entry.dtype)} {list(entry.shape)})",
                            max_abs_err=error, atol=0.0)


def _copied_unchanged(entry: Any, other: Any) -> bool:
    """The reader found `other`'s bytes exactly where the writer copied `entry`'s span file to file, and that
    copy compared equal with the span just after it was made (modelkit.storage.copy_check: the comparison
    ran while the writer wrote the rest). Same dtype and shape were checked by the caller."""
    return (isinstance(entry, LazyTensor) and isinstance(other, LazyTensor) and entry.span is not None
            and other.span is not None and copied_equal(other.span, entry.span))


def _equal_in_stored_layout(entry: Any, other: Any) -> bool:
    """A tensor read from a file in another layout (LazyTensor.equals: a TF.js Dense kernel, stored
    transposed) compared with the other side's bits in that file's layout: the same bit-for-bit check
    without making a transposed copy. False when neither side can, or when they differ (the caller then
    compares as usual and reports the error)."""
    if not (isinstance(entry, LazyTensor) and isinstance(other, LazyTensor)):
        return False
    if other.equals is not None:
        return other.equals(entry.array())
    return entry.equals is not None and entry.equals(other.array())


def _same_part(want: LazyTensor, got: LazyTensor) -> bool:
    """A stored part equals what was written: its digest, for bytes that were costly to make and remembered
    theirs when written (MadeTensor: quantized on the way out), else the bits made again."""
    made = want.digest() if isinstance(want, MadeTensor) else None
    if made is not None:
        written = got.array()
        return written.dtype == want.dtype.numpy and tuple(written.shape) == want.shape and digest(written) == made
    return _same_bits(want.array(), got.array())


def _both_quantized(a: Any, b: Any) -> bool:
    return (isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor)
            and (a.scheme, a.layout, dict(a.params)) == (b.scheme, b.layout, dict(b.params)))


def _stored(entry: Any) -> np.ndarray:
    """What is compared: a LazyTensor's bits; a QuantizedTensor's dequantized values (as before)."""
    if isinstance(entry, LazyTensor):
        return entry.array()
    return to_numpy(entry.load())


def sample_inputs(module: nn.Module, example_inputs: tuple[Any, ...] | None = None,
                  batches: tuple[int, ...] = (1, 3)) -> list[tuple[Any, ...]]:
    """Seeded inputs: the caller's, or the reference model's at a few batch sizes."""
    if example_inputs is not None:
        return [tuple(example_inputs)]
    from modelkit.models import MODELS, load_model_module

    name = getattr(type(module), "arch", None)
    if name not in MODELS:
        raise ConfigError(f"{type(module).__name__} is not a reference model: pass example_inputs for export and checks")
    make = load_model_module(name).example_inputs
    dtype = module_dtype(module)       # a module cast to f16/bf16 takes inputs of that dtype
    # Token ids: the zoo makes byte ids (0-255); a smaller vocabulary takes them modulo its size.
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)

    def fit(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            return x.to(dtype)
        return x % vocab if isinstance(vocab, int) and vocab > 0 else x

    return [(fit(make(batch, seed=seed)),) for seed, batch in enumerate(batches)]


def verify_graph(module: nn.Module, run: Callable[..., Any], fmt: str, options: WriteOptions, *,
                 label: str) -> dict[str, Any]:
    """A written graph (`run`: its runtime) against `module` within the format's tolerance, on
    `sample_inputs`; a Hugging Face causal LM on token batches instead, comparing logits (and with
    `options.kv_cache` the present key/values, on a prefill and a decode step) where the attention
    mask keeps tokens (modelkit/testing/causal_lm.py)."""
    from modelkit.testing import causal_lm

    atol = graph_atol(fmt, module_dtype(module))
    if not causal_lm.is_causal_lm(module):
        return verify_outputs(module, run, sample_inputs(module, options.example_inputs), atol=atol, label=label)
    inputs = causal_lm.check_inputs(module, kv_cache=options.kv_cache, given=options.example_inputs)
    reference = causal_lm.Compared(causal_lm.graph(module, kv_cache=options.kv_cache))
    return verify_outputs(reference, causal_lm.candidate(run), inputs, atol=atol, label=label)


def verify_outputs(module: nn.Module, run: Callable[..., torch.Tensor], inputs: list[tuple[Any, ...]], *,
                   atol: float = 0.0, rtol: float = 0.0, label: str) -> dict[str, Any]:
    """`module` in eval mode against `run` (a runtime) on `inputs`, through the one comparator. Quantized
    layers run their reference path (dequantize, then a float product: what a written graph computes),
    not the packed-weight kernels, whose int8 activations a runtime need not reproduce."""
    from modelkit.quantizers.fast_linear import use_isa
    from modelkit.testing import compare_outputs

    module.eval()
    with use_isa(None):
        return compare_outputs(module, run, inputs, atol=atol, rtol=rtol, label=label)


def graph_atol(fmt: str, dtype: Any) -> float:
    return GRAPH_ATOL.get((fmt, dtype_name(dtype)), GRAPH_ATOL.get((fmt, "float32"), 1e-4))


def module_dtype(module: nn.Module) -> torch.dtype:
    import torch

    for p in module.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def reference_module(ckpt: Checkpoint, *, target: str) -> nn.Module | None:
    """The module a graph written from `ckpt` must agree with: rebuilt from its ArchSpec in the
    checkpoint's float dtype. None when no output check applies: no ArchSpec, quantized tensors
    (their own check rebuilds the quantized model), or float tensors of mixed dtypes."""
    dtypes = {t.dtype for t in ckpt.tensors.values() if t.dtype.is_floating_point}
    if ckpt.arch is None or len(dtypes) > 1 or any(isinstance(t, QuantizedTensor) for t in ckpt.tensors.values()):
        return None
    module = instantiate(ckpt, source="the checkpoint", target=target)
    return module.to(dtypes.pop().torch) if dtypes else module
