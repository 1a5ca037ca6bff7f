"""Weight-only int8: one scale per output channel (or per tensor), symmetric or with a zero point.

Linear, Conv2d and Embedding weights become int8 values plus float32 scales (checkpoint.py's
"affine" layout, bits 8); layers dequantize them on the fly, so activations stay float. A
quarter of the float32 size with near-float accuracy: the safe first choice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from modelkit.errors import ConfigError
from modelkit.quantizers import _affine, _modules


@dataclass(frozen=True, kw_only=True)
class Int8Config:
    """Quantize weights to int8.

    Args:
        per_channel: One scale per output channel (row) if True, else one for the whole tensor.
        symmetric: Range [-128, 127] around zero if True, else asymmetric with an int8 zero point.
        skip: fnmatch patterns of module names left in float, e.g. ("fc2", "lm_head").

    Example:
        >>> from modelkit.models import build
        >>> q = apply(build("mlp", seed=0), Int8Config())
        >>> q.net[0].qdata.dtype
        torch.int8
    """

    scheme: ClassVar[str] = "int8"
    per_channel: bool = True
    symmetric: bool = True
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("per_channel", "symmetric"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"int8: {name} must be true or false, got {getattr(self, name)!r}")
        _modules.check_skip(self)

    @property
    def spec(self) -> _affine.AffineSpec:
        return _affine.AffineSpec(bits=8, group_size=None if self.per_channel else 0, symmetric=self.symmetric,
                                  scale_dtype=torch.float32)


def apply(model: nn.Module, config: Int8Config) -> nn.Module:
    """Return a copy of `model` with int8 weights; the input model is left unchanged."""
    return weight_only(model, config.spec, config, scheme=config.scheme)


def weight_only(model: nn.Module, spec: _affine.AffineSpec, config: object, *, scheme: str,
                kinds: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d, nn.Embedding)) -> nn.Module:
    """Round-to-nearest affine quantization of every target layer's weight (int8 and int4 share it)."""

    def convert(name: str, module: nn.Module) -> nn.Module | None:
        reason = spec.fits(tuple(module.weight.shape))
        if reason is not None:
            _modules.log_kept(name, reason)
            return None
        return _modules.quantized_module(module, _affine.quantized_tensor(module.weight, spec, scheme=scheme))

    return _modules.replace(model, config, convert, kinds=kinds)
