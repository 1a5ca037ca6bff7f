"""The tensor types of a Checkpoint: LazyTensor (known by its header, read on demand) and
QuantizedTensor (packed parts + scheme, stored natively), with the dequantizer table."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from modelkit.errors import FormatError
from modelkit.storage.mapped import FileSpan


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A tensor known by its header; `load()` reads the bytes (an mmap view where possible)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    reader: Callable[[], torch.Tensor] = field(repr=False)
    source: str = ""                   # where it comes from, for error messages
    # Where load()'s exact bytes lie in a file, when they do (raw little-endian, contiguous, no
    # transformation): writers copy such spans file to file in the kernel (modelkit.storage.mapped.copy_span).
    span: FileSpan | None = field(default=None, repr=False)

    @classmethod
    def of(cls, tensor: torch.Tensor, *, source: str = "") -> LazyTensor:
        """Wrap a tensor that is already in memory."""
        tensor = tensor.detach()
        return cls(tensor.dtype, tuple(tensor.shape), lambda: tensor, source)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)

    def load(self) -> torch.Tensor:
        """Read the tensor; raises FormatError if the data disagrees with the header."""
        tensor = self.reader()
        if tensor.dtype != self.dtype or tuple(tensor.shape) != self.shape:
            raise FormatError(
                self.source or "<tensor>",
                f"tensor data is {tensor.dtype} {list(tensor.shape)} but the header says "
                f"{self.dtype} {list(self.shape)}",
            )
        return tensor


def _unpack_int4(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """(..., n/2) uint8, low nibble first -> (..., n) int8 values."""
    low = (packed & 0x0F).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    values = torch.stack((low, high), dim=-1).flatten(-2)                 # (..., n/2, 2) -> (..., n)
    if signed:
        values = torch.where(values >= 8, values - 16, values)
    return values.to(torch.int8)


def _dequantize_affine(q: QuantizedTensor) -> torch.Tensor:
    """value = (q - zero_point) * scale, one scale per row and group of `group_size` columns.

    Layout: the logical tensor viewed as (rows, cols) with rows = shape[0]; `qdata` holds int8
    values (bits 8) or two 4-bit values per uint8, low nibble first (bits 4); `scale` and the
    optional `zero_point` are (rows, cols / group_size), or (1, 1) for one scale per tensor.
    """
    bits = int(q.params.get("bits", 8))
    rows = q.shape[0] if q.shape else 1
    cols = math.prod(q.shape[1:]) if len(q.shape) > 1 else max(math.prod(q.shape) // max(rows, 1), 1)
    data = q.parts["qdata"].load()
    if bits == 4:
        values = _unpack_int4(data, signed=bool(q.params.get("symmetric", True))).reshape(rows, -1)[:, :cols]
    elif bits == 8:
        values = data.reshape(rows, cols)
    else:
        raise FormatError(q.source or "<tensor>", f"affine quantization with {bits} bits is not a known layout (4 or 8)")
    scale = q.parts["scale"].load().float()
    group = cols if scale.numel() == 1 else cols // scale.shape[-1]
    if group < 1 or (scale.numel() != 1 and scale.shape[-1] * group != cols):
        raise FormatError(q.source or "<tensor>", f"scale shape {list(scale.shape)} does not tile {cols} columns")
    values = values.float().reshape(rows, -1, group)                       # (rows, groups, group)
    if "zero_point" in q.parts:
        values = values - q.parts["zero_point"].load().float().reshape(rows if scale.numel() != 1 else 1, -1, 1)
    out = values * scale.reshape(rows if scale.numel() != 1 else 1, -1, 1)
    return out.reshape(q.shape).to(q.dtype)


# Layout name -> dequantizer, for the layouts this layer computes itself.
DEQUANTIZERS: dict[str, Callable[[QuantizedTensor], torch.Tensor]] = {"affine": _dequantize_affine}

# Layouts whose dequantizer lives in a higher layer: layout -> "module:function", imported on
# first use and then kept in DEQUANTIZERS. This table is the only registration of each layout
# (no module registers itself on import), and a file only ever picks a key of it.
LAYOUT_MODULES: dict[str, str] = {"gguf": "modelkit.quantizers.gguf_blocks:dequantize_layout"}


def dequantizer(layout: str, *, source: str = "<tensor>") -> Callable[[QuantizedTensor], torch.Tensor]:
    """The dequantizer of `layout`, importing it from LAYOUT_MODULES on first use."""
    if layout not in DEQUANTIZERS and layout in LAYOUT_MODULES:
        import importlib

        module, _, function = LAYOUT_MODULES[layout].partition(":")
        DEQUANTIZERS[layout] = getattr(importlib.import_module(module), function)
    found = DEQUANTIZERS.get(layout)
    if found is None:
        known = sorted(set(DEQUANTIZERS) | set(LAYOUT_MODULES))
        raise FormatError(source, f"unknown quantized layout {layout!r}; known: {', '.join(known)}")
    return found


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A quantized weight kept as its parts, so writers store it natively instead of in float.

    Args:
        scheme: The quantization scheme that produced it ("int8", "int4", "q4_0", ...).
        layout: How the parts combine: a key of DEQUANTIZERS ("affine": (q - zero_point) * scale).
        shape: The logical (dequantized) shape.
        dtype: The dtype `load()` returns.
        parts: Named stored tensors: "qdata", "scale", optionally "zero_point".
        params: Small layout facts: bits, group_size, symmetric, axis.
    """

    scheme: str
    layout: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: Mapping[str, LazyTensor]
    params: Mapping[str, int | float | str | bool] = field(default_factory=dict)
    source: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes stored: the packed data plus scales and zero points."""
        return sum(part.nbytes for part in self.parts.values())

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / max(self.numel, 1)

    def load(self) -> torch.Tensor:
        """The dequantized tensor."""
        return dequantizer(self.layout, source=self.source or "<tensor>")(self)


TensorEntry = LazyTensor | QuantizedTensor
