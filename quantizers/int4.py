"""Weight-only int4: one fp16 scale (and zero point if asymmetric) per group of input columns.

Values are packed two per byte, low nibble first; groups run along the input dimension of each
output row (for a conv, along in_channels x kh x kw). Round-to-nearest; `gptq` finds better
values for the same layout. Layers whose input width is not a multiple of the group size stay
in float (logged), as llama.cpp keeps tensors that do not fit its blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from modelkit.errors import ConfigError
from modelkit.quantizers import _affine, _modules
from modelkit.quantizers.int8 import weight_only

GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, kw_only=True)
class Int4Config:
    """Quantize Linear, Conv2d and Embedding weights to 4 bits in groups along the input dimension.

    Args:
        group_size: Input columns that share one scale: 32, 64 or 128. Smaller is more accurate
            and larger on disk (16 bits of scale per group: 0.5 extra bits per weight at 32).
        symmetric: Range [-8, 7] if True, else 0..15 with a zero point per group.
        skip: fnmatch patterns of module names left in float, e.g. ("lm_head",).

    Example:
        >>> from modelkit.models import build
        >>> q = apply(build("cnn", seed=0), Int4Config(group_size=32))
        >>> q.fc1.qdata.shape           # 1024 inputs -> 512 bytes per row
        torch.Size([128, 512])
    """

    scheme: ClassVar[str] = "int4"
    group_size: int = 32
    symmetric: bool = True
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise ConfigError(f"int4: group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size!r}")
        if not isinstance(self.symmetric, bool):
            raise ConfigError(f"int4: symmetric must be true or false, got {self.symmetric!r}")
        _modules.check_skip(self)

    @property
    def spec(self) -> _affine.AffineSpec:
        return _affine.AffineSpec(bits=4, group_size=self.group_size, symmetric=self.symmetric,
                                  scale_dtype=torch.float16)


def apply(model: nn.Module, config: Int4Config) -> nn.Module:
    """Return a copy of `model` with int4 weights (round to nearest); the input model is left unchanged."""
    return weight_only(model, config.spec, config, scheme=config.scheme)
