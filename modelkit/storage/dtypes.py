"""Tensor element types without torch: names, sizes, safetensors codes and the numpy view of the bits.

A `DType` is what a LazyTensor's header says its elements are. Weight containers are read and
written through numpy arrays of `DType.numpy` (the stored bits: bfloat16 and float8 have no numpy
type, so their arrays are uint16 / uint8 of the raw bits, never widened); torch's dtype is reached
through `DType.torch` only by code that has torch already.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class DType:
    """One element type.

    Args:
        name: torch's name ("float32", "bfloat16"); what reports and JSON print.
        code: The safetensors code ("F32", "BF16"); None where safetensors has none.
        numpy: The numpy type that holds the stored bits ("<f4"; "<u2" for bfloat16).
        is_floating_point: As torch.dtype.is_floating_point.
        exact: numpy's values are the values (False where the array holds raw bits: bfloat16, float8).
    """

    __slots__ = ("name", "code", "numpy", "itemsize", "is_floating_point", "exact")

    def __init__(self, name: str, code: str | None, numpy: str, *, floating: bool = False, exact: bool = True) -> None:
        self.name, self.code, self.numpy = name, code, np.dtype(numpy)
        self.itemsize = self.numpy.itemsize
        self.is_floating_point, self.exact = floating, exact

    @property
    def torch(self) -> Any:
        """The torch.dtype (imports torch: only for callers that already work with torch)."""
        import torch

        return getattr(torch, self.name)

    def __eq__(self, other: object) -> bool:
        # Equal to torch's dtype of the same name, so callers' `entry.dtype == torch.float16` keeps working.
        if isinstance(other, DType):
            return self is other
        if type(other).__name__ == "dtype" and type(other).__module__ == "torch":
            return str(other) == f"torch.{self.name}"
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"modelkit.{self.name}"

    def __str__(self) -> str:
        return self.name

    def __reduce__(self) -> tuple[Any, ...]:       # pickled (multiprocessing) as the shared instance
        return (as_dtype, (self.name,))


_ALL = (
    DType("bool", "BOOL", "?"),
    DType("uint8", "U8", "u1"), DType("int8", "I8", "i1"),
    DType("uint16", "U16", "<u2"), DType("int16", "I16", "<i2"),
    DType("uint32", "U32", "<u4"), DType("int32", "I32", "<i4"),
    DType("uint64", "U64", "<u8"), DType("int64", "I64", "<i8"),
    DType("float16", "F16", "<f2", floating=True), DType("bfloat16", "BF16", "<u2", floating=True, exact=False),
    DType("float32", "F32", "<f4", floating=True), DType("float64", "F64", "<f8", floating=True),
    DType("float8_e4m3fn", "F8_E4M3", "u1", floating=True, exact=False),
    DType("float8_e5m2", "F8_E5M2", "u1", floating=True, exact=False),
    # Types numpy and safetensors lack, kept as their raw bits (HDF5, GGUF as raw bytes, npz, torch's files).
    DType("float8_e4m3fnuz", None, "u1", floating=True, exact=False),
    DType("float8_e5m2fnuz", None, "u1", floating=True, exact=False),
    DType("float8_e8m0fnu", None, "u1", floating=True, exact=False),
    DType("float4_e2m1fn_x2", None, "u1", exact=False),            # two 4-bit values per byte
    DType("complex32", None, "<u4", exact=False),
    DType("complex64", None, "<c8"), DType("complex128", None, "<c16"),
)
DTYPES: dict[str, DType] = {d.name: d for d in _ALL}

# safetensors dtype codes (https://github.com/huggingface/safetensors#format) -> DType.
SAFETENSORS_DTYPES: dict[str, DType] = {d.code: d for d in _ALL if d.code is not None}

# torch's legacy typed storage classes (still named in TorchScript archives and old checkpoints) -> DType.
LEGACY_STORAGE_DTYPES: dict[str, DType] = {
    "DoubleStorage": DTYPES["float64"], "FloatStorage": DTYPES["float32"], "HalfStorage": DTYPES["float16"],
    "BFloat16Storage": DTYPES["bfloat16"], "LongStorage": DTYPES["int64"], "IntStorage": DTYPES["int32"],
    "ShortStorage": DTYPES["int16"], "CharStorage": DTYPES["int8"], "ByteStorage": DTYPES["uint8"],
    "BoolStorage": DTYPES["bool"], "ComplexFloatStorage": DTYPES["complex64"],
    "ComplexDoubleStorage": DTYPES["complex128"],
}

# Short names users type (`--dtype bf16`) -> DType.
DTYPE_NAMES: dict[str, DType] = {"f32": DTYPES["float32"], "f16": DTYPES["float16"], "bf16": DTYPES["bfloat16"]}

_BY_NUMPY = {d.numpy: d for d in reversed(_ALL) if d.exact}     # the exact type of each numpy dtype


def as_dtype(value: Any) -> DType:
    """A DType from a DType, a torch.dtype, a name ("float32", "F32", "f32") or a numpy dtype."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        found = DTYPES.get(value) or SAFETENSORS_DTYPES.get(value) or DTYPE_NAMES.get(value)
        if found is None:
            raise ValueError(f"unknown dtype {value!r}")
        return found
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        name = str(value).removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(f"torch's {name} has no modelkit dtype; known: {', '.join(DTYPES)}")
        return DTYPES[name]
    found = _BY_NUMPY.get(np.dtype(value))
    if found is None:
        raise ValueError(f"numpy dtype {value!r} has no modelkit dtype")
    return found


def dtype_name(dtype: Any) -> str:
    """'float32' for float32 (a DType or a torch.dtype): the name used in reports and JSON."""
    return str(dtype).removeprefix("torch.")


def tensor_bytes(tensor: Any) -> memoryview:
    """The bytes of a numpy array or a torch tensor, in memory order (little-endian here).

    A torch tensor is viewed as uint8 first, which works for dtypes numpy lacks (bfloat16, float8).
    """
    if isinstance(tensor, np.ndarray):
        flat = np.ascontiguousarray(tensor).reshape(-1)
        return memoryview(flat.view(np.uint8)) if flat.size else memoryview(b"")
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def to_torch(array: np.ndarray, dtype: DType) -> Any:
    """A torch tensor sharing `array`'s memory, of `dtype` (raw bits reinterpreted where numpy lacks it)."""
    import torch

    if array.dtype == np.bool_:
        return torch.from_numpy(array)
    tensor = torch.from_numpy(array)
    return tensor if dtype.exact else tensor.view(dtype.torch)


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy array of a torch tensor's stored bits (uint16 for bfloat16), sharing memory where it can."""
    dtype = as_dtype(tensor.dtype)
    tensor = tensor.detach()
    if dtype.exact:
        return tensor.numpy()
    import torch

    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]     # same width: 0-d tensors view too
    return tensor.view(raw).numpy().view(dtype.numpy)


def contiguous(array: np.ndarray) -> np.ndarray:
    """`array` in C order, with its shape (np.ascontiguousarray makes a 0-d array 1-d)."""
    return array if array.flags.c_contiguous else np.ascontiguousarray(array).reshape(array.shape)


def widen_to_float32(array: np.ndarray, dtype: DType) -> np.ndarray:
    """float16 or bfloat16 bits -> float32 values (exact)."""
    if dtype.name == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def _e4m3fn_table() -> np.ndarray:
    """float8_e4m3fn's 256 values as float32 (1 sign, 4 exponent bits biased by 7, 3 mantissa bits, no inf;
    0x7F / 0xFF are NaN)."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    normal = (1 + mantissa / 8.0) * np.exp2(exponent.astype(np.float64) - 7)
    subnormal = mantissa / 8.0 * 2.0 ** -6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


_E4M3FN = _e4m3fn_table()


def float8_e4m3fn_to_float32(codes: np.ndarray) -> np.ndarray:
    """float8_e4m3fn stored bits (uint8) -> their float32 values (exact)."""
    return _E4M3FN[codes]


def narrow_float32(array: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 values that are float16 / bfloat16 values -> that dtype's stored bits (exact for such values)."""
    if dtype.name == "bfloat16":
        return (contiguous(array).view(np.uint32) >> 16).astype(np.uint16)
    return array.astype(dtype.numpy)


def cast_float(array: np.ndarray, source: DType, target: DType) -> np.ndarray:
    """Floating-point stored bits of `source` -> stored bits of `target`: the bits torch's `.to()` gives.

    Values round to nearest even as torch does (float64 goes through float32 first, as torch's
    kernels do, which rounds twice on the way to float16 and bfloat16); overflow gives infinity.
    A NaN stays a NaN, with the bits of torch 2.13's vectorized path (torch's own NaN bits vary with
    where an element falls in its vector loop). Checked against torch for every pair of float32,
    float16, bfloat16 and float64, as arrays and 0-d, in tests/test_torch_free.py.
    """
    if source is target:
        return array
    if not (source.exact or source.name == "bfloat16") or not (target.exact or target.name == "bfloat16"):
        raise ValueError(f"no numpy cast from {source} to {target}")
    scalar = array.ndim == 0
    with np.errstate(over="ignore", invalid="ignore"):
        if source.name in ("bfloat16", "float16"):
            values = widen_to_float32(array, source)
        elif source.name == "float64" and target.name != "float32":
            values = array.astype(np.float32)
        else:
            values = array
        if target.name != "bfloat16":
            out = values.astype(target.numpy)
            if scalar and source.name == "float16" and target.name == "float32" and np.isnan(out):
                out = np.array(0x7FFFFFFF, dtype=np.uint32).view(np.float32)     # torch's scalar path
            return out
        bits = contiguous(values.astype(np.float32, copy=False)).view(np.uint32)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounded = bits + (0x7FFF + ((bits >> 16) & 1))            # round to nearest, ties to even
        out = (rounded >> 16).astype(np.uint16)
    # NaN, whatever its sign: 0xFFFF from float32/float64 arrays (torch's vectorized path), 0x7FC0 from
    # float16 and from 0-d tensors (its scalar path)
    return np.where(nan, np.uint16(0x7FC0 if source.name == "float16" or scalar else 0xFFFF), out)
