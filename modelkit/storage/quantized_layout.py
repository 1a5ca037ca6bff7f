"""Quantized tensors in weight containers: stored parts plus one JSON record that puts them back together.

A QuantizedTensor (modelkit/storage/tensors.py) is kept as its parts. Affine 4- and 8-bit weights
(int4, int8, gptq) are stored in compressed-tensors' "pack-quantized" layout
(modelkit/storage/compressed_tensors.py), so transformers and vLLM load the files; for a weight `N`:

    N               int8 values of a W8A8 scheme (int8-dynamic: compressed-tensors' "int-quantized")
    N_packed        int32, 32 / bits values each (compressed-tensors' packing); or GGUF block bytes (uint8)
    N_scale         scales (rows, groups), or (1,) for one per tensor
    N_zero_point    asymmetric only: packed along the rows (int32), or int8 (1,) for one per tensor
    N_shape         int64 [rows, cols] (pack-quantized only)

The metadata entry "modelkit.quantized" is the record reading uses:

    {N: {"scheme": "int4", "layout": "affine", "shape": [rows, cols], "dtype": "float32",
         "params": {"bits": 4, "group_size": 32, "symmetric": true}, "format": "pack-quantized",
         "parts": {"qdata": "N_packed", "scale": "N_scale", "shape": "N_shape"}}}

A record without "format" is the layout modelkit wrote before (4-bit values two per uint8, low
nibble first, in `N_packed`; 8-bit values as int8 under `N` itself; scales and zero points as
they are in memory): files in it are still read. safetensors and pth store exactly this
(docs/quantizers/safetensors.md, docs/formats/pth.md); ONNX keeps the same record with its own
`parts` (the DequantizeLinear inputs) and validates it with `parse_record` here. A record comes
from a file, so every field is checked before use: the layout must be a key of a fixed table in
code (a file never names code to import).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelkit.errors import FormatError, UnsupportedConversionError
from modelkit.metadata import QUANTIZED_KEY, json_object
from modelkit.storage import compressed_tensors
from modelkit.storage.dtypes import DTYPES
from modelkit.storage.tensors import LazyTensor, QuantizedTensor

if TYPE_CHECKING:
    from modelkit.checkpoint import Checkpoint  # storage sits below checkpoint: annotations only

RECORD_LIMIT = 20_000_000                   # bytes of the JSON entry; far above any real model's
LOGICAL_DTYPES = {name: DTYPES[name] for name in ("float32", "float16", "bfloat16")}
_PART_SUFFIXES = {"qdata": "_packed", "scale": "_scale", "zero_point": "_zero_point", "shape": "_shape"}


def describe(name: str, entry: QuantizedTensor, *, target: str) -> dict[str, Any]:
    """The record of one QuantizedTensor without its `parts` (each format names those its own way)."""
    if entry.dtype not in LOGICAL_DTYPES.values():
        raise UnsupportedConversionError("quantized checkpoint", target,
                                         f"tensor {name!r} dequantizes to {entry.dtype}; expected a float dtype")
    return {"scheme": entry.scheme, "layout": entry.layout, "shape": list(entry.shape),
            "dtype": entry.dtype.name, "params": dict(entry.params)}


def stored_part_name(name: str, part: str, format: str | None = None) -> str:
    """The name part `part` of weight `name` is stored under (compressed-tensors' names; int-quantized
    values keep the weight's own name)."""
    if part == "qdata" and format == compressed_tensors.INT_FORMAT:
        return name
    return name + _PART_SUFFIXES.get(part, f"_{part}")


def flatten(ckpt: Checkpoint, *, target: str) -> tuple[Checkpoint, dict[str, Any]]:
    """QuantizedTensors as their stored parts, the record in metadata[QUANTIZED_KEY]; other entries unchanged.

    Returns the flat checkpoint and the record (empty, with `ckpt` itself, when nothing is quantized).

    Raises:
        UnsupportedConversionError: a part's stored name is taken, or a tensor is not float when dequantized.
    """
    if not any(isinstance(t, QuantizedTensor) for t in ckpt.tensors.values()):
        return ckpt, {}
    tensors: dict[str, LazyTensor] = {}
    record: dict[str, Any] = {}
    for name, entry in ckpt.tensors.items():
        if not isinstance(entry, QuantizedTensor):
            tensors[name] = entry
            continue
        info = describe(name, entry, target=target)
        stored_parts = dict(entry.parts)
        if compressed_tensors.describable(entry) is None:
            stored_parts = compressed_tensors.encode_parts(name, entry)
            info["format"] = compressed_tensors.stored_format(entry)
        parts = {}
        for part, lazy in stored_parts.items():
            stored = stored_part_name(name, part, info.get("format"))
            if stored in tensors or (stored != name and stored in ckpt.tensors):
                raise UnsupportedConversionError("quantized checkpoint", target,
                                                 f"part {part!r} of {name!r} would be stored as {stored!r}, which is taken")
            tensors[stored] = lazy
            parts[part] = stored
        record[name] = {**info, "parts": parts}
    metadata = dict(ckpt.metadata)
    metadata[QUANTIZED_KEY] = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return type(ckpt)(tensors, metadata, ckpt.arch, ckpt.assets), record


def parse_record(path: Path, raw: str) -> dict[str, dict[str, Any]]:
    """The "modelkit.quantized" entry of a file, every description checked; FormatError otherwise."""
    from modelkit.storage.tensors import DEQUANTIZERS, LAYOUT_MODULES

    record = json_object(path, QUANTIZED_KEY, raw, what="map tensor names to descriptions", limit=RECORD_LIMIT)
    for name, info in record.items():
        bad = bad_entry(info, DEQUANTIZERS.keys() | LAYOUT_MODULES.keys())
        if bad:
            raise FormatError(path, f"quantized tensor {name!r}: {bad}")
    return record


def bad_entry(info: Any, layouts: Any) -> str | None:
    """Why a "modelkit.quantized" description is malformed, or None."""
    if not isinstance(info, dict):
        return "its description is not an object"
    if not isinstance(info.get("scheme"), str) or info.get("layout") not in layouts:
        return f"unknown layout {info.get('layout')!r} (known: {', '.join(sorted(layouts))})"
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return f"shape {shape!r} is not a list of sizes"
    if info.get("dtype") not in LOGICAL_DTYPES:
        return f"dtype {info.get('dtype')!r} is not one of {', '.join(LOGICAL_DTYPES)}"
    params = info.get("params")
    if not isinstance(params, dict) or not all(isinstance(v, (int, float, str, bool)) for v in params.values()):
        return "params must map names to numbers, strings or booleans"
    if info.get("format", compressed_tensors.FORMAT) not in compressed_tensors.FORMATS:
        return f"format {info.get('format')!r} is not one of {', '.join(compressed_tensors.FORMATS)}"
    parts = info.get("parts")
    if not isinstance(parts, dict) or not parts or not all(isinstance(v, str) for v in parts.values()):
        return "parts must map part names to stored tensor names"
    return None


def quantized_tensor(path: Path, name: str, info: dict[str, Any], parts: dict[str, LazyTensor]) -> QuantizedTensor:
    """The QuantizedTensor a checked description and its loaded-on-demand parts make."""
    return QuantizedTensor(scheme=info["scheme"], layout=info["layout"], shape=tuple(info["shape"]),
                           dtype=LOGICAL_DTYPES[info["dtype"]], parts=parts, params=info["params"],
                           source=f"{path}:{name}")


def group(path: Path, ckpt: Checkpoint, *, also_drop: tuple[str, ...] = ()) -> Checkpoint:
    """Put QuantizedTensors back together from their stored parts, as metadata[QUANTIZED_KEY] describes.

    The file's order is kept; a quantized weight takes the place of its first part. `also_drop`
    names metadata entries removed along with the record (safetensors' compressed-tensors config).
    A checkpoint without the record is returned as it is.
    """
    raw = ckpt.metadata.get(QUANTIZED_KEY)
    if raw is None:
        return ckpt
    record = parse_record(path, raw)
    tensors: dict[str, Any] = dict(ckpt.tensors)
    claimed: set[str] = set()
    grouped: dict[str, QuantizedTensor] = {}
    for name, info in record.items():
        parts = {}
        for part, stored in info["parts"].items():
            if stored not in ckpt.tensors or stored in claimed or isinstance(ckpt.tensors[stored], QuantizedTensor):
                raise FormatError(path, f"quantized tensor {name!r}: part {part!r} names {stored!r}, which is "
                                        "missing or belongs to another tensor")
            claimed.add(stored)
            parts[part] = ckpt.tensors[stored]
        if "format" in info:
            parts = compressed_tensors.decode_parts(path, name, info, parts)
        grouped[name] = quantized_tensor(path, name, info, parts)
    for stored in claimed:
        del tensors[stored]
    for name in grouped:
        if name in tensors:
            raise FormatError(path, f"quantized tensor {name!r} is also stored as a plain tensor")
    ordered: dict[str, Any] = {}
    for name, entry in ckpt.tensors.items():             # keep the file's order; a weight sits at its first part
        if name in tensors:
            ordered[name] = entry
        for q_name, q in grouped.items():
            if q_name not in ordered and name in record[q_name]["parts"].values():
                ordered[q_name] = q
    metadata = {k: v for k, v in ckpt.metadata.items() if k != QUANTIZED_KEY and k not in also_drop}
    return type(ckpt)(ordered, metadata, ckpt.arch, ckpt.assets)
