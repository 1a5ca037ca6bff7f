"""Affine integer quantization shared by int8, int4, GPTQ and QAT: w ~ (q - zero_point) * scale.

The stored form is checkpoint.py's "affine" layout: the weight viewed as (rows, cols) with
rows = shape[0] (output channels; embedding rows) and cols = everything else; one scale (and
zero point) per row and group of `group_size` columns, or one for the whole tensor. 8-bit
values are int8; 4-bit values are packed two per byte, low nibble first (two's complement
nibbles when symmetric, 0..15 with a zero point otherwise).

`fake_quantize` returns exactly the float values the stored form dequantizes to (scales are
rounded to their storage dtype first), so QAT trains against, and GPTQ compensates for, the
very numbers the quantized model computes with.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from modelkit.checkpoint import LazyTensor, QuantizedTensor
from modelkit.errors import ConfigError


@dataclass(frozen=True)
class AffineSpec:
    """How one weight is quantized.

    Args:
        bits: 8 or 4.
        group_size: Columns per scale; None: one scale per row (per channel); 0: one per tensor.
        symmetric: No zero point; the range is [-2^(bits-1), 2^(bits-1) - 1].
        scale_dtype: Storage dtype of scales (float16 for int4, float32 for int8).
    """

    bits: int
    group_size: int | None
    symmetric: bool
    scale_dtype: torch.dtype = torch.float32

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1)) if self.symmetric else 0 if self.bits == 4 else -128

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 15 if self.bits == 4 else 127

    def groups_of(self, cols: int) -> int:
        """Column group width for a weight with `cols` columns."""
        if self.group_size == 0 or self.group_size is None:
            return cols
        return self.group_size

    def fits(self, shape: tuple[int, ...]) -> str | None:
        """None if a weight of `shape` can be stored this way, else why not."""
        if len(shape) < 2:
            return "1-D tensors stay float"
        cols = math.prod(shape[1:])
        if self.group_size and cols % self.group_size:
            return f"{cols} input columns are not a multiple of group_size {self.group_size}"
        if self.bits == 4 and cols % 2:
            return f"{cols} input columns cannot be packed two per byte"
        return None


def as_matrix(weight: torch.Tensor) -> torch.Tensor:
    """(rows, cols) float32 view of a weight: rows = shape[0]."""
    return weight.detach().float().reshape(weight.shape[0], -1)


def _tiny(dtype: torch.dtype) -> float:
    # the smallest normal number of the storage dtype: a scale must survive the cast
    return float(torch.finfo(dtype).tiny)


def scales(w: torch.Tensor, spec: AffineSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (rounded to its storage dtype) and zero point for (rows, groups, group) values.

    Symmetric: scale = max|w| / qmax. Asymmetric: the range [min(w, 0), max(w, 0)] over the
    levels, zero point = round(-min / scale), so 0.0 is exactly representable.
    """
    if spec.group_size == 0:
        w = w.reshape(1, 1, -1)
    if spec.symmetric:
        scale = w.abs().amax(-1) / spec.qmax
        zero = None
    else:
        lo = w.amin(-1).clamp(max=0)
        hi = w.amax(-1).clamp(min=0)
        scale = (hi - lo) / (spec.qmax - spec.qmin)
    scale = scale.clamp(min=_tiny(spec.scale_dtype)).to(spec.scale_dtype)
    if not spec.symmetric:
        zero = (spec.qmin - torch.round(lo / scale.float())).clamp(spec.qmin, spec.qmax)
    return scale, zero


def grouped(weight: torch.Tensor, spec: AffineSpec) -> torch.Tensor:
    """(rows, cols) -> (rows, groups, group) float32."""
    w = as_matrix(weight)
    return w.reshape(w.shape[0], -1, spec.groups_of(w.shape[1]))


def quantize_values(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: AffineSpec) -> torch.Tensor:
    """Integer levels (as float) of (rows, groups, group) values: clamp(round(w / scale) + zero)."""
    if spec.group_size == 0:
        shaped = w.reshape(1, 1, -1)
    else:
        shaped = w
    q = torch.round(shaped / scale.float().unsqueeze(-1))
    if zero is not None:
        q = q + zero.unsqueeze(-1)
    return q.clamp_(spec.qmin, spec.qmax).reshape(w.shape)


def dequantize_values(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: AffineSpec) -> torch.Tensor:
    """(q - zero) * scale, in the order and precision checkpoint.py's affine layout uses."""
    shape = q.shape
    if spec.group_size == 0:
        q = q.reshape(1, 1, -1)
    values = q.float()
    if zero is not None:
        values = values - zero.float().unsqueeze(-1)
    return (values * scale.float().unsqueeze(-1)).reshape(shape)


def fake_quantize(weight: torch.Tensor, spec: AffineSpec) -> torch.Tensor:
    """The weight as the quantized model sees it (same shape and dtype); no gradient through it."""
    w = grouped(weight, spec)
    scale, zero = scales(w, spec)
    q = quantize_values(w, scale, zero, spec)
    return dequantize_values(q, scale, zero, spec).reshape(weight.shape).to(weight.dtype)


def pack(q: torch.Tensor, spec: AffineSpec) -> torch.Tensor:
    """(rows, cols) integer levels -> stored qdata: int8 (rows, cols), or uint8 (rows, cols / 2) for 4 bits."""
    if spec.bits == 8:
        return q.to(torch.int8)
    nibbles = q.to(torch.int16) & 0x0F                                          # two's complement nibbles
    pairs = nibbles.reshape(q.shape[0], -1, 2)                                  # (rows, cols/2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)             # low nibble first


def quantized_tensor(weight: torch.Tensor, spec: AffineSpec, *, scheme: str,
                     levels: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None) -> QuantizedTensor:
    """`weight` in the affine layout; `levels` = (q, scale, zero) when already computed (GPTQ)."""
    reason = spec.fits(tuple(weight.shape))
    if reason is not None:
        raise ConfigError(f"{scheme}: cannot quantize a weight of shape {list(weight.shape)}: {reason}")
    if levels is None:
        w = grouped(weight, spec)
        scale, zero = scales(w, spec)
        q = quantize_values(w, scale, zero, spec)
    else:
        q, scale, zero = levels
    rows = weight.shape[0]
    q = q.reshape(rows, -1)
    parts = {"qdata": LazyTensor.of(pack(q, spec).contiguous()),
             "scale": LazyTensor.of(scale.reshape(scale.shape[0], -1).contiguous())}
    if zero is not None:
        zero_dtype = torch.uint8 if spec.bits == 4 else torch.int8
        parts["zero_point"] = LazyTensor.of(zero.reshape(scale.shape[0], -1).to(zero_dtype).contiguous())
    params = {"bits": spec.bits, "symmetric": spec.symmetric,
              "group_size": spec.group_size if spec.group_size else (0 if spec.group_size == 0 else q.shape[1])}
    return QuantizedTensor(scheme=scheme, layout="affine", shape=tuple(weight.shape), dtype=weight.dtype,
                           parts=parts, params=params)
