"""GGUF block quantization of a weight file, tensor by tensor: no model built, no torch imported.

`modelkit quantize weights.safetensors out.gguf --scheme q4_0` on a file that names no
architecture (a bare state dict, a weight file from another tool): every 2-D floating-point
tensor whose name ends in "weight" and whose rows are whole 32-weight blocks becomes a block
type, as llama.cpp's quantizer chooses them; every other tensor is stored as it is. Tensors are
quantized as the GGUF writer pulls them (one in memory at a time) and the written file is
verified: every tensor's blocks read back have the digest (CRC-32 and length) of the blocks that were
quantized (storage.tensors.MadeTensor: the file holds exactly what the kernels made, checked without
quantizing twice; the kernels themselves are checked against llama.cpp by the tests).
With a llama.cpp recipe (`--scheme Q4_K_M`, modelkit.quantizers.gguf_recipes) each tensor gets the type
llama-quantize picks for it, and general.file_type is llama.cpp's.

A Hugging Face folder (or any file naming a Hugging Face family) streams the same way and is written in
llama.cpp's layout for its family. A file that names a zoo model keeps the module path
(modelkit.pipeline.quantize), where the model decides which layers are quantized and the rebuilt
model's outputs are checked.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from modelkit import schemes
from modelkit.checkpoint import Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import ConfigError
from modelkit.formats import ReadOptions, check_readable, detect_format, load_format
from modelkit.metadata import FILE_TYPE_KEY, METRICS_KEY, QUANT_KEY
from modelkit.models import gguf_conventions, hf_family
from modelkit.pipeline.reports import QuantizeReport
from modelkit.pipeline.write import ProgressFn, write_checkpoint
from modelkit.quantizers import gguf_recipes
from modelkit.quantizers.gguf_arrays import (
    BLOCK,
    KERNEL_TYPES,
    TYPE_SIZES,
    BlockConfig,
    quantize_array,
    row_bytes,
    row_type,
)
from modelkit.quantizers.gguf_recipes import checkpoint_types
from modelkit.quantizers.imatrix import read_importance
from modelkit.storage.dtypes import DTYPES, widen_to_float32
from modelkit.storage.tensors import MadeTensor

PathLike = str | os.PathLike[str]
logger = logging.getLogger(__name__)


def checkpoint_stats(ckpt: Checkpoint) -> dict[str, Any]:
    """Parameters, stored tensor bytes and bits per weight (all tensors, quantized or not)."""
    params = ckpt.num_parameters
    quantized = [t for t in ckpt.tensors.values() if isinstance(t, QuantizedTensor)]
    return {"parameters": params, "tensor_bytes": ckpt.nbytes,
            "bits_per_weight": round(8 * ckpt.nbytes / max(params, 1), 3),
            "quantized_tensors": len(quantized), "quantized_parameters": sum(t.numel for t in quantized)}


def is_block_scheme(scheme: Any) -> bool:
    """Whether `scheme` (a name or a config) is a GGUF block type this module quantizes."""
    name = scheme if isinstance(scheme, str) else getattr(type(scheme), "scheme", None)
    name = name.lower() if isinstance(name, str) else name
    return name in TYPE_SIZES or name in KERNEL_TYPES or name in gguf_recipes.RECIPES


def _float32(entry: LazyTensor) -> np.ndarray:
    """The tensor's values as float32, as gguf-py casts them before quantizing."""
    array = entry.array()
    if entry.dtype.name in ("float16", "bfloat16"):
        return widen_to_float32(array, entry.dtype)
    return array.astype(np.float32, copy=False)


def _quantizable(name: str, entry: Any, skip: tuple[str, ...], type_name: str, *,
                 row: int | None = None) -> str | None:
    """None if `entry` becomes blocks of `type_name` (or of its fallback type, see row_type); otherwise why it
    stays as it is (for the log). `row`: the length of the rows the blocks run along, when it is not the last
    dimension (a transposed weight)."""
    if not isinstance(entry, LazyTensor) or not entry.dtype.is_floating_point or not entry.dtype.exact \
            and entry.dtype.name != "bfloat16":
        return "not a floating-point tensor"
    if not name.endswith("weight") or len(entry.shape) != 2:
        return "not a 2-D weight (llama.cpp keeps those as they are)"
    row = entry.shape[-1] if row is None else row
    if row_type(type_name, row) is None:
        return f"rows of {row} weights are not whole {BLOCK}-weight blocks"
    module = name.rpartition(".")[0]
    if any(fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(name, pattern) for pattern in skip):
        return "skipped"
    return None


def block_checkpoint(ckpt: Checkpoint, config: BlockConfig, *, threads: int | None = None,
                     transposed: frozenset[str] = frozenset(), gguf_names: Mapping[str, str] | None = None) -> Checkpoint:
    """`ckpt` with its quantizable weights as GGUF blocks, quantized on read: every weight `config.scheme`
    (the legacy and plain K types), or the type llama.cpp's rules pick for it (a recipe: q4_k_m ...,
    modelkit.quantizers.gguf_recipes). `transposed` names weights GGUF stores transposed (a family's Conv1D
    weights): their blocks run along the stored rows, and the QuantizedTensor says so (params["transposed"]).
    `gguf_names`: the names the GGUF file gives the tensors (a family's llama.cpp names), under which
    `config.imatrix` holds their importance (default: the tensors' own names)."""
    importance = read_importance(config.imatrix) if config.imatrix else None
    gguf_names = gguf_names or {}
    recipe_types, fallbacks = None, 0
    if config.recipe:
        recipe_types, chosen = checkpoint_types(ckpt, config.recipe, has_imatrix=importance is not None)
        fallbacks = chosen.fallbacks
    ahead = _Ahead()
    tensors: dict[str, Any] = {}
    for name, entry in ckpt.tensors.items():
        flip = name in transposed and isinstance(entry, LazyTensor) and len(entry.shape) == 2
        row = entry.shape[0] if flip else None
        if recipe_types is None:
            reason = _quantizable(name, entry, config.skip, config.scheme, row=row)
            type_name = row_type(config.scheme, row or entry.shape[-1]) if reason is None else None
        else:
            type_name, reason = _recipe_choice(name, entry, config, recipe_types.get(name))
        if type_name == "f16":           # llama.cpp's last fallback: rows that are not whole 32-weight blocks
            logger.info("%s: rows are not whole %d-weight blocks; stored as F16, as llama.cpp does", name, BLOCK)
            tensors[name] = entry if entry.dtype.name == "float16" else LazyTensor(
                DTYPES["float16"], entry.shape, lambda entry=entry: _float32(entry).astype(np.float16), entry.source)
            continue
        if reason is not None or type_name is None:
            logger.info("kept %s as %s: %s", name, entry.dtype, reason)
            tensors[name] = entry
            continue
        rows, cols = entry.shape[::-1] if flip else entry.shape
        if recipe_types is None and type_name != config.scheme:
            logger.info("%s: rows of %d weights are not whole %s super-blocks; stored as %s, as llama.cpp does",
                        name, cols, config.scheme.upper(), type_name.upper())
        ggml_type = type_name.upper()
        vector = importance.for_weight(gguf_names.get(name, name), cols) if importance is not None else None
        ahead.jobs[name] = (lambda entry=entry, name=name, flip=flip, type_name=type_name, vector=vector:
                            _quantized(entry, name, type_name, threads, flip, vector))
        qdata = MadeTensor(DTYPES["uint8"], (rows, row_bytes(type_name, cols)),
                           lambda name=name: ahead.get(name), entry.source)
        # dtype float32: what dequantizing GGUF blocks gives back, as the GGUF reader says
        params = {"ggml_type": ggml_type, **({"transposed": True} if flip else {})}
        tensors[name] = QuantizedTensor(scheme=type_name, layout="gguf", shape=entry.shape, dtype=DTYPES["float32"],
                                        parts={"qdata": qdata}, params=params, source=entry.source)
    metadata = {**{k: v for k, v in ckpt.metadata.items() if k not in (METRICS_KEY, FILE_TYPE_KEY)},
                QUANT_KEY: schemes.config_to_json(config)}
    if config.recipe:
        metadata[FILE_TYPE_KEY] = str(gguf_recipes.RECIPES[config.recipe].ftype)
        if fallbacks:
            logger.info("%d tensor(s) took a fallback type (rows not whole 256-weight super-blocks), as llama.cpp "
                        "counts them", fallbacks)
    return Checkpoint(tensors, metadata, ckpt.arch, ckpt.assets)


def is_tfjs_scheme(scheme: Any) -> bool:
    """Whether `scheme` (a name or a config) is TensorFlow.js's uint8/uint16 weight encoding."""
    name = scheme if isinstance(scheme, str) else getattr(type(scheme), "scheme", None)
    return name in ("tfjs-uint8", "tfjs-uint16")


def tfjs_checkpoint(ckpt: Checkpoint, config: Any) -> Checkpoint:
    """`ckpt` with every floating-point tensor (unless skipped) as TF.js's codes with their own min and scale
    (QuantizedTensor, layout "tfjs", decoding to float32), as tensorflowjs_converter --quantize_uint8 stores
    them. The ranges are found now (one tensor read at a time: the manifest needs them before any shard is
    written); the codes are made as the writer pulls each tensor."""
    from modelkit.quantizers.tfjs_uint import LAYOUT, affine_range, encode

    tensors: dict[str, Any] = {}
    code_dtype = DTYPES["uint8" if config.bits == 8 else "uint16"]
    for name, entry in ckpt.tensors.items():
        if isinstance(entry, QuantizedTensor):
            raise ConfigError(f"{name} is already quantized ({entry.scheme}); quantize the float model instead")
        module = name.rpartition(".")[0]
        if not entry.dtype.is_floating_point or any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(name, p)
                                                    for p in config.skip):
            tensors[name] = entry
            continue
        try:
            low, scale = affine_range(_float32(entry), config.bits)
        except ConfigError as e:
            raise ConfigError(f"{name}: {e}") from e
        codes = LazyTensor(code_dtype, entry.shape, lambda entry=entry, low=low, scale=scale:
                           encode(_float32(entry), config.bits, low, scale), entry.source)
        tensors[name] = QuantizedTensor(scheme=config.scheme, layout=LAYOUT, shape=entry.shape, dtype=DTYPES["float32"],
                                        parts={"qdata": codes}, params={"dtype": code_dtype.name, "min": low,
                                                                        "scale": scale}, source=entry.source)
    metadata = {**{k: v for k, v in ckpt.metadata.items() if k != METRICS_KEY}, QUANT_KEY: schemes.config_to_json(config)}
    return Checkpoint(tensors, metadata, ckpt.arch, ckpt.assets)


class _Ahead:
    """Quantizes the next tensor in the background while the writer stores this one: the GGUF writer pulls
    tensors in the checkpoint's order, so the kernels never wait for the disk (at most two tensors' blocks in
    memory). A tensor read out of order, or again, is quantized then and there."""

    def __init__(self) -> None:
        self.jobs: dict[str, Callable[[], np.ndarray]] = {}
        self.pending: dict[str, Future[np.ndarray]] = {}
        self.pool: ThreadPoolExecutor | None = None

    def get(self, name: str) -> np.ndarray:
        future = self.pending.pop(name, None)
        order = list(self.jobs)
        following = order[order.index(name) + 1] if order.index(name) + 1 < len(order) else None
        if following is not None and following not in self.pending:
            self.pool = self.pool or ThreadPoolExecutor(1, thread_name_prefix="modelkit-quantize-ahead")
            self.pending[following] = self.pool.submit(self.jobs[following])
        return future.result() if future is not None else self.jobs[name]()


def _recipe_choice(name: str, entry: Any, config: BlockConfig, chosen: str | None) -> tuple[str | None, str | None]:
    """(type, None) for a tensor the recipe quantizes, or (None, why it stays as it is)."""
    if not isinstance(entry, LazyTensor) or not entry.dtype.is_floating_point or not entry.dtype.exact \
            and entry.dtype.name != "bfloat16":
        return None, "not a floating-point tensor"
    module = name.rpartition(".")[0]
    if any(fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(name, pattern) for pattern in config.skip):
        return None, "skipped"
    if chosen is None:
        return None, f"llama.cpp's {config.recipe.upper()} keeps it as it is"
    return chosen, None


def _quantized(entry: LazyTensor, name: str, type_name: str, threads: int | None, flip: bool = False,
               importance: np.ndarray | None = None) -> np.ndarray:
    try:      # the K-quants and IQ4 widen float16 themselves, in their worker threads
        values = entry.array() if type_name in KERNEL_TYPES and entry.dtype.name == "float16" else _float32(entry)
        values = np.ascontiguousarray(values.T) if flip else values
        return quantize_array(values, type_name, threads=threads, importance=importance)
    except ConfigError as e:
        raise ConfigError(f"{name}: {e}") from e


def quantize_weights(src: PathLike, dst: PathLike, *, config: BlockConfig, source_format: str | None = None,
                     trust: bool = False, key: str | None = None, force: bool = False, verify: bool = True,
                     progress: ProgressFn | None = None, require_no_arch: bool = True,
                     allow_requantize: bool = False) -> QuantizeReport | None:
    """Quantize a weight file to a GGUF of `config`'s block type (or llama.cpp recipe) without building a model.

    Returns None (nothing written) when `require_no_arch` and the file names an architecture:
    the caller then takes the module path, which lets the model choose its layers.
    `allow_requantize`: a file that is already block-quantized is dequantized and quantized again, as
    llama-quantize --allow-requantize does (quality is lost twice); without it such a file is refused.

    Raises:
        ConfigError: the file is already quantized, or a chosen tensor holds NaN or infinity.
    """
    src, dst = Path(src), Path(dst)
    check_readable(src)
    fmt = source_format or detect_format(src)
    ckpt = load_format(fmt).read(src, ReadOptions(trust=trust, key=key))
    rules = gguf_conventions(ckpt.arch) if ckpt.arch is not None and hf_family(ckpt.arch.name) is not None else None
    if require_no_arch and ckpt.arch is not None and rules is None:
        return None             # a zoo model: its module chooses the layers (a Hugging Face family streams here)
    quantized = sorted({t.scheme.upper() for t in ckpt.tensors.values() if isinstance(t, QuantizedTensor)})
    if quantized and not allow_requantize:
        raise ConfigError(f"{src} is already quantized ({', '.join(quantized)}); quantize the float model, or pass "
                          "--allow-requantize to dequantize and quantize it again (quality is lost twice)")
    if quantized:               # dequantized on read, one tensor at a time
        ckpt = load_format(fmt).read(src, ReadOptions(trust=trust, key=key, dequantize=True))
    started = time.perf_counter()
    blocks = block_checkpoint(ckpt, config, transposed=rules.transposed if rules is not None else frozenset(),
                              gguf_names=rules.names if rules is not None else None)
    verified, size = write_checkpoint(blocks, dst, "gguf", force=force, verify=verify, progress=progress)
    seconds = time.perf_counter() - started     # quantizing happens as the writer pulls each tensor
    source_bytes = sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) if src.is_dir() else src.stat().st_size
    stats = checkpoint_stats(blocks)
    kept = len(blocks) - stats["quantized_tensors"]
    what = f"{ckpt.arch.name} (Hugging Face family, llama.cpp's layout)" if rules is not None else "no architecture"
    notes = [f"{what}: {stats['quantized_tensors']} 2-D weights quantized, {kept} tensors kept as they are"]
    return QuantizeReport(scheme=config.scheme, config=schemes.config_to_dict(config),
                          source={"path": str(src), "format": fmt, "bytes": source_bytes},
                          target={"path": str(dst), "format": "gguf", "bytes": size}, stats=stats,
                          seconds_quantize=round(seconds, 3), size_ratio=round(size / max(source_bytes, 1), 4),
                          verify=verified, notes=notes)
