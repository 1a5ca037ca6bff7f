"""GGUF block types on numpy arrays: the configs, the block geometry, `quantize_array` and the K-quants, without torch.

Weight files become GGUF block types here without building a model or importing torch
(`modelkit quantize weights.safetensors out.gguf --scheme q4_0`): the C kernels of
_gguf_kernels.c quantize each tensor in place of gguf-py's numpy reference, which is the
fallback where the extension was not built (same bytes, slower). `gguf_blocks.py` holds the
torch side: quantized layers, the eager-torch reference and dequantization.

K-quants (super-blocks of 256 weights, _gguf_kernels_kquants.h): q2_k..q6_k quantize byte-identical
to llama.cpp's `ggml_quantize_chunk` (`quantize_kquants`) and dequantize bit-identical to its
`to_float` (`dequantize_kquants`); so do IQ4_NL and IQ4_XS (a fixed table of 16 non-linear levels,
_gguf_kernels_imatrix.h). They need the extension: gguf-py has no quantizer for them to fall back on.

Importance matrices (`importance=`, one float per column of the rows: llama.cpp's imatrix entry for
the weight, see modelkit.quantizers.imatrix): every type but q8_0 then quantizes as
`ggml_quantize_chunk(..., imatrix)` does, byte for byte (the weighted kernels need the extension;
q8_0 ignores the importance, as llama.cpp does).
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
# IQ4 type -> (weights per block, bytes per block): 16 non-linear levels (kvalues_iq4nl) per 4-bit index.
IQ_TYPES: dict[str, tuple[int, int]] = {"iq4_nl": (32, 18), "iq4_xs": (256, 136)}
# Every type the block kernels (kquantize) take: K-quants and IQ4 -> (weights per block, bytes per block).
KERNEL_TYPES: dict[str, tuple[int, int]] = {**{k: (K_BLOCK, v) for k, v in K_TYPE_SIZES.items()}, **IQ_TYPES}
# llama.cpp's type for a tensor whose rows are not whole super-blocks (llama-quant.cpp's tensor_type_fallback).
K_FALLBACK: dict[str, str] = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0",
                              "iq4_xs": "iq4_nl"}
KERNEL_ISAS: tuple[str, ...] = tuple(_gguf_kernels.ISAS) if _gguf_kernels else ()
# The configs live here (torch-free); `apply` to a module is torch's, in gguf_blocks (schemes.scheme_module).
APPLY_MODULE = "modelkit.quantizers.gguf_blocks"


def block_weights(type_name: str) -> int:
    """Weights per block of `type_name` (32, or 256 for the K-quants and IQ4_XS)."""
    return KERNEL_TYPES[type_name][0] if type_name in KERNEL_TYPES else BLOCK


def row_type(type_name: str, row: int) -> str | None:
    """The type a row of `row` weights is stored as under `type_name`: itself when the rows are whole
    blocks, llama.cpp's fallback for a K type whose rows are not whole super-blocks, None if neither fits."""
    if row % block_weights(type_name) == 0:
        return type_name
    fallback = K_FALLBACK.get(type_name)
    return fallback if fallback is not None and row % BLOCK == 0 else None


def row_bytes(type_name: str, row: int) -> int:
    """Bytes of one row of `row` weights as `type_name` blocks."""
    size = KERNEL_TYPES[type_name][1] if type_name in KERNEL_TYPES else TYPE_SIZES[type_name]
    return row // block_weights(type_name) * size


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
        imatrix: path of a llama.cpp importance-matrix file (GGUF or legacy .dat form): each weight it
            has an entry for (by its GGUF name) is quantized under it, as llama-quantize --imatrix does;
            weights it lacks are quantized without one (logged). q8_0 ignores it, as llama.cpp does.

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
    imatrix: str | None = None

    def __post_init__(self) -> None:
        check_skip(self)
        if self.imatrix is not None and (not isinstance(self.imatrix, str) or not self.imatrix):
            raise ConfigError(f"imatrix must be the path of an importance-matrix file, got {self.imatrix!r}")

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
    float (logged). `imatrix` as for BlockConfig. (llama-quantize's Q3_K, Q4_K and Q5_K are its _M recipes:
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
class IQ4_NLConfig(BlockConfig):
    """Quantize every Linear and Embedding weight to llama.cpp's IQ4_NL: blocks of 32 weights, one fp16 scale
    and a 4-bit index per weight into a fixed table of 16 non-linear levels (4.5 bits per weight).

    Rows that are not whole 32-weight blocks stay in float (logged). `imatrix` as for BlockConfig.
    """

    scheme: ClassVar[str] = "iq4_nl"


@dataclass(frozen=True, kw_only=True)
class IQ4_XSConfig(BlockConfig):
    """Quantize every Linear and Embedding weight to llama.cpp's IQ4_XS: super-blocks of 256 weights, one fp16
    scale, a 6-bit scale per block of 32 and IQ4_NL's 16 non-linear levels (4.25 bits per weight).

    Rows that are not whole super-blocks are stored as IQ4_NL when they are whole 32-weight blocks (llama.cpp's
    fallback), otherwise kept in float (logged). `imatrix` as for BlockConfig.
    """

    scheme: ClassVar[str] = "iq4_xs"


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


def quantize_array(values: np.ndarray, type_name: str, *, threads: int | None = None,
                   importance: np.ndarray | None = None) -> np.ndarray:
    """Quantize a float array to GGUF blocks along its last dimension: the bytes gguf-py's
    `gguf.quants.quantize` gives (llama.cpp's `ggml_quantize_chunk` for the K-quants and IQ4, and
    for every type under `importance`), as uint8 (rows, bytes per row) with rows = all leading dimensions.

    Args:
        importance: None, or one float per column (the last dimension): llama.cpp's importance
            matrix entry for this weight. q8_0 ignores it, as llama.cpp does.

    Raises:
        ConfigError: the last dimension is not a multiple of the block, the type is unknown, the
            importance does not fit the rows, or the array holds NaN or infinity.
    """
    type_name = type_name.lower()
    if type_name in KERNEL_TYPES:
        return quantize_kquants(values, type_name, threads=threads, importance=importance)
    if type_name not in TYPE_SIZES:
        raise ConfigError(f"unknown GGUF block type {type_name!r}; known: {', '.join((*TYPE_SIZES, *KERNEL_TYPES))}")
    shape = values.shape
    if not shape or shape[-1] % BLOCK:
        raise ConfigError(f"cannot quantize a tensor of shape {list(shape)} to {type_name}: its rows must be "
                          f"whole {BLOCK}-weight blocks")
    if importance is not None and type_name != "q8_0":
        return _quantize_weighted(values, type_name, importance, threads)
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
    raise _non_finite(type_name, shape, flat)


def _non_finite(type_name: str, shape: tuple[int, ...], flat: np.ndarray) -> ConfigError:
    bad = int(np.flatnonzero(~np.isfinite(flat))[0]) // shape[-1]
    return ConfigError(f"cannot quantize to {type_name.upper()}: the tensor of shape {list(shape)} holds NaN or "
                       f"infinity (row {bad}); fix the weights, or keep this tensor in float (skip it)")


def _importance(importance: np.ndarray, shape: tuple[int, ...], type_name: str) -> np.ndarray:
    weights = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
    if weights.size != shape[-1]:
        raise ConfigError(f"the importance matrix entry has {weights.size} values but the rows of {list(shape)} have "
                          f"{shape[-1]}: it was computed for another model")
    if not np.isfinite(weights).all():
        raise ConfigError(f"cannot quantize to {type_name.upper()}: the importance matrix entry holds NaN or infinity")
    return weights


def _quantize_weighted(values: np.ndarray, type_name: str, importance: np.ndarray, threads: int | None) -> np.ndarray:
    """q4_0, q4_1, q5_0, q5_1 under an importance matrix: whole rows per thread (the row's mean square
    weighs every block)."""
    kernels = _k_kernels(f"quantizing to {type_name.upper()} with an importance matrix")
    shape = values.shape
    weights = _importance(importance, shape, type_name)
    rows, row = math.prod(shape[:-1]), shape[-1]
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    size = row // BLOCK * TYPE_SIZES[type_name]
    out = np.empty(rows * size, dtype=np.uint8)

    def work(start: int, stop: int) -> bool:
        return kernels.wquantize(type_name, flat[start * row:stop * row], out[start * size:stop * size], weights) < 0

    if not in_threads(work, shares(rows, threads or default_threads(), max(1, MIN_SHARE * BLOCK // row))):
        raise _non_finite(type_name, shape, flat)
    return out.reshape(rows, size)


def _k_kernels(what: str) -> Any:
    if _gguf_kernels is None:
        raise MissingDependencyError(f"{what} needs modelkit's compiled GGUF kernels (reinstall modelkit where a C "
                                     f"compiler is found)")
    return _gguf_kernels


def quantize_kquants(values: np.ndarray, type_name: str, *, threads: int | None = None,
                     importance: np.ndarray | None = None) -> np.ndarray:
    """Quantize a float array to K-quant super-blocks (q2_k .. q6_k) or IQ4 blocks (iq4_nl, iq4_xs) along its
    last dimension: the bytes llama.cpp's `ggml_quantize_chunk` writes (under `importance`, one float per
    column, when given), as uint8 (rows, bytes per row). float16 input is widened to float32 (exactly) by
    the kernels, a block at a time, in the worker threads. The kernels are the best of KERNEL_ISAS (avx2 where
    the CPU has it, otherwise the portable ones; the same bytes).

    Raises:
        ConfigError: the last dimension is not whole blocks, the importance does not fit, or the array holds
            NaN or infinity.
        MissingDependencyError: the C extension was not built.
    """
    kernels = _k_kernels(f"quantizing to {type_name.upper()}")
    shape = values.shape
    block, size = KERNEL_TYPES[type_name]
    if not shape or shape[-1] % block:
        fallback = K_FALLBACK.get(type_name)
        stored = f" (llama.cpp stores such a tensor as {fallback.upper()})" if fallback else ""
        raise ConfigError(f"cannot quantize a tensor of shape {list(shape)} to {type_name.upper()}: its rows must be "
                          f"whole {block}-weight {'super-blocks' if block == K_BLOCK else 'blocks'}{stored}")
    weights = None if importance is None else _importance(importance, shape, type_name)
    rows = math.prod(shape[:-1])
    # float16 is widened by the kernels, a block at a time (no float32 copy of the tensor, no serial pass)
    half = values.dtype == np.float16
    flat = np.ascontiguousarray(values, dtype=np.float16 if half else np.float32).reshape(-1)
    out = np.empty(flat.size // block * size, dtype=np.uint8)

    def work(start: int, stop: int) -> bool:
        return kernels.kquantize(type_name, flat[start * block:stop * block], out[start * size:stop * size],
                                 weights, None, half) < 0

    # a super-block costs ~40x a 32-weight block: shares of 2**12 super-blocks are worth a thread; under an
    # importance matrix the shares start on rows (the weights are per column)
    step = 1 if weights is None else shape[-1] // block
    if not in_threads(work, shares(flat.size // block, threads or default_threads(), 2**12 * K_BLOCK // block, step)):
        raise _non_finite(type_name, shape, flat)
    return out.reshape(rows, shape[-1] // block * size)


def dequantize_kquants(data: np.ndarray, type_name: str, *, threads: int | None = None) -> np.ndarray:
    """K-quant super-block bytes (q2_k .. q6_k) or IQ4 blocks (iq4_nl, iq4_xs; uint8 rows of whole blocks) back
    to float32 (rows, weights per row), bit for bit as llama.cpp's `to_float` computes them.

    Raises:
        ConfigError: unknown type, or rows that are not whole blocks.
        MissingDependencyError: the C extension was not built.
    """
    type_name = type_name.lower()
    if type_name not in KERNEL_TYPES:
        raise ConfigError(f"unknown K-quant or IQ4 type {type_name!r}; known: {', '.join(KERNEL_TYPES)}")
    kernels = _k_kernels(f"dequantizing {type_name.upper()}")
    data = np.ascontiguousarray(data, dtype=np.uint8)
    block, size = KERNEL_TYPES[type_name]
    if data.ndim == 0 or data.shape[-1] % size:
        raise ConfigError(f"{type_name.upper()} data rows of {list(data.shape)} bytes are not whole {size}-byte "
                          f"{'super-blocks' if block == K_BLOCK else 'blocks'}")
    flat = data.reshape(-1)
    out = np.empty(flat.size // size * block, dtype=np.float32)

    def work(start: int, stop: int) -> bool:
        kernels.kdequantize(type_name, flat[start * size:stop * size], out[start * block:stop * block])
        return True

    in_threads(work, shares(flat.size // size, threads or default_threads(), MIN_SHARE // 8 * K_BLOCK // block))
    return out.reshape(*data.shape[:-1], data.shape[-1] // size * block)
