"""fp16 and bf16: store Linear, Conv2d and Embedding weights in 16 bits, compute in the input's dtype.

Half the float32 size. Weights are kept in 16 bits (a plain tensor in the Checkpoint, so every
format stores them) and cast up on the fly; biases and norms stay float32, as with every scheme.
Loading such a file into the float model is exact: every 16-bit value is a float32 value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from modelkit.checkpoint import LazyTensor, TensorEntry
from modelkit.errors import ConfigError
from modelkit.quantizers import _modules


@dataclass(frozen=True, kw_only=True)
class Fp16Config:
    """Cast weights to IEEE half precision (float16: 10 stored mantissa bits, range up to 65504).

    Args:
        skip: fnmatch patterns of module names left in float32.

    Example:
        >>> from modelkit.models import build
        >>> apply(build("mlp", seed=0), Fp16Config()).net[0].stored.dtype
        torch.float16
    """

    scheme: ClassVar[str] = "fp16"
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _modules.check_skip(self)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16


@dataclass(frozen=True, kw_only=True)
class Bf16Config(Fp16Config):
    """Cast weights to bfloat16 (7 stored mantissa bits, float32's range).

    Args:
        skip: fnmatch patterns of module names left in float32.
    """

    scheme: ClassVar[str] = "bf16"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16


class CastModule(nn.Module):
    """A layer whose weight is stored in 16 bits and cast to the input's dtype for each call."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        # forward() below computes what these layers compute only with their default options
        if getattr(layer, "padding_mode", "zeros") != "zeros":
            raise ConfigError(f"Conv2d with padding_mode={layer.padding_mode!r} is not supported; skip it")
        if getattr(layer, "max_norm", None) is not None:
            raise ConfigError("Embedding with max_norm is not supported; skip it")
        self.kind = type(layer)
        self.register_buffer("stored", layer.weight.detach().to(dtype).clone())
        bias = getattr(layer, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.options = {k: getattr(layer, k) for k in ("stride", "padding", "dilation", "groups", "padding_idx")
                        if hasattr(layer, k)}

    @property
    def weight(self) -> torch.Tensor:
        return self.stored.float()

    def checkpoint_entries(self) -> dict[str, TensorEntry]:
        entries: dict[str, TensorEntry] = {"weight": LazyTensor.of(self.stored)}
        if self.bias is not None:
            entries["bias"] = LazyTensor.of(self.bias)
        return entries

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is nn.Embedding:
            return F.embedding(x, self.stored.float(), self.options.get("padding_idx"))
        w = self.stored.to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        if self.kind is nn.Conv2d:
            o = self.options
            return F.conv2d(x, w, b, o["stride"], o["padding"], o["dilation"], o["groups"])
        return F.linear(x, w, b)


def apply(model: nn.Module, config: Fp16Config) -> nn.Module:
    """Return a copy of `model` whose layer weights are stored in `config.dtype`."""

    def convert(name: str, module: nn.Module) -> nn.Module | None:
        return CastModule(module, config.dtype)

    return _modules.replace(model, config, convert)
