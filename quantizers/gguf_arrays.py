"""GGUF block types on numpy arrays: the configs, the block geometry and `quantize_array`, without torch.

Weight files become GGUF block types here without building a model or importing torch
(`modelkit quantize weights.safetensors out.gguf --scheme q4_0`): the C kernels of
_gguf_kernels.c quantize each tensor in place of gguf-py's numpy reference, which is the
fallback where the extension was not built (same bytes, slower). `gguf_blocks.py` holds the
torch side: quantized layers, the eager-torch reference and dequantization.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from modelkit.errors import ConfigError

try:
    from modelkit.quantizers import _gguf_kernels
except ImportError:                 # installed without a C compiler: gguf-py (numpy) or eager torch
    _gguf_kernels = None

BLOCK = 32                  # weights per block for every type here (QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0)
MIN_SHARE = 2**16           # blocks per thread at least (2 MiB of float32): smaller tensors run on one thread
# Block type -> bytes per block of BLOCK weights (ggml's type sizes).
TYPE_SIZES: dict[str, int] = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}
KERNEL_ISAS: tuple[str, ...] = tuple(_gguf_kernels.ISAS) if _gguf_kernels else ()
# The configs live here (torch-free); `apply` to a module is torch's, in gguf_blocks (schemes.scheme_module).
APPLY_MODULE = "modelkit.quantizers.gguf_blocks"


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
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_skip(self)


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
    if type_name not in TYPE_SIZES:
        raise ConfigError(f"unknown GGUF block type {type_name!r}; known: {', '.join(TYPE_SIZES)}")
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
