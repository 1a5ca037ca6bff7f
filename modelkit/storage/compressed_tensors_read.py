"""Reading folders other tools quantized with compressed-tensors (llm-compressor's W4A16, W8A8, W8A16, FP8, ...).

modelkit's own compressed-tensors folders carry a "modelkit.quantized" record (quantized_layout.py); these do
not, so the modules are found from the stored part names and the config groups of `quantization_config`
(modelkit.parse.compressed_tensors). For a quantized module `M` (stored names as compressed-tensors'
compressors write them, compressed-tensors 0.20):

    pack-quantized     M.weight_packed int32 (values + 2^(b-1) in b bits, element i at bit i*b of a row,
                       words little-endian; 1..8 bits), M.weight_scale, M.weight_shape int64 [rows, cols],
                       M.weight_zero_point (asymmetric: packed the same way along the rows for group and
                       channel, unpacked for tensor)
    int-quantized,     M.weight int8 (int values) or float8_e4m3fn (float values), M.weight_scale,
    naive-quantized,   M.weight_zero_point (asymmetric; older releases also stored a symmetric weight's,
                       all zeros: dropped when they are)
    float-quantized
    any                M.weight_g_idx (activation order "group": the group of each column), M.input_scale /
                       M.input_zero_point / M.output_scale (static activation quantization), M.k_scale /
                       M.v_scale (the KV cache's)

scale: (1,) per tensor, (rows, 1) per channel, (rows, cols / group) per group, (ceil(rows / bh), ceil(cols / bw))
per block. A weight dequantizes as compressed-tensors does: (q - zero_point) * scale computed in the scale's
dtype, the dtype the float weight takes.

What modelkit keeps quantized, losslessly: integer weights of 4 or 8 bits by tensor, channel or group,
symmetric or not, without a column order (g_idx): they become modelkit's "affine" QuantizedTensors through
compressed_tensors.decode_parts (scheme int4, int8, or int8-dynamic for W8A8 with dynamic per-token int8
inputs and per-channel symmetric float32 weights, which is modelkit's int8-dynamic). Everything else it can
compute (other bit widths, block scales, g_idx, FP8 weights) is dequantized to the scale's dtype, bit for bit
what compressed-tensors computes; activation and KV-cache quantization other than int8-dynamic's is not
applied (its scales are dropped), and `summary` says so for each group. Sparse formats, NVFP4/MXFP4 packing,
transforms and formats modelkit does not know are refused in one line naming the format.
Numpy only: storage never imports torch.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from modelkit.errors import FormatError
from modelkit.parse import compressed_tensors as ct_config
from modelkit.storage import compressed_tensors
from modelkit.storage.dtypes import DTYPES, cast_float, float8_e4m3fn_to_float32, widen_to_float32
from modelkit.storage.tensors import LazyTensor, QuantizedTensor

READABLE = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
WHAT_IS_READ = ("modelkit reads compressed-tensors' " + ", ".join(READABLE) + " folders (int weights of 1-8 bits, "
                "FP8 e4m3 weights)")
WEIGHT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
# Activation and KV-cache parts: not weights of the module, dropped (the summary says what is not applied).
DROPPED_PARTS = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "k_scale", "v_scale",
                 "q_scale", "k_zero_point", "v_zero_point")
FLOAT_SCALES = ("float32", "float16", "bfloat16")


def unpack(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """(r, w) int32 words -> (r, count) int32 values in [-2^(b-1), 2^(b-1)): value i from bits i*b.. of the row."""
    rows = words.shape[0]
    data = compressed_tensors.words_to_bytes(words, 4 * words.shape[1])
    if bits == 8:
        raw = data[:, :count].astype(np.int32)
    elif bits == 4:
        raw = compressed_tensors.nibble_values(data, count).astype(np.int32)
    else:                       # values straddle bytes: every `bits` bytes hold 8 values, read as one uint64
        groups = -(-data.shape[1] // bits)
        padded = np.zeros((rows, groups * bits), np.uint8)
        padded[:, :data.shape[1]] = data
        grouped = padded.reshape(rows, groups, bits)
        word = np.zeros((rows, groups), np.uint64)
        for k in range(bits):
            word |= grouped[:, :, k].astype(np.uint64) << np.uint64(8 * k)
        shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
        values = (word[:, :, None] >> shifts) & np.uint64((1 << bits) - 1)       # (rows, groups, 8)
        raw = values.reshape(rows, -1)[:, :count].astype(np.int32)
    return raw - (1 << (bits - 1))


class _Module:
    """One quantized module's stored parts and its group."""

    def __init__(self, name: str, group: ct_config.Group, parts: dict[str, LazyTensor]) -> None:
        self.name, self.group, self.parts = name, group, parts


def _group_of(module: str, config: ct_config.Config, source: str) -> ct_config.Group:
    """The group whose targets name `module`: by its name first, then by a pattern, then by a class name."""
    for test in (lambda t: not t.startswith("re:") and t == module,
                 lambda t: t.startswith("re:") and ct_config.matches(t, module)):
        found = [g for g in config.groups if any(test(t) for t in g.targets)]
        if found:
            return found[0]
    by_class = [g for g in config.groups if any(ct_config.is_class_name(t) for t in g.targets)]
    if len(by_class) == 1:
        return by_class[0]
    if by_class:
        raise FormatError(source, f"module {module!r} could belong to config groups "
                          f"{', '.join(g.name for g in by_class)} (all target class names); modelkit cannot tell which")
    raise FormatError(source, f"module {module!r} stores quantized parts but no config group targets it")


def modules(config: ct_config.Config, tensors: Mapping[str, LazyTensor], source: str) -> dict[str, _Module]:
    """The quantized modules of a folder: every module with a stored `weight_scale`, with its group and parts.

    Raises:
        FormatError: a format modelkit does not read, a module no group targets, or one the ignore list names.
    """
    if config.sparsity is not None:
        raise FormatError(source, f"sparsity format {config.sparsity!r} (compressed-tensors) is not read; "
                          + WHAT_IS_READ)
    if config.transforms:
        raise FormatError(source, "compressed-tensors transforms (rotations folded into the weights, "
                          "transform_config) are not read; " + WHAT_IS_READ)
    if config.status != "compressed":
        raise FormatError(source, f"quantization_status {config.status!r}: the weights are not stored compressed; "
                          "modelkit reads compressed folders (quantization_status 'compressed')")
    found: dict[str, _Module] = {}
    for name in tensors:
        owner, _, leaf = name.rpartition(".")
        if leaf != "weight_scale":
            continue
        group = _group_of(owner, config, source)
        if any(ct_config.matches(t, owner) for t in config.ignore):
            raise FormatError(source, f"module {owner!r} stores quantized parts but the ignore list names it")
        if group.format not in READABLE:
            raise FormatError(source, f"config group {group.name!r} is stored as {group.format!r}, which is not "
                              "read; " + WHAT_IS_READ)
        if group.weights is None:
            raise FormatError(source, f"config group {group.name!r} quantizes no weights but {owner!r} stores a "
                              "weight scale")
        if group.weights.type == "int" and group.weights.num_bits > 8:
            raise FormatError(source, f"config group {group.name!r} has int weights of {group.weights.num_bits} "
                              "bits, which are not read; " + WHAT_IS_READ)
        parts = {leaf: tensors[f"{owner}.{leaf}"] for leaf in WEIGHT_PARTS + ("weight",) if f"{owner}.{leaf}" in tensors}
        found[owner] = _Module(owner, group, parts)
    return found


def _shape(module: _Module, source: str) -> tuple[int, int]:
    """(rows, cols) of the logical weight; pack-quantized reads the 16-byte `weight_shape`."""
    if "weight_packed" in module.parts:
        shape = module.parts.get("weight_shape")
        if shape is None or shape.dtype.name not in ("int64", "int32") or shape.shape != (2,):
            raise FormatError(source, f"{module.name}: a packed weight needs weight_shape, 2 integers")
        rows, cols = (int(v) for v in shape.array())
        packed = module.parts["weight_packed"]
        bits = module.group.weights.num_bits
        if packed.dtype.name != "int32" or packed.shape != (rows, -(-cols * bits // 32)) or min(rows, cols) < 1:
            raise FormatError(source, f"{module.name}: weight_packed is {packed.dtype} {list(packed.shape)}, "
                              f"weight_shape {[rows, cols]} at {bits} bits needs int32 {[rows, -(-cols * bits // 32)]}")
        return rows, cols
    weight = module.parts.get("weight")
    if weight is None or len(weight.shape) != 2:
        raise FormatError(source, f"{module.name}: a quantized module needs a 2-D weight or weight_packed "
                          f"(3-D expert weights are not read)")
    return weight.shape


def _lossless(module: _Module, activations: ct_config.QuantArgs | None, rows: int, cols: int) -> str | None:
    """modelkit's scheme for a module it can hold exactly, or None."""
    w, parts = module.group.weights, module.parts
    if w.type != "int" or w.num_bits not in (4, 8) or w.strategy not in ("tensor", "channel", "group") \
            or "weight_g_idx" in parts or parts["weight_scale"].dtype.name not in FLOAT_SCALES:
        return None
    if "weight_packed" not in parts and (w.num_bits != 8 or parts["weight"].dtype.name != "int8"):
        return None
    if w.num_bits == 4 and cols % 2 or w.strategy == "group" and cols % w.group_size:
        return None
    zero = parts.get("weight_zero_point")
    if zero is not None and (w.symmetric or zero.dtype.name != ("int32" if _packed_zero(module) else "int8")):
        return None
    if parts["weight_scale"].shape != _lossless_scale(w, rows, cols):
        return None                         # (rows,) per channel, a scalar per tensor: dequantized, checked there
    dynamic_int8 = activations is not None and (activations.type, activations.num_bits, activations.strategy,
                                                activations.symmetric, bool(activations.dynamic)) == \
        ("int", 8, "token", True, True)
    if dynamic_int8 and w.num_bits == 8 and w.strategy == "channel" and w.symmetric \
            and parts["weight_scale"].dtype.name == "float32":
        return "int8-dynamic"
    return f"int{w.num_bits}"


def _lossless_scale(w: ct_config.QuantArgs, rows: int, cols: int) -> tuple[int, ...]:
    """The scale shape of modelkit's affine layout for the strategy."""
    return (1,) if w.strategy == "tensor" else (rows, 1 if w.strategy == "channel" else cols // w.group_size)


def _quantized(module: _Module, scheme: str, rows: int, cols: int, source: str) -> QuantizedTensor:
    w, parts = module.group.weights, module.parts
    group = {"tensor": 0, "channel": cols}.get(w.strategy, w.group_size)
    params = {"bits": w.num_bits, "symmetric": w.symmetric, "group_size": group}
    packed = "weight_packed" in parts
    info = {"layout": "affine", "shape": [rows, cols], "params": params,
            "format": compressed_tensors.FORMAT if packed else compressed_tensors.INT_FORMAT}
    stored = {"qdata": parts["weight_packed" if packed else "weight"], "scale": parts["weight_scale"]}
    if packed:
        stored["shape"] = parts["weight_shape"]
    if "weight_zero_point" in parts:
        stored["zero_point"] = parts["weight_zero_point"]
    decoded = compressed_tensors.decode_parts(source, f"{module.name}.weight", info, stored)
    dtype = parts["weight_scale"].dtype
    return QuantizedTensor(scheme=scheme, layout="affine", shape=(rows, cols), dtype=dtype, parts=decoded,
                           params=params, source=f"{source}:{module.name}.weight")


def _scale_fits(module: _Module, rows: int, cols: int, shape: tuple[int, ...]) -> bool:
    """Whether `weight_scale` of `shape` fits the group's strategy (tensor: (1,) or a scalar; channel: (rows, 1)
    or (rows,); group: (rows, cols / group), or any number of groups with a column order)."""
    w = module.group.weights
    if w.strategy == "tensor":
        return shape in ((1,), ())
    if w.strategy == "channel":
        return shape in ((rows, 1), (rows,))
    if w.strategy == "group" and "weight_g_idx" in module.parts:
        return len(shape) == 2 and shape[0] == rows and 1 <= shape[1] <= cols
    if w.strategy == "group":
        return cols % w.group_size == 0 and shape == (rows, cols // w.group_size)
    if w.strategy == "block":
        bh, bw = w.block_structure
        return shape == (-(-rows // bh), -(-cols // bw))
    return False


def _packed_zero(module: _Module) -> bool:
    """Whether the zero point is packed along the rows: asymmetric pack-quantized weights by group or channel.
    (A symmetric weight's zero point, which older releases stored, is as the scale is.)"""
    w = module.group.weights
    return "weight_packed" in module.parts and not w.symmetric and w.strategy in ("group", "channel")


def _check(module: _Module, rows: int, cols: int, source: str) -> None:
    """Every part's dtype and shape, before any data is read; FormatError naming the module otherwise."""
    w, parts = module.group.weights, module.parts
    scale = parts["weight_scale"]
    if scale.dtype.name not in FLOAT_SCALES:
        raise FormatError(source, f"{module.name}: weight_scale is {scale.dtype}; expected a float dtype")
    if not _scale_fits(module, rows, cols, scale.shape):
        raise FormatError(source, f"{module.name}: weight_scale {list(scale.shape)} does not fit a {rows}x{cols} "
                          f"weight quantized {w.describe()}")
    if w.type == "float" and (w.num_bits != 8 or "weight" not in parts or parts["weight"].dtype.name != "float8_e4m3fn"):
        stored = parts["weight"].dtype if "weight" in parts else "packed int32"
        raise FormatError(source, f"{module.name}: float weights of {w.num_bits} bits stored as {stored} are not "
                          "read; " + WHAT_IS_READ)
    if w.type == "int" and "weight_packed" not in parts and parts["weight"].dtype.name not in ("int8", "int16", "int32"):
        raise FormatError(source, f"{module.name}: int weights stored as {parts['weight'].dtype}; expected integers")
    zero = parts.get("weight_zero_point")
    if zero is not None:
        packed = _packed_zero(module)
        groups = scale.shape[1] if len(scale.shape) == 2 else 1
        want = (-(-rows * w.num_bits // 32), groups) if packed else scale.shape
        kinds = ("int32",) if packed else ("int8", "int16", "int32", *FLOAT_SCALES)
        if zero.shape != want or zero.dtype.name not in kinds:
            raise FormatError(source, f"{module.name}: weight_zero_point is {zero.dtype} {list(zero.shape)}; "
                              f"expected {kinds[0]} {list(want)}")
    g_idx = parts.get("weight_g_idx")
    if g_idx is not None and (g_idx.shape != (cols,) or g_idx.dtype.name not in ("int32", "int64")):
        raise FormatError(source, f"{module.name}: weight_g_idx is {g_idx.dtype} {list(g_idx.shape)}; expected "
                          f"int32 [{cols}]")


def _expand(values: np.ndarray, module: _Module, rows: int, cols: int, source: str) -> np.ndarray:
    """A (rows, cols) array of each weight's scale (or zero point) from a checked `weight_scale`-shaped array."""
    w = module.group.weights
    if w.strategy in ("tensor", "channel"):
        return np.broadcast_to(values.reshape(-1, 1), (rows, cols))
    if w.strategy == "block":
        bh, bw = w.block_structure
        return np.repeat(np.repeat(values, bh, axis=0), bw, axis=1)[:rows, :cols]
    g_idx = module.parts.get("weight_g_idx")
    if g_idx is None:
        return np.repeat(values, w.group_size, axis=1)
    index = g_idx.array().astype(np.int64)
    if index.min(initial=0) < 0 or index.max(initial=0) >= values.shape[1]:
        raise FormatError(source, f"{module.name}: weight_g_idx does not index the {values.shape[1]} groups")
    return values[:, index]


def _dequantized(module: _Module, rows: int, cols: int, source: str) -> LazyTensor:
    """The float weight compressed-tensors computes: (q - zero_point) * scale in the scale's dtype."""
    w, parts = module.group.weights, module.parts
    scale_part = parts["weight_scale"]
    dtype = scale_part.dtype

    def values() -> np.ndarray:
        if "weight_packed" in parts:
            q = unpack(parts["weight_packed"].array(), w.num_bits, cols).astype(np.float32)
        elif w.type == "float":
            q = float8_e4m3fn_to_float32(parts["weight"].array())
        else:
            q = parts["weight"].array().astype(np.float32)
        scale = scale_part.array()
        scale = (widen_to_float32(scale, dtype) if dtype.name != "float32" else scale).reshape(
            scale_part.shape if len(scale_part.shape) == 2 else (-1, 1))
        if "weight_zero_point" in parts:
            zero = parts["weight_zero_point"]
            if _packed_zero(module):
                z = unpack(np.ascontiguousarray(zero.array().T), w.num_bits, rows).T
            else:
                z = zero.array()
                z = widen_to_float32(z, zero.dtype) if zero.dtype.name in ("float16", "bfloat16") else z
            q = q - _expand(np.asarray(z, np.float32).reshape(scale.shape), module, rows, cols, source)
        out = q * _expand(scale.astype(np.float32, copy=False), module, rows, cols, source)
        return cast_float(np.ascontiguousarray(out, np.float32), DTYPES["float32"], dtype)
    return LazyTensor(dtype, (rows, cols), values, f"{source}:{module.name}.weight")


def read(config: ct_config.Config, tensors: Mapping[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The folder's tensors with each quantized module's parts replaced by its weight, and the summary.

    The weight is a QuantizedTensor where modelkit holds it exactly, else the dequantized float tensor; the
    activation and KV-cache parts are dropped. The summary is what `inspect` shows.
    """
    found = modules(config, tensors, source)
    out: dict[str, Any] = {}
    replaced: dict[str, Any] = {}
    read_as: dict[str, dict[str, int]] = {}
    for name, module in found.items():
        rows, cols = _shape(module, source)
        _check(module, rows, cols, source)
        zero = module.parts.get("weight_zero_point")
        if zero is not None and module.group.weights.symmetric and not zero.array().any():
            del module.parts["weight_zero_point"]       # older releases stored a symmetric weight's zeros
        scheme = _lossless(module, module.group.input_activations, rows, cols)
        weight = _quantized(module, scheme, rows, cols, source) if scheme else _dequantized(module, rows, cols, source)
        replaced[f"{name}.weight"] = weight
        label = f"modelkit {scheme} (exact)" if scheme else f"{weight.dtype.name}, dequantized as compressed-tensors does"
        counts = read_as.setdefault(module.group.name, {})
        counts[label] = counts.get(label, 0) + 1
    claimed = {f"{m}.{p}" for m, module in found.items() for p in module.parts}
    dropped = {n for n in tensors if n.rpartition(".")[2] in DROPPED_PARTS}
    for name, entry in tensors.items():
        owner = name.rpartition(".")[0]
        if name in claimed or name in dropped:
            if owner in found and f"{owner}.weight" not in out:
                out[f"{owner}.weight"] = replaced[f"{owner}.weight"]
            continue
        out[name] = entry
    return out, summary(config, read_as)


def summary(config: ct_config.Config, read_as: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """What `inspect` shows: each config group's format, weights and activations and how modelkit reads its
    modules, the ignore list, and what is not applied (activation and KV-cache quantization modelkit runs in float)."""
    groups = []
    for group in config.groups:
        counts = read_as.get(group.name, {})
        exact_int8_dynamic = any(label.startswith("modelkit int8-dynamic") for label in counts)
        ignored = [f"{kind} ({args.describe()})" for kind, args in (("input activations", group.input_activations),
                                                                  ("output activations", group.output_activations))
                   if args is not None and not (kind == "input activations" and exact_int8_dynamic)]
        groups.append({"group": group.name, "format": group.format, "targets": list(group.targets),
                       "weights": group.weights.describe() if group.weights else None,
                       "input_activations": group.input_activations.describe() if group.input_activations else None,
                       "read_as": dict(counts), "not_applied": ignored})
    return {"groups": groups, "ignore": list(config.ignore),
            "kv_cache": config.kv_cache.describe() if config.kv_cache is not None else None}
