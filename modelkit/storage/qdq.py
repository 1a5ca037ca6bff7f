"""Quantized weights as DequantizeLinear inputs, and back: y = (data - zero_point) * scale.

ONNX's DequantizeLinear (opset 21: https://onnx.ai/onnx/operators/onnx__DequantizeLinear.html)
takes integer `data`, a float `scale` and an optional `zero_point` of data's type, one scale per
tensor, per slice along `axis`, or per block of `block_size` elements along `axis` (blocked:
scale has data's rank, the block axis divided by block_size). This module maps the
QuantizedTensors modelkit makes onto those inputs, exactly (the DequantizeLinear output is, bit
for bit, what modelkit's own dequantizer returns), and rebuilds their parts from them:

    encoding  QuantizedTensor                       data                 scale (float32)   zero point
    affine    int8 per channel (one scale a row)    INT8                 (rows,) axis 0    INT8 if asymmetric
    affine    int8 per tensor                       INT8                 scalar            INT8 if asymmetric
    affine    4-bit, groups of g columns            INT4 (UINT4 asym.)   blocked, g        UINT4 if asymmetric
    affine    8-bit, groups of g columns (gptq)     INT8                 blocked, g        INT8 if asymmetric
    q8_0      GGUF blocks d f16 | 32 x int8         INT8                 blocked, 32       -
    q4_0      GGUF blocks d f16 | 16 B nibbles      UINT4 (q in 0..15)   blocked, 32       UINT4 8
    q5_0      GGUF blocks d f16 | qh | 16 B         UINT8 (q in 0..31)   blocked, 32       UINT8 16

fp16 scales (int4, GGUF's d) become float32 exactly, so the product is computed in float32 as
modelkit's dequantizers do. 4-bit values appear here unpacked (int8 / uint8 tensors); ONNX packs
them two per byte, the first element in the low nibble (`pack4`). A weight the exporter stores
transposed (`transposed=True`, 2-D only) has data, scale and zero point transposed and the axis
swapped. A blocked N-D weight (a conv with groups across in_channels x kh x kw) is dequantized as
the (rows, cols) matrix and reshaped to its shape by the caller.

q4_1 and q5_1 are d * q + m, which no DequantizeLinear computes exactly: `layout` refuses them.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from modelkit.errors import UnsupportedConversionError
from modelkit.storage.tensors import QuantizedTensor

GGUF_BLOCK = 32                                   # weights per GGUF block (QK8_0 = QK4_0 = QK5_0)
_GGUF = {"Q8_0": (8, True, None, 34), "Q4_0": (4, False, 8, 18), "Q5_0": (8, False, 16, 22)}   # bits, signed, zp, bytes


@dataclass(frozen=True)
class QDQLayout:
    """The shapes and element types of one weight's DequantizeLinear inputs, from its description alone."""

    encoding: str                     # "affine", "q8_0", "q4_0" or "q5_0"
    shape: tuple[int, ...]            # the QuantizedTensor's logical shape
    transposed: bool                  # the graph consumes the 2-D weight transposed
    bits: int                         # 4 or 8: the element type's width
    signed: bool                      # INT4/INT8, else UINT4/UINT8
    data_shape: tuple[int, ...]
    scale_shape: tuple[int, ...]
    axis: int
    block_size: int                   # 0: per axis or per tensor
    zero_point: bool                  # a zero point input exists
    constant_zero: int | None = None  # the value every zero point has (GGUF types), else None

    @property
    def output_shape(self) -> tuple[int, ...]:
        """What the graph consumes: the logical shape, transposed when the exporter stored it so."""
        return self.shape[::-1] if self.transposed else self.shape

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return math.prod(self.shape[1:])


def _refuse(scheme: str, why: str) -> UnsupportedConversionError:
    return UnsupportedConversionError(f"quantized tensor ({scheme})", "onnx", why)


def layout(scheme: str, layout_name: str, shape: tuple[int, ...], params: Mapping[str, Any], *,
           transposed: bool) -> QDQLayout:
    """Where the weight's DequantizeLinear inputs sit.

    Raises:
        UnsupportedConversionError: no DequantizeLinear computes this weight exactly (q4_1, q5_1,
            other block types), or its shape or params do not fit one.
    """
    if len(shape) < 2 or (transposed and len(shape) != 2):
        raise _refuse(scheme, f"a quantized weight of shape {list(shape)} has no DequantizeLinear form here")
    if layout_name == "gguf":
        return _gguf_layout(scheme, shape, str(params.get("ggml_type", "")), transposed=transposed)
    if layout_name != "affine":
        raise _refuse(scheme, f"layout {layout_name!r} has no DequantizeLinear form; write gguf or safetensors")
    bits, group, symmetric = params.get("bits", 8), params.get("group_size"), params.get("symmetric", True)
    rows, cols = shape[0], math.prod(shape[1:])
    if bits not in (4, 8) or not isinstance(group, int) or isinstance(group, bool) or group < 0 or not isinstance(symmetric, bool):
        raise _refuse(scheme, f"affine params {dict(params)} are not bits 4/8, an integer group_size and symmetric")
    signed = symmetric or bits == 8              # asymmetric 4-bit values are 0..15 with a zero point
    out = shape[::-1] if transposed else shape
    common = {"encoding": "affine", "shape": tuple(shape), "transposed": transposed, "bits": bits, "signed": signed,
              "zero_point": not symmetric}
    if group == 0:                                # one scale for the tensor
        return QDQLayout(**common, data_shape=out, scale_shape=(), axis=0, block_size=0)
    if group == cols:                             # one scale per row (output channel)
        return QDQLayout(**common, data_shape=out, scale_shape=(rows,), axis=1 if transposed else 0, block_size=0)
    if cols % group:
        raise _refuse(scheme, f"{cols} columns are not a whole number of groups of {group}")
    data = (cols, rows) if transposed else (rows, cols)
    scale = (cols // group, rows) if transposed else (rows, cols // group)
    return QDQLayout(**common, data_shape=data, scale_shape=scale, axis=0 if transposed else 1, block_size=group)


def _gguf_layout(scheme: str, shape: tuple[int, ...], ggml_type: str, *, transposed: bool) -> QDQLayout:
    if ggml_type not in _GGUF:
        raise _refuse(scheme, f"GGUF {ggml_type or '?'} blocks are d * q + m (or another form) that no "
                              "DequantizeLinear computes exactly; write gguf or safetensors, or quantize with "
                              "q8_0, q4_0, q5_0, int8 or int4 for ONNX")
    bits, signed, zero, _ = _GGUF[ggml_type]
    if len(shape) != 2 or shape[1] % GGUF_BLOCK:
        raise _refuse(scheme, f"{ggml_type} needs a 2-D weight of whole {GGUF_BLOCK}-weight rows, not {list(shape)}")
    rows, blocks = shape[0], shape[1] // GGUF_BLOCK
    return QDQLayout(encoding=ggml_type.lower(), shape=tuple(shape), transposed=transposed, bits=bits, signed=signed,
                     data_shape=shape[::-1] if transposed else tuple(shape),
                     scale_shape=(blocks, rows) if transposed else (rows, blocks), axis=0 if transposed else 1,
                     block_size=GGUF_BLOCK, zero_point=zero is not None, constant_zero=zero)


def layout_of(entry: QuantizedTensor, *, transposed: bool) -> QDQLayout:
    return layout(entry.scheme, entry.layout, tuple(entry.shape), entry.params, transposed=transposed)


# ---------------------------------------------------------------- 4-bit packing


def pack4(values: torch.Tensor) -> torch.Tensor:
    """Flat 4-bit values (int8 or uint8) -> bytes, two per byte, the first in the low nibble (ONNX, modelkit)."""
    flat = values.reshape(-1).to(torch.int16) & 0x0F                           # two's complement nibbles
    if flat.numel() % 2:
        flat = torch.cat((flat, flat.new_zeros(1)))                            # ONNX pads the last byte with 0
    pairs = flat.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def unpack4(packed: torch.Tensor, count: int, *, signed: bool) -> torch.Tensor:
    """Bytes -> `count` 4-bit values, low nibble first: int8 (-8..7) if signed, else uint8 (0..15)."""
    values = torch.stack((packed.reshape(-1) & 0x0F, packed.reshape(-1) >> 4), dim=-1).reshape(-1)[:count]
    if not signed:
        return values
    values = values.to(torch.int8)
    return torch.where(values >= 8, values - 16, values)


# ---------------------------------------------------------------- encoding


def _matrix(t: torch.Tensor, qdq: QDQLayout, rows: int) -> torch.Tensor:
    """(rows, n) matrix -> the stored orientation (transposed when the graph consumes it so)."""
    t = t.reshape(rows, -1)
    return t.t().contiguous() if qdq.transposed else t


def _unmatrix(t: torch.Tensor, qdq: QDQLayout, rows: int) -> torch.Tensor:
    """The stored orientation -> (rows, n) matrix."""
    return (t.t() if qdq.transposed else t).reshape(rows, -1).contiguous()


def encode(entry: QuantizedTensor, qdq: QDQLayout) -> dict[str, torch.Tensor]:
    """DequantizeLinear's inputs: "data" (int8 / uint8 values, 4-bit ones unpacked), "scale" (float32),
    and "zero_point" where the layout has one, in `qdq`'s shapes."""
    if qdq.encoding != "affine":
        return _encode_gguf(entry.parts["qdata"].load(), qdq)
    rows, cols = qdq.rows, qdq.cols
    data = entry.parts["qdata"].load()
    values = unpack4(data, rows * cols, signed=qdq.signed) if qdq.bits == 4 else data
    out = {"data": _matrix(values, qdq, rows).reshape(qdq.data_shape),
           "scale": _matrix(entry.parts["scale"].load().float(), qdq, 1 if qdq.scale_shape == () else rows)}
    if "zero_point" in entry.parts:
        zero = entry.parts["zero_point"].load()
        out["zero_point"] = _matrix(zero, qdq, 1 if qdq.scale_shape == () else rows)
    for key in ("scale", "zero_point"):
        if key in out:
            out[key] = out[key].reshape(qdq.scale_shape)
    return out


def _encode_gguf(blocks: torch.Tensor, qdq: QDQLayout) -> dict[str, torch.Tensor]:
    rows = qdq.rows
    b = blocks.reshape(-1, _GGUF[qdq.encoding.upper()][3])                     # (rows * nb, block bytes)
    d = b[:, :2].contiguous().view(torch.float16).float()                      # block: d f16 | ...
    if qdq.encoding == "q8_0":                                                 # d | qs 32 x int8
        values = b[:, 2:].contiguous().view(torch.int8)
    elif qdq.encoding == "q4_0":                                               # d | qs: low nibbles w[0:16], high w[16:32]
        values = torch.cat((b[:, 2:] & 0x0F, b[:, 2:] >> 4), dim=-1)
    else:                                                                      # q5_0: d | qh u32 (bit i: bit 4 of q[i]) | qs
        high = b[:, 2:6].contiguous().view(torch.int32)                        # little-endian u32
        bits = ((high >> torch.arange(GGUF_BLOCK, dtype=torch.int32)) & 1).to(torch.uint8) << 4
        values = torch.cat((b[:, 6:] & 0x0F, b[:, 6:] >> 4), dim=-1) | bits
    out = {"data": _matrix(values, qdq, rows), "scale": _matrix(d, qdq, rows)}
    if qdq.constant_zero is not None:
        out["zero_point"] = torch.full(qdq.scale_shape, qdq.constant_zero, dtype=torch.uint8)
    return out


# ---------------------------------------------------------------- decoding


def part_specs(qdq: QDQLayout, scale_dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """dtype and shape of each part of the QuantizedTensor `qdq` describes (what modelkit's quantizers make)."""
    rows, cols = qdq.rows, qdq.cols
    if qdq.encoding != "affine":
        return {"qdata": (torch.uint8, (rows, cols // GGUF_BLOCK * _GGUF[qdq.encoding.upper()][3]))}
    specs = {"qdata": (torch.uint8, (rows, cols // 2)) if qdq.bits == 4 else (torch.int8, (rows, cols))}
    groups = (1, 1) if qdq.scale_shape == () else (rows, math.prod(qdq.scale_shape) // rows)
    specs["scale"] = (scale_dtype, groups)
    if qdq.zero_point:
        specs["zero_point"] = (torch.uint8 if qdq.bits == 4 else torch.int8, groups)
    return specs


def decode_part(part: str, qdq: QDQLayout, scale_dtype: torch.dtype,
                load: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Part `part` of the QuantizedTensor from DequantizeLinear's inputs; `load("data")` and so on read them.

    Raises:
        ValueError: the inputs hold values the layout cannot have (a GGUF zero point that is not its constant).
    """
    rows = qdq.rows
    if qdq.encoding != "affine":
        return _decode_gguf(qdq, load)
    dtype, shape = part_specs(qdq, scale_dtype)[part]
    if part == "qdata":
        values = _unmatrix(load("data"), qdq, rows)
        return pack4(values).reshape(shape) if qdq.bits == 4 else values.to(dtype).reshape(shape)
    n = 1 if qdq.scale_shape == () else rows
    return _unmatrix(load(part).reshape(qdq.scale_shape or (1,)), qdq, n).to(dtype).reshape(shape)


def _decode_gguf(qdq: QDQLayout, load: Callable[[str], torch.Tensor]) -> torch.Tensor:
    rows = qdq.rows
    if qdq.constant_zero is not None and not bool((load("zero_point") == qdq.constant_zero).all()):
        raise ValueError(f"{qdq.encoding} zero points must all be {qdq.constant_zero}")
    values = _unmatrix(load("data"), qdq, rows).reshape(-1, GGUF_BLOCK)         # (rows * nb, 32)
    d = _unmatrix(load("scale"), qdq, rows).reshape(-1).to(torch.float16).view(torch.uint8).reshape(-1, 2)
    if qdq.encoding == "q8_0":
        payload = values.to(torch.int8).view(torch.uint8)
    else:
        q = values.to(torch.uint8)
        payload = (q[:, :GGUF_BLOCK // 2] & 0x0F) | ((q[:, GGUF_BLOCK // 2:] & 0x0F) << 4)
        if qdq.encoding == "q5_0":
            weights = torch.tensor([1 << i for i in range(GGUF_BLOCK)], dtype=torch.int64)
            word = (((q >> 4) & 1).to(torch.int64) * weights).sum(-1, keepdim=True)    # distinct bits: sum = OR
            payload = torch.cat((word.view(torch.uint8)[:, :4], payload), dim=-1)      # low 4 bytes: the u32 qh
    return torch.cat((d, payload), dim=-1).reshape(rows, -1)
