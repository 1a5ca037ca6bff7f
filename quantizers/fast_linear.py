"""Quantized layers computing on their packed weights: the C kernels of _matmul_kernels.c.

A quantized Linear (and a Conv2d, through unfold) computes y = x @ W.T + b without a float copy of
W: the activations are rounded to int8 in blocks of 32 (llama.cpp's q8_0 activations) and the
kernels take integer dot products with the weight blocks as the file stores them. Supported weights
(`packed_form`): every GGUF block type modelkit reads (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl; the
K-quants q2_k .. q6_k and iq4_xs, whose activations are rounded as llama.cpp's q8_K: blocks of 256
with one scale), affine int8 per channel or per tensor (symmetric or with a zero point), affine int4
in groups of 32/64/128 (symmetric or with zero points: int4 and gptq). Anything else (GPT-2's
transposed blocks, float types) returns None here and its layer dequantizes one layer at a time.

Which kernel runs is chosen once, at import: the best of `ISAS` on this CPU ("avx512vnni",
"avxvnni", "avx2", "generic"), or the one named by MODELKIT_MATMUL_ISA ("off" turns the kernels off).
`use_isa` switches it for a block of code (the tests run every kernel against the reference).
Rows of outputs are shared between torch's number of threads (`torch.get_num_threads()`) where a
product is large enough (`threads_for`).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from modelkit.errors import ConfigError

try:
    from modelkit.quantizers import _matmul_kernels as _kernels
except ImportError:                        # built without a C compiler: layers dequantize instead
    _kernels = None

ENV = "MODELKIT_MATMUL_ISA"
ISAS: tuple[str, ...] = tuple(_kernels.ISAS) if _kernels is not None else ()
QK = 32                                    # activations per block scale; weights per block
F_I8, F_Q8_0, F_Q4_0, F_I4 = 0, 1, 2, 3    # _matmul_kernels.c's formats
# GGUF type -> (_matmul_kernels.c's format, bytes per block, weights per block)
GGUF_FORMATS = {"Q8_0": (F_Q8_0, 34, 32), "Q4_0": (F_Q4_0, 18, 32), "Q4_1": (4, 20, 32), "Q5_0": (5, 22, 32),
                "Q5_1": (6, 24, 32), "IQ4_NL": (7, 18, 32), "Q2_K": (8, 84, 256), "Q3_K": (9, 110, 256),
                "Q4_K": (10, 144, 256), "Q5_K": (11, 176, 256), "Q6_K": (12, 210, 256), "IQ4_XS": (13, 136, 256)}
# Threads share a product only where each gets enough work to repay waking it (and sharing a core
# with torch's own spinning OpenMP threads): 2 Mi multiply-adds (~30 us on one thread) where the
# weights are reused over 8+ activation rows, 1 Mi weights (~1 MB, ~30 us streamed from memory)
# for fewer rows (decode). Below, one thread: tinylm's products (<= 1.6 Mi at 16 tokens) never split.
SMALL_WORK, SMALL_WEIGHTS = 1 << 21, 1 << 20


def _chosen(name: str | None) -> str | None:
    if name in (None, ""):
        return ISAS[0] if ISAS else None
    if name == "off":
        return None
    if name not in ISAS:
        raise ConfigError(f"{ENV}={name!r}: this build and CPU run {', '.join(ISAS) or 'no kernels'} (or 'off')")
    return name


ISA: str | None = _chosen(os.environ.get(ENV))


@contextmanager
def use_isa(name: str | None) -> Iterator[None]:
    """Run the quantized layers with kernel `name` (a name of ISAS, or None: dequantize) inside the block."""
    global ISA
    previous, ISA = ISA, _chosen(name) if name is not None else None
    try:
        yield
    finally:
        ISA = previous


@dataclass(frozen=True)
class Packed:
    """How the kernels read one weight: the stored tensors (kept alive here) and their geometry."""

    fmt: int
    rows: int                              # N: output features
    cols: int                              # K: input features
    data: torch.Tensor
    row_bytes: int
    scale: torch.Tensor | None = None
    scale_stride: int = 0
    zero: torch.Tensor | None = None
    zero_stride: int = 0
    group_blocks: int = 1
    signed_nibbles: bool = False


def _contiguous(t: torch.Tensor | None) -> bool:
    return t is None or (t.device.type == "cpu" and t.is_contiguous())


def packed_form(layout: str, params: dict, shape: tuple[int, ...], parts: dict[str, torch.Tensor]) -> Packed | None:
    """The kernels' view of a quantized weight viewed as (shape[0], everything else), or None when no
    kernel reads it (then the layer dequantizes)."""
    if len(shape) < 2 or not all(_contiguous(t) for t in parts.values()):
        return None
    rows, cols = shape[0], 1
    for n in shape[1:]:
        cols *= n
    data = parts.get("qdata")
    if data is None:
        return None
    if layout == "gguf":
        found = GGUF_FORMATS.get(str(params.get("ggml_type", "")).upper())
        if found is None or params.get("transposed") or cols % found[2] or data.dtype != torch.uint8:
            return None
        fmt, block_bytes, block = found
        if data.numel() != rows * cols // block * block_bytes:
            return None
        return Packed(fmt, rows, cols, data, cols // block * block_bytes)
    if layout != "affine":
        return None
    bits, scale, zero = int(params.get("bits", 8)), parts.get("scale"), parts.get("zero_point")
    if scale is None:
        return None
    if bits == 8:
        if data.dtype != torch.int8 or data.numel() != rows * cols or scale.dtype != torch.float32:
            return None
        if scale.numel() not in (1, rows) or (zero is not None and (zero.dtype != torch.int8 or zero.numel() != scale.numel())):
            return None
        stride = 1 if scale.numel() == rows and rows > 1 else 0
        return Packed(F_I8, rows, cols, data, cols, scale, stride, zero, stride)
    if bits == 4:
        if data.dtype != torch.uint8 or cols % QK or data.numel() != rows * cols // 2 or scale.dtype != torch.float16:
            return None
        groups = scale.numel() // rows if scale.numel() % rows == 0 else 0
        if groups < 1 or cols % groups or (cols // groups) % QK:
            return None
        symmetric = bool(params.get("symmetric", True))
        if symmetric == (zero is not None) or (zero is not None and (zero.dtype != torch.uint8 or zero.numel() != scale.numel())):
            return None
        return Packed(F_I4, rows, cols, data, cols // 2, scale, groups, zero, groups, cols // groups // QK, symmetric)
    return None


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def weight_args(packed: Packed) -> tuple[int, ...]:
    """The kernel call's weight arguments (addresses and geometry), worked out once per Packed."""
    found = packed.__dict__.get("_args")
    if found is None:
        found = (packed.fmt, packed.data.data_ptr(), packed.row_bytes, _address(packed.scale), packed.scale_stride,
                 _address(packed.zero), packed.zero_stride, packed.group_blocks, int(packed.signed_nibbles))
        object.__setattr__(packed, "_args", found)
    return found


def kernels() -> Any:
    """The compiled kernels module (_matmul_kernels.c), or None where modelkit was built without them."""
    return _kernels


def threads_for(M: int, N: int, K: int) -> int:
    """Threads sharing the output rows of an (M, K) @ (K, N) product: torch's number where the work
    is large enough (SMALL_WORK, SMALL_WEIGHTS), else one."""
    if (M * N * K if M >= 8 else N * K) < (SMALL_WORK if M >= 8 else SMALL_WEIGHTS):
        return 1
    return torch.get_num_threads()


def matmul(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None, *, rowwise: bool = False,
           isa: str | None = None, threads: int | None = None) -> torch.Tensor:
    """x (..., K) @ W.T + bias with the kernels (float32 math; returns x's dtype).

    Args:
        rowwise: One activation scale per row (int8-dynamic's activations) instead of one per 32 values.
        isa: A name of ISAS; default the chosen one.
        threads: Threads sharing the output rows; default `threads_for` the product.
    """
    isa = isa or ISA
    if isa is None:
        raise ConfigError("the packed-weight kernels are not available (modelkit was built without a C compiler)")
    K, N = packed.cols, packed.rows
    if x.shape[-1:] != (K,):
        raise ConfigError(f"an input of shape {tuple(x.shape)} to a quantized layer of {K} input features")
    # Called once per layer per token: no reshapes, one allocation (the output, shaped as x).
    flat = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    M = flat.numel() // K
    y = flat.new_empty((*x.shape[:-1], N))
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.detach().to(torch.float32).contiguous()
    _kernels.linear(isa, threads or threads_for(M, N, K), *weight_args(packed), _address(bias), N, K,
                    flat.data_ptr(), M, y.data_ptr(), int(rowwise))
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def usable(x: torch.Tensor) -> bool:
    """The kernels can take this input: chosen, on CPU, float, no gradient wanted through it, and not
    being traced or compiled into a graph (which would record an opaque call on raw addresses)."""
    return (ISA is not None and x.is_cpu and x.is_floating_point()
            and not (x.requires_grad and torch.is_grad_enabled())
            and not torch.jit.is_tracing() and not torch.compiler.is_compiling())   # graphs record the reference ops
