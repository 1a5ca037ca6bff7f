"""GGUF block types on numpy arrays: the configs, the block geometry, `quantize_array` and the K-quants, without torch.

Weight files become GGUF block types here without building a model or importing torch
(`modelkit quantize weights.safetensors out.gguf --scheme q4_0`): the C kernels of
_gguf_kernels.c quantize each tensor in place of gguf-py's numpy reference, which is the
fallback where the extension was not built (same bytes, slower). `gguf_blocks.py` holds the
torch side: quantized layers, the eager-torch reference and dequantization.

K-quants (super-blocks of 256 weights, _gguf_kernels_kquants.h): q2_k..q6_k quantize byte-identical
to llama.cpp's `ggml_quantize_chunk` without an importance matrix (`quantize_kquants`) and
dequantize bit-identical to its `to_float` (`dequantize_kquants`). They need the extension: gguf-py
has no K-quant quantizer to fall back on.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from modelkit.errors import ConfigError, MissingDependencyError
from modelkit.quantizers.gguf_recipes import RECIPES

RECIPE_BASES: dict[str, str] = {name: r.base for name, r in RECIPES.items()}

try:
    from modelkit.quantizers import _gguf_kernels
except ImportError:                 # installed without a C compiler: gguf-py (numpy) or eager torch
    _gguf_kernels = None

BLOCK = 32                  # weights per block for every type here (QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0)
MIN_SHARE = 2**16           # blocks per thread at least (2 MiB of float32): smaller tensors run on one thread
# Block type -> bytes per block of BLOCK weights (ggml's type sizes).
TYPE_SIZES: dict[str, int] = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}
K_BLOCK = 256               # weights per K-quant super-block (QK_K)
# K type -> bytes per super-block.
K_TYPE_SIZES: dict[str, int] = {"q2_k": 84, "q3_k": 110, "q4_k": 144, "q5_k": 176, "q6_k": 210}
K_QUANTIZED: tuple[str, ...] = tuple(K_TYPE_SIZES)
# llama.cpp's type for a tensor whose rows are not whole super-blocks (llama-quant.cpp's tensor_type_fallback).
K_FALLBACK: dict[str, str] = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
KERNEL_ISAS: tuple[str, ...] = tuple(_gguf_kernels.ISAS) if _gguf_kernels else ()
# The configs live here (torch-free); `apply` to a module is torch's, in gguf_blocks (schemes.scheme_module).
APPLY_MODULE = "modelkit.quantizers.gguf_blocks"


def block_weights(type_name: str) -> int:
    """Weights per block of `type_name` (32, or 256 for the K-quants)."""
    return K_BLOCK if type_name in K_TYPE_SIZES else BLOCK


def row_type(type_name: str, row: int) -> str | None:
    """The type a row of `row` weights is stored as under `type_name`: itself when the rows are whole
    blocks, llama.cpp's fallback for a K type whose rows are not whole super-blocks, None if neither fits."""
    if row % block_weights(type_name) == 0:
        return type_name
    fallback = K_FALLBACK.get(type_name)
    return fallback if fallback is not None and row % BLOCK == 0 else None


def row_bytes(type_name: str, row: int) -> int:
    """Bytes of one row of `row` weights as `type_name` blocks."""
    return row // block_weights(type_name) * {**TYPE_SIZES, **K_TYPE_SIZES}[type_name]


def check_skip(config: Any) -> None:
    """`skip` as a tuple of strings (JSON gives lists); a ConfigError otherwise."""
    skip = config.skip
    if isinstance(skip, str):
        skip = (skip,)
    skip = tuple(skip)
    if not all(isinstance(p, str) and p for p in skip):
        raise ConfigError(f"skip must be module-name patterns (strings), got {list(skip)!r}")
    object.__setattr__(config, "skip", skip)


@dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """Quantize every Linear and Embedding weight whose rows are whole 32-weight blocks.

    For a weight file without an architecture (no model to build), every 2-D floating-point
    tensor whose name ends in "weight" is such a weight, as llama.cpp's quantizer chooses them.

    Args:
        skip: fnmatch patterns of module names left in float, e.g. ("lm_head",). Norms,
            biases and every 1-D tensor always stay float32, as llama.cpp keeps them; so does
            any weight whose rows are not a multiple of 32 (logged).

    Example:
        >>> from modelkit.models import build
        >>> from modelkit.quantizers.gguf_blocks import apply
        >>> q = apply(build("tinylm", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}),
        ...           Q8_0Config())
        >>> type(q.lm_head).__name__
        'QuantizedLinear'
    """

    scheme: ClassVar[str] = ""
    # llama.cpp's file type (modelkit.quantizers.gguf_recipes.RECIPES) whose per-tensor rules choose each type;
    # "" for the legacy types, whose every weight is `scheme`
    recipe: ClassVar[str] = ""
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_skip(self)

    @property
    def block_type(self) -> str:
        """The block type of every weight no rule of the recipe picks otherwise ("q4_k" for q4_k_m)."""
        return RECIPE_BASES.get(self.recipe, type(self).scheme)


@dataclass(frozen=True, kw_only=True)
class Q8_0Config(BlockConfig):
    __doc__ = BlockConfig.__doc__
    scheme: ClassVar[str] = "q8_0"


@dataclass(frozen=True, kw_only=True)
class Q4_0Config(BlockConfig):
    __doc__ = BlockConfig.__doc__
    scheme: ClassVar[str] = "q4_0"


@dataclass(frozen=True, kw_only=True)
class Q4_1Config(BlockConfig):
    __doc__ = BlockConfig.__doc__
    scheme: ClassVar[str] = "q4_1"


@dataclass(frozen=True, kw_only=True)
class Q5_0Config(BlockConfig):
    __doc__ = BlockConfig.__doc__
    scheme: ClassVar[str] = "q5_0"


@dataclass(frozen=True, kw_only=True)
class Q5_1Config(BlockConfig):
    __doc__ = BlockConfig.__doc__
    scheme: ClassVar[str] = "q5_1"


@dataclass(frozen=True, kw_only=True)
class Q3_KConfig(BlockConfig):
    """Quantize every Linear and Embedding weight to llama.cpp's K-quant super-blocks (256 weights).

    As BlockConfig, except that a weight whose rows are not whole 256-weight super-blocks is stored
    as llama.cpp's quantizer stores it then (K_FALLBACK: Q4_0 under q2_k and q3_k, Q5_0 under q4_k,
    Q5_1 under q5_k, Q8_0 under q6_k) when its rows are whole 32-weight blocks, otherwise kept in
    float (logged). No importance matrix. (llama-quantize's Q3_K, Q4_K and Q5_K are its _M recipes:
    name those, q3_k_m ..., for its per-tensor choices.)
    """

    scheme: ClassVar[str] = "q3_k"


@dataclass(frozen=True, kw_only=True)
class Q4_KConfig(BlockConfig):
    __doc__ = Q3_KConfig.__doc__
    scheme: ClassVar[str] = "q4_k"


@dataclass(frozen=True, kw_only=True)
class Q5_KConfig(BlockConfig):
    __doc__ = Q3_KConfig.__doc__
    scheme: ClassVar[str] = "q5_k"


@dataclass(frozen=True, kw_only=True)
class RecipeConfig(BlockConfig):
    """llama.cpp's file type of this name (llama-quantize's Q2_K, Q3_K_S ... Q6_K): each tensor's block type
    chosen by llama.cpp's rules from its llama.cpp name, layer and shape (modelkit.quantizers.gguf_recipes:
    more bits for attn_v, ffn_down, attn_output and the output head; 32-weight fallbacks for rows that
    are not whole 256-weight super-blocks), and general.file_type set to llama.cpp's value. A model
    whose tensors have no llama.cpp names (no family) gets the base type everywhere, with the fallbacks.
    """

    scheme: ClassVar[str] = ""


def _recipe_config(name: str) -> type[RecipeConfig]:
    """The config class of recipe `name` (Q4_K_MConfig for "q4_k_m")."""
    title = f"{name.upper()}Config"
    namespace = {"scheme": name, "recipe": name, "__module__": __name__, "__qualname__": title,
                 "__doc__": RecipeConfig.__doc__}
    return dataclass(frozen=True, kw_only=True)(type(title, (RecipeConfig,), namespace))


# The recipes' configs, one class each (the scheme table names them): Q2_KConfig ... Q6_KConfig
Q2_KConfig = _recipe_config("q2_k")
Q3_K_SConfig = _recipe_config("q3_k_s")
Q3_K_MConfig = _recipe_config("q3_k_m")
Q3_K_LConfig = _recipe_config("q3_k_l")
Q4_K_SConfig = _recipe_config("q4_k_s")
Q4_K_MConfig = _recipe_config("q4_k_m")
Q5_K_SConfig = _recipe_config("q5_k_s")
Q5_K_MConfig = _recipe_config("q5_k_m")
Q6_KConfig = _recipe_config("q6_k")


def shares(total: int, workers: int, least: int, step: int = 1) -> list[tuple[int, int]]:
    """Split range(total) into at most `workers` contiguous (start, stop) shares of at least
    `least`, each starting at a multiple of `step`."""
    if total == 0:
        return [(0, 0)]
    count = max(1, min(workers, total // least))
    size = math.ceil(math.ceil(total / count) / step) * step
    return [(start, min(start + size, total)) for start in range(0, total, size)]


def in_threads(work: Callable[[int, int], bool], parts: list[tuple[int, int]]) -> bool:
    """Run work(start, stop) for each share, side by side; whether all returned True."""
    if len(parts) == 1:
        return work(*parts[0])
    with ThreadPoolExecutor(len(parts)) as pool:
        return all(list(pool.map(lambda share: work(*share), parts)))


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not on Linux
        return os.cpu_count() or 1


def run_kernels(type_name: str, source: np.ndarray, target: np.ndarray, workers: int, isa: str) -> bool:
    """The C kernels over flat float32 `source` into flat uint8 `target`, one contiguous share of
    blocks per thread (they release the GIL); False if a block holds NaN or infinity."""
    size = TYPE_SIZES[type_name]

    def work(start: int, stop: int) -> bool:
        # -1 when done; otherwise the index of the first block holding NaN or infinity
        return _gguf_kernels.quantize(type_name, source[start * BLOCK:stop * BLOCK], target[start * size:stop * size],
                                      isa) < 0

    return in_threads(work, shares(source.size // BLOCK, workers, MIN_SHARE))


def quantize_array(values: np.ndarray, type_name: str, *, threads: int | None = None) -> np.ndarray:
    """Quantize a float array to GGUF blocks along its last dimension: the bytes gguf-py's
    `gguf.quants.quantize` gives, as uint8 (rows, bytes per row) with rows = all leading dimensions.

    Raises:
        ConfigError: the last dimension is not a multiple of 32, the type is unknown, or the
            array holds NaN or infinity.
    """
    type_name = type_name.lower()
    if type_name in K_QUANTIZED:
        return quantize_kquants(values, type_name, threads=threads)
    if type_name not in TYPE_SIZES:
        raise ConfigError(f"unknown GGUF block type {type_name!r}; known: {', '.join((*TYPE_SIZES, *K_QUANTIZED))}")
    shape = values.shape
    if not shape or shape[-1] % BLOCK:
        raise ConfigError(f"cannot quantize a tensor of shape {list(shape)} to {type_name}: its rows must be "
                          f"whole {BLOCK}-weight blocks")
    rows = math.prod(shape[:-1])
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    row_bytes = shape[-1] // BLOCK * TYPE_SIZES[type_name]
    if _gguf_kernels is not None:
        out = np.empty(rows * row_bytes, dtype=np.uint8)
        if run_kernels(type_name, flat, out, threads or default_threads(), KERNEL_ISAS[0]):
            return out.reshape(rows, row_bytes)
    elif np.isfinite(flat).all():
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize as reference_quantize

        return np.asarray(reference_quantize(flat.reshape(rows, shape[-1]), GGMLQuantizationType[type_name.upper()]),
                          dtype=np.uint8).reshape(rows, row_bytes)
    bad = int(np.flatnonzero(~np.isfinite(flat))[0]) // shape[-1]
    raise ConfigError(f"cannot quantize to {type_name.upper()}: the tensor of shape {list(shape)} holds NaN or "
                      f"infinity (row {bad}); fix the weights, or keep this tensor in float (skip it)")


def _k_kernels(what: str) -> Any:
    if _gguf_kernels is None:
        raise MissingDependencyError(f"{what} needs modelkit's compiled GGUF kernels (reinstall modelkit where a C "
                                     f"compiler is found)")
    return _gguf_kernels


_WIDEN_BLOCKS = 1024         # super-blocks of float16 widened at a time by one worker (1 MiB of float32: in cache)


def quantize_kquants(values: np.ndarray, type_name: str, *, threads: int | None = None) -> np.ndarray:
    """Quantize a float array to K-quant super-blocks (q2_k .. q6_k) along its last dimension: the
    bytes llama.cpp's `ggml_quantize_chunk` writes without an importance matrix, as uint8 (rows, bytes per row).
    float16 input is widened to float32 (exactly) by the worker threads as they go.

    Raises:
        ConfigError: the last dimension is not a multiple of 256, or the array holds NaN or infinity.
        MissingDependencyError: the C extension was not built.
    """
    kernels = _k_kernels(f"quantizing to {type_name.upper()}")
    shape = values.shape
    if not shape or shape[-1] % K_BLOCK:
        raise ConfigError(f"cannot quantize a tensor of shape {list(shape)} to {type_name.upper()}: its rows must be "
                          f"whole {K_BLOCK}-weight super-blocks (llama.cpp stores such a tensor as "
                          f"{K_FALLBACK[type_name].upper()})")
    rows = math.prod(shape[:-1])
    # float16 is widened by the workers, a slice at a time (no float32 copy of the tensor, no serial pass)
    flat = np.ascontiguousarray(values, dtype=np.float16 if values.dtype == np.float16 else np.float32).reshape(-1)
    size = K_TYPE_SIZES[type_name]
    out = np.empty(flat.size // K_BLOCK * size, dtype=np.uint8)

    def work(start: int, stop: int) -> bool:
        if flat.dtype == np.float32:
            return kernels.kquantize(type_name, flat[start * K_BLOCK:stop * K_BLOCK], out[start * size:stop * size]) < 0
        for first in range(start, stop, _WIDEN_BLOCKS):
            last = min(first + _WIDEN_BLOCKS, stop)
            chunk = flat[first * K_BLOCK:last * K_BLOCK].astype(np.float32)
            if kernels.kquantize(type_name, chunk, out[first * size:last * size]) >= 0:
                return False
        return True

    # a super-block costs ~40x a 32-weight block: shares of 2**12 super-blocks are worth a thread
    if not in_threads(work, shares(flat.size // K_BLOCK, threads or default_threads(), 2**12)):
        bad = int(np.flatnonzero(~np.isfinite(flat))[0]) // shape[-1]
        raise ConfigError(f"cannot quantize to {type_name.upper()}: the tensor of shape {list(shape)} holds NaN or "
                          f"infinity (row {bad}); fix the weights, or keep this tensor in float (skip it)")
    return out.reshape(rows, shape[-1] // K_BLOCK * size)


def dequantize_kquants(data: np.ndarray, type_name: str, *, threads: int | None = None) -> np.ndarray:
    """K-quant super-block bytes (q2_k .. q6_k; uint8 rows of whole super-blocks) back to float32 (rows,
    weights per row), bit for bit as llama.cpp's `to_float` computes them.

    Raises:
        ConfigError: unknown type, or rows that are not whole super-blocks.
        MissingDependencyError: the C extension was not built.
    """
    type_name = type_name.lower()
    if type_name not in K_TYPE_SIZES:
        raise ConfigError(f"unknown K-quant type {type_name!r}; known: {', '.join(K_TYPE_SIZES)}")
    kernels = _k_kernels(f"dequantizing {type_name.upper()}")
    data = np.ascontiguousarray(data, dtype=np.uint8)
    size = K_TYPE_SIZES[type_name]
    if data.ndim == 0 or data.shape[-1] % size:
        raise ConfigError(f"{type_name.upper()} data rows of {list(data.shape)} bytes are not whole {size}-byte "
                          f"super-blocks")
    flat = data.reshape(-1)
    out = np.empty(flat.size // size * K_BLOCK, dtype=np.float32)

    def work(start: int, stop: int) -> bool:
        kernels.kdequantize(type_name, flat[start * size:stop * size], out[start * K_BLOCK:stop * K_BLOCK])
        return True

    in_threads(work, shares(flat.size // size, threads or default_threads(), MIN_SHARE // 8))
    return out.reshape(*data.shape[:-1], data.shape[-1] // size * K_BLOCK)
