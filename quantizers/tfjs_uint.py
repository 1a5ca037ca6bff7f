"""tfjs-uint8 and tfjs-uint16: TensorFlow.js's own quantized weights, one min and scale per weight.

What `tensorflowjs_converter --quantize_uint8` (or `--quantize_uint16`) stores: each float weight of a
Layers model (kernels, biases, norms: every one) as unsigned codes with a per-weight affine range in
the manifest, `"quantization": {"dtype": "uint8", "min": m, "scale": s, "original_dtype": "float32"}`.
TF.js decodes `code * scale + min` in double precision into float32 as it loads the model
(tfjs-core io_utils.ts), so the model TF.js runs is the float model with those decoded weights; the
file is about a quarter (uint8) or half (uint16) of the float32 one.

The range follows tensorflowjs's quantization.py (TF-Lite's nudging): scale = (max - min) / (2^bits - 1);
when the weight's range covers zero, min is nudged to -round(-min / scale) * scale so that 0.0 is a code
exactly (zero padding stays zero); a constant weight is all zeros with scale 1 and min its value.
Written by `modelkit quantize SRC DIR/model.json --scheme tfjs-uint8` (modelkit.pipeline.quantize);
numpy only, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from modelkit.errors import ConfigError

LAYOUT = "tfjs"                 # the QuantizedTensor layout: parts {"qdata"}, params {"dtype", "min", "scale"}


@dataclass(frozen=True, kw_only=True)
class TfjsUint8Config:
    """Every float weight as 8-bit codes with its own min and scale, as TensorFlow.js stores them.

    Args:
        skip: fnmatch patterns of state_dict names (or their module names) kept in float32.

    Example:
        >>> from modelkit.storage.tensors import decode_tfjs_codes
        >>> codes, low, scale = quantize_array(np.array([-1.0, 0.0, 2.0], np.float32), 8)
        >>> codes.tolist(), decode_tfjs_codes(codes, low, scale).tolist()
        ([0, 85, 255], [-1.0, 0.0, 2.0])
    """

    scheme: ClassVar[str] = "tfjs-uint8"
    bits: ClassVar[int] = 8
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "skip", tuple(self.skip) if isinstance(self.skip, (list, tuple)) else self.skip)
        if not isinstance(self.skip, tuple) or not all(isinstance(p, str) for p in self.skip):
            raise ConfigError(f"{self.scheme}: skip is a list of fnmatch patterns, got {self.skip!r}")


@dataclass(frozen=True, kw_only=True)
class TfjsUint16Config(TfjsUint8Config):
    """Every float weight as 16-bit codes with its own min and scale (half the float32 size; TfjsUint8Config).

    Args:
        skip: fnmatch patterns of state_dict names (or their module names) kept in float32.
    """

    scheme: ClassVar[str] = "tfjs-uint16"
    bits: ClassVar[int] = 16


def affine_range(values: np.ndarray, bits: int) -> tuple[float, float]:
    """(min, scale) of a float array's codes: TF.js decodes code * scale + min."""
    data = np.asarray(values)
    if data.size and not np.isfinite(data).all():
        raise ConfigError("the weight holds NaN or infinity, which a min and scale cannot encode")
    low, high = (float(data.min()), float(data.max())) if data.size else (0.0, 0.0)
    if low == high:
        return low, 1.0
    scale = (high - low) / _top(bits)
    if low <= 0.0 <= high:                              # 0.0 becomes a code exactly
        low = -float(np.round(-low / scale)) * scale
    return low, scale


def encode(values: np.ndarray, bits: int, low: float, scale: float) -> np.ndarray:
    """The codes of `values` in the range affine_range gave (uint8 for bits 8, uint16 for bits 16)."""
    stored = np.uint8 if bits == 8 else np.uint16
    if scale == 1.0 and np.all(values == low):         # a constant weight: all zeros
        return np.zeros(np.shape(values), stored)
    high = _top(bits) * scale + low
    return np.round((np.clip(np.asarray(values, np.float64), low, high) - low) / scale).astype(stored)


def quantize_array(values: np.ndarray, bits: int) -> tuple[np.ndarray, float, float]:
    """(codes, min, scale) of a float array."""
    low, scale = affine_range(values, bits)
    return encode(values, bits, low, scale), low, scale


def _top(bits: int) -> float:
    return float((1 << bits) - 1)


def apply(model: Any, config: TfjsUint8Config) -> Any:
    raise ConfigError(f"{config.scheme} is TensorFlow.js's weight encoding, not a layer change: write the model with "
                      f"`modelkit quantize SRC DIR/model.json --scheme {config.scheme}`")
