"""A user's torch Sequential as the Keras Sequential it equals (the HDF5 converter's `.weights.h5`).

`keras_layout(module, example)` walks an nn.Sequential (nested Sequentials are flattened) layer by
layer, running each on the example input to know its shapes, and returns the `KerasLayout` the
zoo's models declare by hand (modelkit.models.plugin): Keras layers with their config and the
torch tensors that fill their variables. The first layer with no Keras counterpart is named in
the error. Only a Sequential is mapped: a module with a `forward` of its own runs code (residual
adds, reshapes) that no list of its layers shows.

The table (torch -> Keras 3, channels_last):

    Linear                 Dense (kernel transposed; after a Flatten of a feature map, its rows reordered)
    Conv1d, Conv2d         Conv1D, Conv2D (kernel (out, in, *k) -> (*k, in, out)); padding 0 -> "valid",
                           stride 1 with padding (k - 1) * dilation / 2 -> "same"; zeros padding only
    BatchNorm1d, 2d        BatchNormalization over the channel axis (momentum 1 - torch's)
    LayerNorm              LayerNormalization over the last axis (one normalized dimension)
    Embedding              Embedding (no max_norm)
    Dropout                Dropout
    MaxPool1d/2d, AvgPool1d/2d   MaxPooling1D/2D, AveragePooling1D/2D (no padding, dilation or ceil_mode)
    Flatten                Flatten (start_dim 1, end_dim -1)
    ReLU, GELU, Sigmoid, Tanh    Activation("relu" | "gelu" | "sigmoid" | "tanh"); GELU exact (erf) only
    Softmax                Softmax over the same axis
    Identity               nothing

Layout: torch keeps channels at axis 1, Keras last. A model whose first layer is a convolution,
pooling or batch norm takes (B, C, *spatial) in torch and (B, *spatial, C) in Keras; its feature
maps stay so until a Flatten, whose next Dense gets its kernel rows reordered. Other models
(Dense stacks, Embedding -> LayerNorm -> Dense on (B, L, D)) have the same shapes in both.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelkit.errors import ConfigError
from modelkit.models.plugin import KERAS_CLASSES, KerasLayer, KerasLayout, KerasWeight

if TYPE_CHECKING:
    import torch
    from torch import nn

_ACTIVATIONS = {"ReLU": "relu", "GELU": "gelu", "Sigmoid": "sigmoid", "Tanh": "tanh"}
_CHANNEL_LAYERS = ("Conv1d", "Conv2d", "MaxPool1d", "MaxPool2d", "AvgPool1d", "AvgPool2d", "BatchNorm1d", "BatchNorm2d")


# The torch layers the table maps (by class name), for naming the first one a model holds that it does not.
MAPPED_LAYERS = frozenset({"Linear", "Conv1d", "Conv2d", "BatchNorm1d", "BatchNorm2d", "LayerNorm", "Embedding", "Dropout",
                           "MaxPool1d", "MaxPool2d", "AvgPool1d", "AvgPool2d", "Flatten", "Softmax", "Identity",
                           *_ACTIVATIONS})


def first_unmapped(module: nn.Module) -> str | None:
    """Why `module` is no stack of Keras layers, naming the first layer the table lacks
    ("layer model.layers.0.input_layernorm (RMSNorm) has no Keras counterpart"), or None when every layer has one."""
    for name, layer in module.named_modules():
        if not any(True for _ in layer.children()) and type(layer).__name__ not in MAPPED_LAYERS:
            return f"layer {name or type(module).__name__} ({type(layer).__name__}) has no Keras counterpart"
    return None


class NoKerasCounterpart(ConfigError):
    """A layer (or the module's shape) has no Keras equivalent in modelkit's table."""


@dataclass
class _State:
    """Where the walk is: the torch tensor now, whether its channels sit at axis 1 (torch) where
    Keras has them last, and the (C, H, W) of a feature map flattened since the last Dense."""

    x: Any
    channels_first: bool
    flattened: tuple[int, int, int] | None = None


def keras_layout(module: nn.Module, example: tuple[Any, ...] | None = None) -> KerasLayout:
    """The Keras Sequential `module` equals, with the example input's shape (or a first Linear's width).

    Raises:
        NoKerasCounterpart: `module` is not an nn.Sequential, a layer has no Keras counterpart
            (the first one is named), or the input shape is unknown.
    """
    import torch

    layers = list(_leaves(module, ""))
    if not layers:
        raise NoKerasCounterpart(f"{type(module).__name__} has no layers to map to Keras")
    x = _example(layers, example)
    channels_last = x.dim() >= 3 and type(layers[0][1]).__name__ in _CHANNEL_LAYERS
    state = _State(x, channels_first=channels_last)
    input_shape = _keras_shape(x, channels_last)
    out: list[KerasLayer] = []
    unmapped: list[str] = []
    with torch.no_grad():
        for prefix, layer in layers:
            mapped = _map(prefix, layer, state, unmapped)
            if mapped is not None:
                out.append(mapped)
            state.x = layer(state.x)
    dtype = "int32" if not x.is_floating_point() else "float32"
    described = ", ".join([f"Input({input_shape}{', dtype=' + repr(dtype) if dtype != 'float32' else ''})",
                           *(_describe(layer) for layer in out)])
    note = " channels_last: inputs go in as (B, *spatial, C)" if channels_last else ""
    return KerasLayout(tuple(out), f"Sequential([{described}]){note}", input_shape, dtype, tuple(unmapped))


def _leaves(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    """(state_dict prefix, layer) of a Sequential in the order it runs them; nested Sequentials flattened."""
    from torch import nn

    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        raise NoKerasCounterpart(
            f"{type(module).__name__}{' (' + prefix.rstrip('.') + ')' if prefix else ''} is not an nn.Sequential: "
            "its forward is code of its own, which modelkit does not map to Keras layers")
    for name, child in module.named_children():
        if isinstance(child, nn.Sequential):
            yield from _leaves(child, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}.", child


def _example(layers: list[tuple[str, nn.Module]], example: tuple[Any, ...] | None) -> torch.Tensor:
    import torch

    if example:
        if len(example) != 1 or not isinstance(example[0], torch.Tensor):
            raise NoKerasCounterpart("a Keras Sequential takes one input tensor; give exactly one example input")
        return example[0][:1]
    first = layers[0][1]
    if isinstance(first, torch.nn.Linear):
        return torch.zeros(1, first.in_features, dtype=first.weight.dtype, device=first.weight.device)
    raise NoKerasCounterpart(f"the input shape of {type(first).__name__} ({layers[0][0].rstrip('.')}) is not in "
                             "its weights; give an example input (--input-shape, API: example_inputs=)")


def _keras_shape(x: torch.Tensor, channels_first: bool) -> tuple[int, ...]:
    shape = tuple(x.shape[1:])
    return (*shape[1:], shape[0]) if channels_first and len(shape) >= 2 else shape


def _describe(layer: KerasLayer) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in layer.config.items())
    return f"{KERAS_CLASSES[layer.kind]}({args})"


def _fail(prefix: str, layer: nn.Module, why: str) -> NoKerasCounterpart:
    return NoKerasCounterpart(f"layer {prefix.rstrip('.')} ({type(layer).__name__}) has no Keras counterpart: {why}")


def _map(prefix: str, layer: nn.Module, state: _State, unmapped: list[str]) -> KerasLayer | None:
    """One torch layer as its Keras layer (None: nothing to add), updating `state` beyond the shapes."""
    from torch import nn

    kind = type(layer).__name__
    x = state.x
    spatial = state.channels_first and x.dim() >= 3       # a feature map Keras holds channels_last
    if isinstance(layer, (nn.Identity, nn.Dropout)) or kind in _ACTIVATIONS:
        if isinstance(layer, nn.Identity):
            return None
        if isinstance(layer, nn.Dropout):
            return KerasLayer("dropout", config={"rate": float(layer.p)})
        if isinstance(layer, nn.GELU) and layer.approximate != "none":
            raise _fail(prefix, layer, f"approximate={layer.approximate!r} (Keras's Activation('gelu') is the exact one)")
        return KerasLayer("activation", config={"activation": _ACTIVATIONS[kind]})
    if isinstance(layer, nn.Softmax):
        if layer.dim is None:
            raise _fail(prefix, layer, "dim is not set")
        dim = layer.dim % x.dim()
        axis = (-1 if dim == 1 else dim - 1) if spatial else dim
        return KerasLayer("softmax", config={"axis": axis})
    if isinstance(layer, nn.Linear):
        if spatial:
            raise _fail(prefix, layer, "it acts on the width axis of a (B, C, ...) feature map, which Keras keeps "
                                       "channels_last; add nn.Flatten() before it")
        transform = ("dense_after_flatten", state.flattened) if state.flattened else ("dense_kernel", None)
        state.flattened = None
        return KerasLayer("dense", _weights(prefix, layer, [("weight", "kernel", *transform), ("bias", "bias")]),
                          {"units": layer.out_features, "use_bias": layer.bias is not None})
    if isinstance(layer, nn.Flatten):
        if layer.start_dim != 1 or layer.end_dim != -1:
            raise _fail(prefix, layer, f"start_dim={layer.start_dim}, end_dim={layer.end_dim} (Keras flattens all "
                                       "but the batch axis)")
        if spatial:
            c, *rest = x.shape[1:]
            h, w = (1, rest[0]) if len(rest) == 1 else rest
            if len(rest) > 2:
                raise _fail(prefix, layer, "it flattens a 3-D feature map")
            state.flattened, state.channels_first = (int(c), int(h), int(w)), False
        return KerasLayer("flatten")
    if state.flattened is not None:
        raise _fail(prefix, layer, "it comes between a Flatten of a feature map and the next Linear, where torch "
                                   "orders features (C, H, W) and Keras (H, W, C)")
    if isinstance(layer, (nn.Conv1d, nn.Conv2d)):
        return _conv(prefix, layer, state)
    if isinstance(layer, (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d)):
        return _pool(prefix, layer, state)
    if isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d)):
        if not layer.track_running_stats or layer.running_mean is None:
            raise _fail(prefix, layer, "track_running_stats=False (it normalizes with each batch's statistics)")
        if x.dim() >= 3 and not state.channels_first:
            raise _fail(prefix, layer, "its channels (axis 1) are not the axis Keras keeps channels on")
        if layer.num_batches_tracked is not None:
            unmapped.append(f"{prefix}num_batches_tracked")
        momentum = 0.99 if layer.momentum is None else 1.0 - float(layer.momentum)
        return KerasLayer("batch_normalization",
                          _weights(prefix, layer, [("weight", "gamma"), ("bias", "beta"), ("running_mean", "moving_mean"),
                                                   ("running_var", "moving_variance")]),
                          {"axis": -1, "momentum": momentum, "epsilon": float(layer.eps),
                           "center": layer.affine, "scale": layer.affine})
    if isinstance(layer, nn.LayerNorm):
        if len(layer.normalized_shape) != 1:
            raise _fail(prefix, layer, f"it normalizes over {len(layer.normalized_shape)} axes (Keras maps one)")
        if spatial:
            raise _fail(prefix, layer, "it normalizes the width axis of a (B, C, ...) feature map, which Keras "
                                       "keeps channels_last")
        return KerasLayer("layer_normalization", _weights(prefix, layer, [("weight", "gamma"), ("bias", "beta")]),
                          {"axis": -1, "epsilon": float(layer.eps), "center": layer.bias is not None,
                           "scale": layer.weight is not None})
    if isinstance(layer, nn.Embedding):
        if layer.max_norm is not None:
            raise _fail(prefix, layer, "max_norm renormalizes rows as it looks them up")
        if spatial:
            raise _fail(prefix, layer, "it takes a feature map")
        return KerasLayer("embedding", _weights(prefix, layer, [("weight", "embeddings")]),
                          {"input_dim": layer.num_embeddings, "output_dim": layer.embedding_dim})
    raise _fail(prefix, layer, "modelkit maps Linear, Conv1d/2d, BatchNorm1d/2d, LayerNorm, Embedding, Dropout, "
                               "Max/AvgPool1d/2d, Flatten, ReLU, GELU, Sigmoid, Tanh and Softmax")


def _weights(prefix: str, layer: nn.Module, table: list[tuple]) -> tuple[KerasWeight, ...]:
    """(torch attribute, Keras variable[, transform, flatten]) rows for the tensors the layer has."""
    out = []
    for attribute, keras, *transform in table:
        if getattr(layer, attribute, None) is not None:
            out.append(KerasWeight(f"{prefix}{attribute}", keras, *transform))
    return tuple(out)


def _conv(prefix: str, layer: nn.Conv1d | nn.Conv2d, state: _State) -> KerasLayer:
    rank = len(layer.kernel_size)
    if not state.channels_first:
        raise _fail(prefix, layer, "its input's channels (axis 1) are not the axis Keras keeps channels on")
    if layer.padding_mode != "zeros":
        raise _fail(prefix, layer, f"padding_mode={layer.padding_mode!r} (Keras pads with zeros)")
    centred = all(s == 1 for s in layer.stride) and all((k - 1) * d % 2 == 0
                                                         for k, d in zip(layer.kernel_size, layer.dilation, strict=True))
    if layer.padding == "valid" or (layer.padding != "same" and not any(layer.padding)):
        padding = "valid"
    elif centred and (layer.padding == "same" or all(
            p * 2 == (k - 1) * d for k, d, p in zip(layer.kernel_size, layer.dilation, layer.padding, strict=True))):
        padding = "same"
    else:
        raise _fail(prefix, layer, f"padding={layer.padding!r} with stride {list(layer.stride)} (Keras pads "
                                   "'valid' or 'same': stride 1, padding (kernel - 1) * dilation / 2)")
    kind = "conv1d" if rank == 1 else "conv2d"
    return KerasLayer(kind, _weights(prefix, layer, [("weight", "kernel", "conv_kernel"), ("bias", "bias")]),
                      {"filters": layer.out_channels, "kernel_size": list(layer.kernel_size),
                       "strides": list(layer.stride), "padding": padding, "dilation_rate": list(layer.dilation),
                       "groups": layer.groups, "use_bias": layer.bias is not None})


def _pool(prefix: str, layer: nn.Module, state: _State) -> KerasLayer:
    from torch import nn

    one_d = isinstance(layer, (nn.MaxPool1d, nn.AvgPool1d))
    rank = 1 if one_d else 2

    def pair(value: Any) -> list[int]:
        return [int(v) for v in value] if isinstance(value, (tuple, list)) else [int(value)] * rank

    if not state.channels_first:
        raise _fail(prefix, layer, "its input's channels (axis 1) are not the axis Keras keeps channels on")
    if any(pair(layer.padding)) or layer.ceil_mode or any(d != 1 for d in pair(getattr(layer, "dilation", 1))) \
            or getattr(layer, "return_indices", False) or getattr(layer, "divisor_override", None):
        raise _fail(prefix, layer, "padding, dilation, ceil_mode, return_indices or divisor_override is set "
                                   "(Keras pools 'valid' windows)")
    name = ("max_pooling" if isinstance(layer, (nn.MaxPool1d, nn.MaxPool2d)) else "average_pooling") + f"{rank}d"
    stride = layer.stride if layer.stride is not None else layer.kernel_size
    return KerasLayer(name, config={"pool_size": pair(layer.kernel_size), "strides": pair(stride), "padding": "valid"})
