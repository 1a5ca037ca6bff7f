"""What every scheme shares: the quantized modules, choosing layers, swapping them in, rebuilding.

A quantized module keeps a QuantizedTensor's parts (packed values, scales, zero points) as
buffers, exactly as stored, and computes on them: Linear and Conv2d through the packed-weight
kernels of fast_linear.py where one reads the layout (int8, int4/gptq, q8_0, q4_0), else by
dequantizing the weight on the fly in `forward`; an Embedding dequantizes only the rows it looks
up. No float copy of a weight stays resident. `checkpoint_entries()` hands the
weight back as that QuantizedTensor, so `Checkpoint.from_module` of a quantized model holds the
quantized weights under their usual names ("fc1.weight") and writers store them natively.
"""
from __future__ import annotations

import copy
import fnmatch
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from modelkit.checkpoint import LazyTensor, QuantizedTensor, TensorEntry, dequantizer
from modelkit.errors import ConfigError
from modelkit.quantizers import fast_linear
from modelkit.quantizers.gguf_arrays import check_skip  # noqa: F401  (one check for every config)

logger = logging.getLogger("modelkit.quantizers")

# Kept in float whatever the scheme: llama.cpp keeps norms (and every 1-D tensor) in F32.
# Only the weights of Linear, Conv2d and Embedding layers are ever quantized, so biases and
# norm weights stay float by construction; these names guard norms written as Linear layers.
DEFAULT_SKIP: tuple[str, ...] = ("*norm*",)

Convert = Callable[[str, nn.Module], "nn.Module | None"]


def log_kept(name: str, reason: str) -> None:
    logger.info("kept %s in float: %s", name or "<model>", reason)


def skipped(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in (*DEFAULT_SKIP, *patterns))


def targets(model: nn.Module, kinds: tuple[type[nn.Module], ...], skip: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """(name, module) of every layer of `kinds` that no skip pattern names, in model order."""
    found = []
    for name, module in model.named_modules():
        if type(module) in kinds:
            if skipped(name, skip):
                log_kept(name, "matches a skip pattern")
            else:
                found.append((name, module))
    return found


def replace(model: nn.Module, config: Any, convert: Convert, *,
            kinds: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d, nn.Embedding)) -> nn.Module:
    """A deep copy of `model` with each target layer replaced by `convert(name, layer)`.

    `convert` returns the new module, or None to keep the layer in float (it logs why).

    Raises:
        ConfigError: no layer could be quantized with this config.
    """
    result = copy.deepcopy(model)
    changed = 0
    for name, module in targets(result, kinds, config.skip):
        new = convert(name, module)
        if new is None:
            continue
        if name:
            result.set_submodule(name, new)
        else:
            result = new
        changed += 1
    if not changed:
        raise ConfigError(f"{config.scheme}: no layer of {type(model).__name__} can be quantized with {config!r} "
                          "(every candidate was skipped or has an incompatible shape; run with -v to see why)")
    from modelkit.quantizers import hf_forward

    return hf_forward.install(result.eval() if not model.training else result)


class QuantizedModule(nn.Module):
    """Base of the quantized layers: the weight's parts as buffers, dequantized on the fly."""

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.scheme = weight.scheme
        self.layout = weight.layout
        self.weight_shape = tuple(weight.shape)
        self.weight_dtype = weight.dtype
        self.params = dict(weight.params)
        self.part_names = tuple(weight.parts)
        for part, lazy in weight.parts.items():
            self.register_buffer(part, lazy.load().detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    def quantized_weight(self) -> QuantizedTensor:
        parts = {part: LazyTensor.of(getattr(self, part)) for part in self.part_names}
        return QuantizedTensor(scheme=self.scheme, layout=self.layout, shape=self.weight_shape,
                               dtype=self.weight_dtype, parts=parts, params=self.params)

    def packed(self) -> fast_linear.Packed | None:
        """The packed-weight kernels' view of the stored parts (None when no kernel reads this layout);
        worked out again only when a part is replaced (`.to()`, `load_state_dict` with assign)."""
        buffers = self._buffers
        cached = self.__dict__.get("_packed")
        if cached is not None and all(buffers[p] is t for p, t in cached[0]) and cached[2] == buffers["qdata"].data_ptr():
            return cached[1]
        parts = {part: buffers[part] for part in self.part_names}
        packed = fast_linear.packed_form(self.layout, self.params, self.weight_shape, parts)
        self.__dict__["_packed"] = (tuple(parts.items()), packed, buffers["qdata"].data_ptr())
        return packed

    def dequantize(self) -> torch.Tensor:
        """The float weight this module computes with."""
        return dequantizer(self.layout)(self.quantized_weight())

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (read-only; for code that inspects `layer.weight`)."""
        return self.dequantize()

    def checkpoint_entries(self) -> dict[str, TensorEntry]:
        """Hook read by Checkpoint.from_module: the weight as its QuantizedTensor, the bias as is."""
        entries: dict[str, TensorEntry] = {"weight": self.quantized_weight()}
        if self.bias is not None:
            entries["bias"] = LazyTensor.of(self.bias)
        return entries

    def extra_repr(self) -> str:
        return f"{self.scheme}, layout={self.layout}, shape={list(self.weight_shape)}"

    def fused_forward(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor | None:
        """`model`'s logits from its whole block stack in one C call (quantizers/fast_forward.py), or None where
        that does not apply. tinylm's forward asks its first product for this (the models layer imports no
        quantizer); any product of the model may answer, the plan checks all of them."""
        from modelkit.quantizers import fast_forward

        return fast_forward.tinylm_logits(model, input_ids)


class QuantizedLinear(QuantizedModule):
    """nn.Linear with a quantized weight: y = x @ dequantize(W).T + b."""

    ROWWISE_ACTIVATIONS: ClassVar[bool] = False     # the fused plans (fast_decode) round its input per block of 32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed() if fast_linear.usable(x) else None
        if packed is not None:
            return fast_linear.matmul(x, packed, self.bias)
        return F.linear(x, self.dequantize().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class QuantizedConv2d(QuantizedModule):
    """nn.Conv2d with a quantized weight (same stride, padding, dilation and groups)."""

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None, *, stride: Any, padding: Any,
                 dilation: Any, groups: int) -> None:
        super().__init__(weight, bias)
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed() if fast_linear.usable(x) and x.ndim == 4 and self.groups == 1 else None
        if packed is not None and not isinstance(self.padding, str):
            return self._unfolded(x, packed)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.conv2d(x, self.dequantize().to(x.dtype), bias, self.stride, self.padding, self.dilation, self.groups)


    def _unfolded(self, x: torch.Tensor, packed: fast_linear.Packed) -> torch.Tensor:
        """The convolution as a product of the packed weight with every input patch (im2col)."""
        kernel = self.weight_shape[2:]
        size = [(n + 2 * p - d * (k - 1) - 1) // s + 1
                for n, p, d, k, s in zip(x.shape[2:], self.padding, self.dilation, kernel, self.stride, strict=True)]
        patches = F.unfold(x, kernel, dilation=self.dilation, padding=self.padding, stride=self.stride)  # (B, C*kh*kw, L)
        y = fast_linear.matmul(patches.transpose(1, 2), packed, self.bias)                            # (B, L, O)
        return y.transpose(1, 2).reshape(x.shape[0], -1, *size)                                       # (B, O, H', W')


class QuantizedEmbedding(QuantizedModule):
    """nn.Embedding with a quantized table (no max_norm or sparse gradients)."""

    def __init__(self, weight: QuantizedTensor, *, padding_idx: int | None = None) -> None:
        super().__init__(weight, None)
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantizes the rows looked up, not the table."""
        flat = ids.reshape(-1)
        rows = self.weight_shape[0]
        parts = {}
        for part in self.part_names:
            stored = getattr(self, part)
            per_row = stored.ndim >= 1 and stored.shape[0] == rows and (part == "qdata" or stored.numel() > 1)
            parts[part] = LazyTensor.of(stored[flat] if per_row else stored)
        picked = QuantizedTensor(scheme=self.scheme, layout=self.layout, shape=(flat.numel(), *self.weight_shape[1:]),
                                 dtype=self.weight_dtype, parts=parts, params=self.params)
        return dequantizer(self.layout)(picked).reshape(*ids.shape, *self.weight_shape[1:])


def quantized_module(module: nn.Module, weight: QuantizedTensor) -> QuantizedModule:
    """The quantized counterpart of a float layer, holding `weight` (and the layer's bias)."""
    bias = getattr(module, "bias", None)
    if isinstance(module, nn.Linear):
        return QuantizedLinear(weight, bias)
    if isinstance(module, nn.Conv2d):
        if module.padding_mode != "zeros":
            raise ConfigError(f"Conv2d with padding_mode={module.padding_mode!r} is not supported; skip it")
        return QuantizedConv2d(weight, bias, stride=module.stride, padding=module.padding, dilation=module.dilation,
                               groups=module.groups)
    if isinstance(module, nn.Embedding):
        if module.max_norm is not None:
            raise ConfigError("Embedding with max_norm is not supported; skip it")
        return QuantizedEmbedding(weight, padding_idx=module.padding_idx)
    raise ConfigError(f"cannot quantize a {type(module).__name__}; only Linear, Conv2d and Embedding")


# scheme -> factory(float layer, weight) for schemes whose layers compute differently from the
# dequantize-on-the-fly default (int8-dynamic's int8 kernels). Filled in by those scheme modules.
SPECIAL_MODULES: dict[str, str] = {"int8-dynamic": "modelkit.quantizers.int8_dynamic:module_for"}


def rebuild(model: nn.Module, entries: dict[str, QuantizedTensor], *, source: str) -> nn.Module:
    """Swap the float layers of a freshly built `model` for quantized ones holding `entries`.

    `entries` maps state_dict names ("fc1.weight") to QuantizedTensors read from a file; each
    must name the weight of a Linear, Conv2d or Embedding of the same shape. Nothing is
    re-quantized: the layer holds the stored parts as they are.
    """
    import importlib

    for name, weight in entries.items():
        owner, _, leaf = name.rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError as e:
            raise ConfigError(f"{source}: quantized tensor {name!r} names no layer of the model") from e
        float_weight = getattr(module, leaf, None)
        if leaf != "weight" or not isinstance(float_weight, torch.Tensor):
            raise ConfigError(f"{source}: quantized tensor {name!r} is not the weight of a layer")
        if tuple(float_weight.shape) != tuple(weight.shape):
            raise ConfigError(f"{source}: {name} is {list(weight.shape)}, the model expects {list(float_weight.shape)}")
        special = SPECIAL_MODULES.get(weight.scheme)
        if special is not None:
            module_name, attribute = special.split(":")
            new = getattr(importlib.import_module(module_name), attribute)(module, weight)
        else:
            new = quantized_module(module, weight)
        if owner:
            model.set_submodule(owner, new)
        else:
            model = new
    from modelkit.quantizers import hf_forward

    return hf_forward.install(model)
