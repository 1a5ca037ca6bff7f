"""compressed-tensors' "pack-quantized" and "int-quantized" layouts of affine weights, and the
`quantization_config` that describes them.

compressed-tensors (https://github.com/vllm-project/compressed-tensors) is what transformers
(`quant_method: compressed-tensors`), vLLM and llm-compressor read. For a weight `N` quantized to
b bits (4 or 8), with rows = shape[0] and cols = the product of the other dimensions:

    N_packed      I32 (rows, ceil(cols * b / 32)): each value v in [-2^(b-1), 2^(b-1)) stored as
                  v + 2^(b-1) in b bits, element i of a row at bit i * b of the row (so 32 / b
                  values per little-endian int32, the first in the lowest bits); zero bits pad a row
    N_scale       the scales as stored by modelkit (F16 for int4 and gptq, F32 for int8):
                  (rows, groups) for "group" and "channel" (groups = 1), (1,) for "tensor"
    N_zero_point  asymmetric only. "group"/"channel": I32 (ceil(rows * b / 32), groups), the
                  signed zero points packed as above but along the rows (each column of the
                  (rows, groups) matrix is one packed run); "tensor": I8 (1,), not packed
    N_shape       I64 (2,): [rows, cols]

modelkit's affine levels map onto this without any rounding: symmetric values are already
signed; asymmetric int4 values 0..15 with zero points 0..15 are the signed levels plus 8 (the
shift cancels in (q - zero_point) * scale), and asymmetric int8 uses the signed range already.
So the stored bits are a byte-wise transform of modelkit's own packing (`encode_parts`), and
reading undoes it exactly (`decode_parts`): the same QuantizedTensor comes back.

"int-quantized" (schemes that also quantize activations, INPUT_ACTIVATIONS: int8-dynamic) keeps
the int8 values unpacked under the weight's own name `N`, with `N_scale` and no `N_shape`.

Everything here is numpy: storage never imports torch.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from modelkit.errors import FormatError, UnsupportedConversionError
from modelkit.storage.dtypes import DTYPES
from modelkit.storage.tensors import LazyTensor, QuantizedTensor

if TYPE_CHECKING:
    from modelkit.checkpoint import Checkpoint  # storage sits below checkpoint: annotations only

FORMAT = "pack-quantized"            # compressed-tensors' CompressionFormat for packed int weights
INT_FORMAT = "int-quantized"         # int8 weights under the weight's own name: W8A8 schemes (vLLM's only form for them)
FORMATS = (FORMAT, INT_FORMAT)
STATUS = "compressed"                # the quantization_status of a file whose weights are packed

# Schemes whose layers also quantize their inputs at run time -> compressed-tensors' input_activations.
# int8-dynamic: one scale per input row (token), max|x| / 127, symmetric int8 (quantizers/int8_dynamic.py).
INPUT_ACTIVATIONS: dict[str, dict[str, Any]] = {
    "int8-dynamic": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
}


def matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the affine layout's matrix view of a weight of `shape`."""
    rows = shape[0] if shape else 1
    return rows, (math.prod(shape[1:]) if len(shape) > 1 else 1)


def per_tensor(params: Mapping[str, Any]) -> bool:
    return int(params.get("group_size", 0) or 0) == 0


def strategy(params: Mapping[str, Any], cols: int) -> str:
    """compressed-tensors' strategy of an affine tensor: "tensor", "channel" or "group"."""
    group = int(params.get("group_size", 0) or 0)
    return "tensor" if group == 0 else "channel" if group >= cols else "group"


def stored_format(entry: QuantizedTensor) -> str:
    """The compressed-tensors format an affine tensor is stored in: int-quantized for W8A8 schemes."""
    return INT_FORMAT if entry.scheme in INPUT_ACTIVATIONS else FORMAT


def describable(entry: QuantizedTensor) -> str | None:
    """None if compressed-tensors can describe `entry`, else why not."""
    if entry.layout != "affine":
        return f"layout {entry.layout!r} (ggml blocks) has no compressed-tensors equivalent"
    if int(entry.params.get("bits", 8)) not in (4, 8):
        return f"{entry.params.get('bits')}-bit affine values have no packing here (4 or 8)"
    if stored_format(entry) == INT_FORMAT and int(entry.params.get("bits", 8)) != 8:
        return f"scheme {entry.scheme!r} quantizes activations, which compressed-tensors stores with int8 weights only"
    return None


# --------------------------------------------------------------------------- bit packing (numpy)

def _offset(bits: int) -> int:
    return 0x88 if bits == 4 else 0x80      # + 2^(b-1) on each value of a byte: flip each value's top bit


def _to_words(data: np.ndarray) -> np.ndarray:
    """(r, n) uint8 -> (r, ceil(n / 4)) int32, little-endian, zero bytes appended."""
    rows, n = data.shape
    padded = np.zeros((rows, -(-n // 4) * 4), np.uint8)
    padded[:, :n] = data
    return padded.view("<i4").astype(np.int32, copy=False)


def words_to_bytes(words: np.ndarray, n: int) -> np.ndarray:
    """(r, w) int32 -> the first n bytes of each row, uint8."""
    return np.ascontiguousarray(words.astype("<i4", copy=False)).view(np.uint8)[:, :n].copy()


def _nibble_bytes(values: np.ndarray) -> np.ndarray:
    """(r, c) values 0..15 -> (r, ceil(c / 2)) uint8, the first value in the low nibble."""
    rows, cols = values.shape
    padded = np.zeros((rows, cols + cols % 2), np.uint8)
    padded[:, :cols] = values
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8)


def nibble_values(data: np.ndarray, cols: int) -> np.ndarray:
    """Inverse of _nibble_bytes: (r, bytes) uint8 -> (r, cols) values 0..15."""
    out = np.stack((data & 0x0F, data >> 4), axis=-1).reshape(data.shape[0], -1)
    return np.ascontiguousarray(out[:, :cols]).astype(np.uint8)


def _lazy(fn: Any, dtype: str, shape: tuple[int, ...], source: str) -> LazyTensor:
    return LazyTensor(DTYPES[dtype], shape, fn, source)


def encode_parts(name: str, entry: QuantizedTensor) -> dict[str, LazyTensor]:
    """The stored parts of an affine QuantizedTensor in compressed-tensors' layout (read on demand).

    pack-quantized: qdata, scale, zero_point (asymmetric), shape. int-quantized (`stored_format`):
    qdata (int8 (rows, cols), stored under the weight's own name), scale, zero_point (unpacked).
    """
    bits = int(entry.params["bits"])
    symmetric = bool(entry.params.get("symmetric", True))
    rows, cols = matrix(entry.shape)
    words = -(-cols * bits // 32)
    qdata, scale = entry.parts["qdata"], entry.parts["scale"]

    def packed() -> np.ndarray:
        raw = qdata.array()
        data = raw.view(np.uint8) if bits == 8 else raw
        if bits == 4 and symmetric or bits == 8:
            data = data ^ np.uint8(_offset(bits))
        return _to_words(data.reshape(rows, -1))

    if stored_format(entry) == INT_FORMAT:
        parts = {"qdata": _lazy(lambda: qdata.array().reshape(rows, cols), "int8", (rows, cols), name)}
    else:
        parts = {"qdata": _lazy(packed, "int32", (rows, words), name)}
    if per_tensor(entry.params):
        parts["scale"] = _lazy(lambda: scale.array().reshape(1), scale.dtype.name, (1,), name)
    else:
        parts["scale"] = scale
    if "zero_point" in entry.parts:
        zero = entry.parts["zero_point"]
        if per_tensor(entry.params):       # signed, not packed
            def single() -> np.ndarray:
                z = zero.array().astype(np.int16).reshape(1)
                return (z - 8 if bits == 4 else z).astype(np.int8)
            parts["zero_point"] = _lazy(single, "int8", (1,), name)
        elif stored_format(entry) == INT_FORMAT:                             # int8 zero points, not packed
            parts["zero_point"] = zero
        else:
            groups = zero.shape[-1]

            def zeros() -> np.ndarray:
                z = zero.array().reshape(rows, groups).T                     # packed along the rows
                data = _nibble_bytes(z) if bits == 4 else z.view(np.uint8) ^ np.uint8(0x80)
                return np.ascontiguousarray(_to_words(data).T)
            parts["zero_point"] = _lazy(zeros, "int32", (-(-rows * bits // 32), groups), name)
    if stored_format(entry) == FORMAT:
        shape = np.array([rows, cols], np.int64)
        parts["shape"] = _lazy(lambda: shape, "int64", (2,), name)
    return parts


def decode_parts(path: Any, name: str, info: Mapping[str, Any], stored: Mapping[str, LazyTensor]) -> dict[str, LazyTensor]:
    """modelkit's affine parts from compressed-tensors' stored ones; FormatError if they do not fit the record."""
    params = info["params"]
    bits = int(params.get("bits", 0)) if isinstance(params.get("bits"), int) else 0
    symmetric = bool(params.get("symmetric", True))
    rows, cols = matrix(tuple(info["shape"]))

    packed = info["format"] == FORMAT

    def bad(why: str) -> FormatError:
        return FormatError(path, f"quantized tensor {name!r} ({info['format']}): {why}")

    if info["layout"] != "affine" or bits not in ((4, 8) if packed else (8,)):
        raise bad(f"only affine {'4- or 8' if packed else '8'}-bit tensors are stored this way, "
                  f"not {info['layout']} with bits {bits}")
    expected = {"qdata", "scale"} | ({"shape"} if packed else set()) | (set() if symmetric else {"zero_point"})
    if set(stored) != expected:
        raise bad(f"parts {sorted(stored)} should be {sorted(expected)}")
    qdata, scale, zero = stored["qdata"], stored["scale"], stored.get("zero_point")
    want = ("int32", (rows, -(-cols * bits // 32))) if packed else ("int8", (rows, cols))
    if (qdata.dtype.name, qdata.shape) != want:
        raise bad(f"values are {qdata.dtype} {list(qdata.shape)}; expected {want[0]} {list(want[1])}")
    if bits == 4 and cols % 2:
        raise bad(f"{cols} columns cannot be 4-bit values two per byte")
    tensor = per_tensor(params)
    if scale.dtype.name not in ("float16", "bfloat16", "float32") or len(scale.shape) != (1 if tensor else 2) \
            or (tensor and scale.shape != (1,)) or (not tensor and scale.shape[0] != rows):
        raise bad(f"scale is {scale.dtype} {list(scale.shape)}; expected a float (1,) or ({rows}, groups) tensor")
    groups = 1 if tensor else scale.shape[1]
    out: dict[str, LazyTensor] = {
        "scale": _lazy(lambda: scale.array().reshape(1, 1), scale.dtype.name, (1, 1), name) if tensor else scale}
    if not packed:
        out["qdata"] = qdata
        if zero is not None:
            if zero.dtype.name != "int8" or zero.shape != scale.shape:
                raise bad(f"zero point is {zero.dtype} {list(zero.shape)}; expected int8 {list(scale.shape)}")
            out["zero_point"] = _lazy(lambda: zero.array().reshape(1, 1), "int8", (1, 1), name) if tensor else zero
        return out
    shape_part = stored["shape"]
    if shape_part.dtype.name not in ("int64", "int32") or shape_part.shape != (2,):
        raise bad(f"shape is {shape_part.dtype} {list(shape_part.shape)}; expected 2 integers")
    row_bytes = cols * bits // 8

    def values() -> Any:
        if [int(v) for v in shape_part.array()] != [rows, cols]:
            raise bad(f"shape {shape_part.array().tolist()} does not match the record's {[rows, cols]}")
        data = words_to_bytes(qdata.array(), row_bytes)
        if bits == 4 and symmetric or bits == 8:
            data = data ^ np.uint8(_offset(bits))
        return data.view(np.int8) if bits == 8 else data

    out["qdata"] = _lazy(values, "int8" if bits == 8 else "uint8", (rows, row_bytes), name)
    if zero is not None:
        zero_dtype = "uint8" if bits == 4 else "int8"
        if tensor:
            if zero.dtype.name != "int8" or zero.shape != (1,):
                raise bad(f"zero point is {zero.dtype} {list(zero.shape)}; expected int8 (1,)")

            def single() -> np.ndarray:
                z = zero.array().astype(np.int16).reshape(1, 1)
                return (z + 8 if bits == 4 else z).astype(DTYPES[zero_dtype].numpy)
            out["zero_point"] = _lazy(single, zero_dtype, (1, 1), name)
        else:
            if zero.dtype.name != "int32" or zero.shape != (-(-rows * bits // 32), groups):
                raise bad(f"zero point is {zero.dtype} {list(zero.shape)}; expected int32 "
                          f"{[-(-rows * bits // 32), groups]}")

            def zeros() -> np.ndarray:
                data = words_to_bytes(np.ascontiguousarray(zero.array().T), -(-rows * bits // 8))
                z = nibble_values(data, rows) if bits == 4 else (data ^ np.uint8(0x80)).view(np.int8)
                return np.ascontiguousarray(z.T)
            out["zero_point"] = _lazy(zeros, zero_dtype, (rows, groups), name)
    return out


# --------------------------------------------------------------------------- quantization_config

def _module(name: str) -> str:
    return name.removesuffix(".weight")


def config_of(shapes: Mapping[str, tuple[int, ...]], quantized: Mapping[str, QuantizedTensor],
              *, target: str = "compressed-tensors") -> dict[str, Any]:
    """config.json's `quantization_config` for affine tensors `quantized` among `shapes` (all tensors' shapes).

    One config group per kind (bits, symmetry, strategy, group size, activations), targeting its
    modules by exact name; `ignore` lists every other 2-D `*.weight` module (float), so readers
    that require each Linear to be targeted or ignored (vLLM) know what stays float.
    """
    groups: dict[str, dict[str, Any]] = {}
    for name, entry in quantized.items():
        params = entry.params
        if not name.endswith(".weight"):
            raise UnsupportedConversionError("quantized checkpoint", target,
                                             f"{name!r} is not a module's weight, which is all compressed-tensors quantizes")
        cols = matrix(shapes[name])[1]
        kind = strategy(params, cols)
        weights = {"num_bits": int(params["bits"]), "type": "int", "symmetric": bool(params.get("symmetric", True)),
                   "strategy": kind, "group_size": int(params["group_size"]) if kind == "group" else None,
                   "dynamic": False}
        scheme = {"weights": weights, "input_activations": INPUT_ACTIVATIONS.get(entry.scheme),
                  "output_activations": None, "format": stored_format(entry)}
        groups.setdefault(json.dumps(scheme, sort_keys=True), {"targets": [], **scheme})["targets"].append(_module(name))
    ignore = sorted(_module(n) for n, s in shapes.items() if n not in quantized and n.endswith(".weight") and len(s) == 2)
    formats = {g["format"] for g in groups.values()}
    return {"quant_method": "compressed-tensors", "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": STATUS,
            "config_groups": {f"group_{i}": g for i, g in enumerate(groups.values())},
            "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None}


def compressed_tensors_config(ckpt: Checkpoint) -> dict[str, Any] | None:
    """config.json's `quantization_config` for a checkpoint's quantized weights; None when it has none.

    The weights must be modelkit's affine 4- or 8-bit tensors (int4, int8, gptq; per group, per
    channel or per tensor, symmetric or not): their files are written in the matching
    "pack-quantized" layout (`encode_parts`).

    Raises:
        UnsupportedConversionError: a quantized tensor compressed-tensors cannot describe (GGUF blocks).
    """
    quantized = {n: t for n, t in ckpt.tensors.items() if isinstance(t, QuantizedTensor)}
    if not quantized:
        return None
    for name, entry in quantized.items():
        why = describable(entry)
        if why is not None:
            raise UnsupportedConversionError("quantized checkpoint", "compressed-tensors", f"tensor {name!r}: {why}")
    return config_of({n: tuple(t.shape) for n, t in ckpt.tensors.items()}, quantized)
