"""int8-dynamic: int8 weights and dynamically quantized int8 activations for Linear layers on CPU.

Weights are int8 with one float32 scale per output channel (the same "affine" layout as
`int8`). At run time each input row (token) gets its own scale, max|x| / 127, is rounded to
int8, and the product runs as an int8 x int8 -> int32 matrix multiply (`torch._int_mm`, oneDNN
with VNNI/AMX where the CPU has them), then is scaled back: y = (xq @ wq.T) * sx * sw + b.
Faster than float32 for large layers, not only smaller (bench/quantize.py measures it).

Built on `torch._int_mm`, not `torch.ao.quantization`, which torch 2.13 marks deprecated and
scheduled for removal. Conv2d and Embedding layers are left in float by this scheme.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from modelkit.checkpoint import QuantizedTensor
from modelkit.errors import ConfigError
from modelkit.quantizers import _affine, _modules, fast_linear

SPEC = _affine.AffineSpec(bits=8, group_size=None, symmetric=True, scale_dtype=torch.float32)
# Weights up to which, with at most 64 activation rows, the packed-weight kernel (the same per-row int8
# activations) runs instead of torch._int_mm, whose fixed cost loses to float on small layers (tinylm's: 0.93x -> 0.75x float at batch 1,
# bench/infer.py; 256 x 768 at batch 1: 1.3-1.7x float with _int_mm, 1.1x with the kernel).
SMALL_WEIGHT = 1 << 18


@dataclass(frozen=True, kw_only=True)
class Int8DynamicConfig:
    """int8 weights (per output channel, symmetric) and per-row dynamic int8 activations for Linear.

    Args:
        skip: fnmatch patterns of module names left in float, e.g. ("lm_head",).

    Example:
        >>> from modelkit.models import build
        >>> q = apply(build("mlp", seed=0), Int8DynamicConfig())
        >>> type(q.net[0]).__name__
        'DynamicInt8Linear'
    """

    scheme: ClassVar[str] = "int8-dynamic"
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _modules.check_skip(self)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (M, K) float -> (M, K) int8 and (M, 1) float32 scales."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True).clamp_(min=1e-12).div_(127)
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel sees of x, in float (for QAT); no gradient through it."""
    q, scale = quantize_rows(x.detach())
    return (q.float() * scale).to(x.dtype)


class DynamicInt8Linear(_modules.QuantizedModule):
    """Linear with int8 weights whose inputs are quantized to int8 per row at each call."""

    ROWWISE_ACTIVATIONS: ClassVar[bool] = True      # the fused plans (fast_decode) round its input per row too

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None = None) -> None:
        if weight.layout != "affine" or int(weight.params.get("bits", 0)) != 8 or weight.parts["scale"].shape[0] != weight.shape[0]:
            raise ConfigError("int8-dynamic needs per-channel symmetric int8 weights (affine layout, bits 8)")
        super().__init__(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":       # the int8 kernel path is for CPU; elsewhere compute in float
            return F.linear(x, self.dequantize().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        shape = x.shape
        packed = self.packed() if fast_linear.usable(x) else None
        if packed is not None and packed.rows * packed.cols <= SMALL_WEIGHT and x.numel() <= 64 * packed.cols:
            # small layers, few rows: torch._int_mm's fixed cost dominates
            return fast_linear.matmul(x, packed, self.bias, rowwise=True)
        xq, sx = quantize_rows(x.reshape(-1, shape[-1]))                        # (M, K) int8, (M, 1)
        acc = torch._int_mm(xq, self.qdata.t())                                  # (M, N) int32
        y = acc.float().mul_(sx).mul_(self.scale.view(1, -1))
        if self.bias is not None:
            y.add_(self.bias.float())
        return y.to(x.dtype).reshape(*shape[:-1], -1)                            # (..., N)


def module_for(layer: nn.Module, weight: QuantizedTensor) -> nn.Module:
    """Rebuild hook (see _modules.SPECIAL_MODULES): the int8 kernel layer for a stored weight."""
    if not isinstance(layer, nn.Linear):
        raise ConfigError(f"int8-dynamic weights belong to Linear layers, not {type(layer).__name__}")
    return DynamicInt8Linear(weight, layer.bias)


def apply(model: nn.Module, config: Int8DynamicConfig) -> nn.Module:
    """Return a copy of `model` whose Linear layers run int8 x int8 products; the input is left unchanged."""

    def convert(name: str, module: nn.Module) -> nn.Module | None:
        weight = _affine.quantized_tensor(module.weight, SPEC, scheme=config.scheme)
        return DynamicInt8Linear(weight, module.bias)

    return _modules.replace(model, config, convert, kinds=(nn.Linear,))
