"""The tensor types of a Checkpoint: LazyTensor (known by its header, read on demand) and
QuantizedTensor (packed parts + scheme, stored natively), with the dequantizer table.

This layer never imports torch at import time: a reader may hand back a numpy array (the weight
containers: safetensors, GGUF, HDF5, torch's own serialization read by modelkit) or a torch tensor
(formats read through torch); `array()` gives numpy either way, `load()` gives torch.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from modelkit.errors import FormatError
from modelkit.storage.dtypes import DType, as_dtype, to_numpy, to_torch
from modelkit.storage.mapped import FileSpan


def _nbytes(dtype: DType, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A tensor known by its header; `load()` (torch) or `array()` (numpy) reads the bytes, an mmap
    view where possible.

    `dtype` may be given as a torch.dtype or a name; it is kept as a modelkit DType. `reader` returns
    a numpy array of `dtype.numpy` (the stored bits) or a torch tensor of `dtype`.
    """

    dtype: DType
    shape: tuple[int, ...]
    reader: Callable[[], Any] = field(repr=False)
    source: str = ""                   # where it comes from, for error messages
    # Where load()'s exact bytes lie in a file, when they do (raw little-endian, contiguous, no
    # transformation): writers copy such spans file to file in the kernel (modelkit.storage.mapped.copy_span).
    span: FileSpan | None = field(default=None, repr=False)
    # For a tensor a reader makes from a file in another layout (a TF.js Dense kernel, stored transposed):
    # `equals(array)` compares its bits with an array of its dtype and shape in the file's own layout,
    # without making the tensor (modelkit.pipeline.verify); `chunks(nbytes)` gives its bytes in C order as
    # contiguous arrays of about `nbytes`, each valid until the one after next is asked for, so a writer
    # streams it instead of making it whole.
    equals: Callable[[np.ndarray], bool] | None = field(default=None, repr=False)
    chunks: Callable[[int], Iterator[np.ndarray]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @classmethod
    def of(cls, tensor: Any, *, source: str = "") -> LazyTensor:
        """Wrap a tensor (torch) or an array (numpy) that is already in memory."""
        if not isinstance(tensor, np.ndarray):
            tensor = tensor.detach()
        return cls(as_dtype(tensor.dtype), tuple(tensor.shape), lambda: tensor, source)

    @classmethod
    def of_array(cls, array: np.ndarray, dtype: DType | Any, *, source: str = "") -> LazyTensor:
        """Wrap an in-memory array of stored bits of `dtype` (uint16 bits for bfloat16)."""
        return cls(as_dtype(dtype), tuple(array.shape), lambda: array, source)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)

    def _read(self) -> Any:
        data = self.reader()
        if isinstance(data, np.ndarray):
            ok = data.dtype == self.dtype.numpy and tuple(data.shape) == self.shape
            seen = f"{data.dtype} {list(data.shape)}"
        else:
            ok = as_dtype(data.dtype) is self.dtype and tuple(data.shape) == self.shape
            seen = f"{str(data.dtype).removeprefix('torch.')} {list(data.shape)}"
        if not ok:
            raise FormatError(self.source or "<tensor>",
                              f"tensor data is {seen} but the header says {self.dtype} {list(self.shape)}")
        return data

    def array(self) -> np.ndarray:
        """The stored bits as a numpy array of `dtype.numpy` and `shape` (no torch needed)."""
        data = self._read()
        return data if isinstance(data, np.ndarray) else to_numpy(data)

    def load(self) -> Any:
        """The tensor as torch; raises FormatError if the data disagrees with the header."""
        data = self._read()
        return to_torch(data, self.dtype) if isinstance(data, np.ndarray) else data


@dataclass(frozen=True, eq=False)
class MadeTensor(LazyTensor):
    """A LazyTensor whose bytes are costly to make (quantized as the writer pulls them): the first read
    remembers their digest (CRC-32 and length), so the write path's check compares the written bytes with that digest
    instead of making them a second time (modelkit.pipeline.verify)."""

    made: dict[str, bytes] = field(default_factory=dict, repr=False, compare=False)

    def _read(self) -> Any:
        data = super()._read()
        if "digest" not in self.made:
            self.made["digest"] = digest(to_numpy(data) if not isinstance(data, np.ndarray) else data)
        return data

    def digest(self) -> bytes | None:
        """The digest of the bytes made so far (None before the first read)."""
        return self.made.get("digest")


def digest(array: np.ndarray) -> bytes:
    """CRC-32 and length of an array's bytes (C order): a check against writing the wrong bytes, not against
    an adversary (zlib's CRC runs at memory speed; a cryptographic hash would cost more than the write)."""
    import zlib

    data = memoryview(np.ascontiguousarray(array)).cast("B")
    return zlib.crc32(data).to_bytes(4, "little") + len(data).to_bytes(8, "little")


def _unpack_int4(packed: Any, signed: bool) -> Any:
    """(..., n/2) uint8, low nibble first -> (..., n) int8 values."""
    import torch

    values = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)   # (..., n/2, 2) -> (..., n), 0..15
    if signed:                  # two's complement nibbles, in one-byte arithmetic: 12x faster than via int16
        return (values ^ 8).view(torch.int8) - 8
    return values.view(torch.int8)


def _dequantize_affine(q: QuantizedTensor) -> Any:
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
    return out.reshape(q.shape).to(q.dtype.torch)


def decode_tfjs_codes(codes: np.ndarray, low: float, scale: float, *, integer: bool = False) -> np.ndarray:
    """TensorFlow.js's decoding of uint8/uint16 weights (tfjs-core io_utils.ts decodeWeight): `code * scale +
    min` in double precision, stored as float32, or for int32 weights rounded as JavaScript's Math.round
    (halves up). Bit for bit what TF.js loads."""
    values = codes.astype(np.float64) * scale + low
    return np.floor(values + 0.5).astype(np.int32) if integer else values.astype(np.float32)


def _dequantize_tfjs(q: QuantizedTensor) -> Any:
    """TF.js's uint8/uint16 weights (params min and scale, one pair per tensor), decoded as TF.js does."""
    values = decode_tfjs_codes(q.parts["qdata"].array(), float(q.params["min"]), float(q.params["scale"]),
                               integer=q.dtype.name == "int32")
    return to_torch(values.reshape(q.shape), q.dtype)


# Layout name -> dequantizer, for the layouts this layer computes itself.
DEQUANTIZERS: dict[str, Callable[[QuantizedTensor], Any]] = {"affine": _dequantize_affine, "tfjs": _dequantize_tfjs}

# Layouts whose dequantizer lives in a higher layer: layout -> "module:function", imported on
# first use and then kept in DEQUANTIZERS. This table is the only registration of each layout
# (no module registers itself on import), and a file only ever picks a key of it.
LAYOUT_MODULES: dict[str, str] = {"gguf": "modelkit.quantizers.gguf_blocks:dequantize_layout"}


def dequantizer(layout: str, *, source: str = "<tensor>") -> Callable[[QuantizedTensor], Any]:
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
        dtype: The dtype `load()` returns (a torch.dtype or name is kept as a DType).
        parts: Named stored tensors: "qdata", "scale", optionally "zero_point".
        params: Small layout facts: bits, group_size, symmetric, axis.
    """

    scheme: str
    layout: str
    shape: tuple[int, ...]
    dtype: DType
    parts: Mapping[str, LazyTensor]
    params: Mapping[str, int | float | str | bool] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

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

    def load(self) -> Any:
        """The dequantized tensor (torch)."""
        return dequantizer(self.layout, source=self.source or "<tensor>")(self)


TensorEntry = LazyTensor | QuantizedTensor
