"""keras: a Keras model as its topology describes it (a TF.js `model.json`'s `modelTopology`, Keras's `to_json`),
built as a torch module that computes what Keras computes, so a model TF.js or tensorflowjs_converter wrote
converts to ONNX and TorchScript without `--arch`.

Not a model of the zoo: nothing trains it, and its ArchSpec is the file's own topology, given by the reader
(`ArchSpec("keras", {"topology": <the Keras model config>})`): plain JSON data that names Keras layer classes
from a closed table, never code. Sequential and functional models (Keras 2 / TF.js `inbound_nodes`, and
Keras 3's `args` with `keras_history`) of these layers build, with shared layers (a layer called more than once:
one node per call, one set of weights) and nested Sequential and functional models (a model used as a layer runs
its own graph; called more than once, its weights are made once):

    InputLayer, Dense, Conv1D, Conv2D, DepthwiseConv2D, MaxPooling1D/2D, AveragePooling1D/2D,
    GlobalAveragePooling1D/2D, GlobalMaxPooling1D/2D, Flatten, Reshape, Dropout, BatchNormalization,
    LayerNormalization, Embedding, Activation, Softmax, ReLU, LeakyReLU, Add, Subtract, Multiply, Average,
    Maximum, Minimum, Concatenate

with Keras's semantics kept: tensors are channels_last as Keras takes them (an image is (B, H, W, C); a layer
with `data_format: "channels_first"` takes (B, C, H, W)), padding "valid" or "same" as TensorFlow pads ("same":
the odd pixel after, max pooling over the window's real pixels, average pooling divided by them), strides,
dilation, use_bias, and the activations TF.js and Keras name (linear, relu, relu6, elu, selu, sigmoid, tanh,
softmax, log_softmax, softplus, softsign, swish/silu, gelu (exact), gelu_new (tanh), mish, exponential).
Weights keep Keras's layouts (Dense kernel (in, out), Conv kernel (*k, in, out)) under the names the file
stores them by: `<layer name>/<variable>` as TF.js's manifest names them (`dense_Dense1/kernel`,
`batch_normalization/moving_mean`, nested or not), or Keras 3's path through the nested models
(`layers/sequential/layers/dense_1/vars/0`). Anything else is refused when the module is built, naming the layer and
its class. The Keras classes are `plugin.KERAS_CLASSES`, the table the Keras writers (keras_map, the zoo's
keras_layers) name their layers from.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from modelkit.errors import ConfigError
from modelkit.models.plugin import KERAS_CLASSES, Axis, KerasLayout, PruneGroup

_KINDS = {cls: kind for kind, cls in KERAS_CLASSES.items()}
_EXAMPLE_BATCH = 2              # example inputs' batch (torch.export specializes a batch of 1)
_MAX_INPUTS = 8                 # forward's parameters
_FREE_SIZE = 8                  # an axis the topology leaves free (None) besides the batch, in example inputs


def _activation(name: str, where: str) -> Callable[[torch.Tensor], torch.Tensor]:
    table: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "linear": lambda x: x, "relu": F.relu, "relu6": F.relu6, "elu": F.elu, "selu": F.selu,
        "sigmoid": torch.sigmoid, "tanh": torch.tanh, "softmax": lambda x: torch.softmax(x, -1),
        "log_softmax": lambda x: torch.log_softmax(x, -1), "logSoftmax": lambda x: torch.log_softmax(x, -1),
        "softplus": F.softplus, "softsign": F.softsign, "swish": F.silu, "silu": F.silu,
        "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "mish": F.mish, "exponential": torch.exp}
    fn = table.get(name)
    if fn is None:
        raise ConfigError(f"{where}: activation {name!r} is not one modelkit builds (it builds "
                          f"{', '.join(sorted(table))}; hard_sigmoid differs between TF.js and Keras 3)")
    return fn


def _activation_name(value: Any, where: str) -> str:
    if value is None:
        return "linear"
    if isinstance(value, dict):                     # Keras 3 may serialize {"class_name": ..., "config": {...}}
        value = value.get("config", {}).get("name", value.get("class_name"))
    if not isinstance(value, str):
        raise ConfigError(f"{where}: activation {value!r} is not a name")
    return value


def _ints(value: Any, rank: int, what: str, where: str) -> tuple[int, ...]:
    values = [value] * rank if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, (list, tuple)) or len(values) != rank or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ConfigError(f"{where}: {what} {value!r} is not {rank} positive integer(s)")
    return tuple(values)


def _same_padding(size: int, kernel: int, stride: int, dilation: int = 1) -> tuple[int, int]:
    """TensorFlow's "same": the output is ceil(size / stride); the odd pixel of padding goes after."""
    effective = (kernel - 1) * dilation + 1
    total = max((math.ceil(size / stride) - 1) * stride + effective - size, 0)
    return total // 2, total - total // 2


Ref = tuple[str, int, int]      # a tensor: (layer name, call of the layer, output of the call)


@dataclass
class _Node:
    """One call of a layer: its name, Keras class, config, the tensors it takes, and which call of the layer it
    is (a shared layer is called more than once, with one set of weights); a nested model's own graph."""

    name: str
    cls: str
    config: dict[str, Any]
    inputs: list[Ref] = field(default_factory=list)
    path: str = ""              # Keras 3's name for it in a .weights.h5: the class in snake case, numbered (dense_1),
                                # under its model's (sequential/layers/dense_1); unique in the whole model
    call: int = 0
    sub: _Graph | None = None


@dataclass
class _Graph:
    """A model: its inputs (name, batch shape, dtype), its layer calls in an order that runs, its outputs."""

    inputs: list[tuple[str, tuple, str]]
    nodes: list[_Node]
    outputs: list[Ref]


@dataclass(frozen=True)
class KerasGraphConfig:
    """Args:
        topology: The Keras model config ({"class_name": "Sequential" | "Model" | "Functional", "config": {...}}),
            as a TF.js model.json's `modelTopology` (without the `model_config` wrapper) or Keras's to_json hold it.
        weights: How the file names the weights: "tfjs" (`<layer name>/<variable>`, a TF.js manifest) or "keras3"
            (`layers/<class in snake case>[_<n>]/vars/<i>`, Keras 3's .weights.h5 beside an architecture JSON).
    """

    topology: dict[str, Any] = field(default_factory=dict)
    weights: str = "tfjs"

    def __post_init__(self) -> None:
        if self.weights not in ("tfjs", "keras3"):
            raise ConfigError(f"keras: weights {self.weights!r} is not 'tfjs' or 'keras3'")


class KerasGraph(nn.Module):
    """The Keras model a topology describes, on torch tensors laid out as Keras takes them. Parameters are named
    as the file stores them (`dense/kernel`), in Keras's layouts; `forward(*inputs)` takes the model's inputs in
    its `input_layers` order and returns its output (a tuple for several)."""

    arch: ClassVar[str] = "keras"

    def __init__(self, config: KerasGraphConfig | None = None) -> None:
        super().__init__()
        self.config = config or KerasGraphConfig()
        self._graph = _graph(self.config.topology)
        self._inputs = self._graph.inputs
        if len(self._inputs) > _MAX_INPUTS:
            raise ConfigError(f"the Keras model takes {len(self._inputs)} inputs; modelkit builds at most {_MAX_INPUTS}")
        self._keys: dict[tuple[str, str], str] = {}
        with torch.no_grad():                       # one pass on zeros makes each layer's weights (shapes only)
            self._run([torch.zeros(shape, dtype=torch.int64 if dtype.startswith("int") else torch.float32)
                       for _, shape, dtype in self._example_shapes(1)], build=True)

    # -- the inputs the topology declares ------------------------------------------------------------------------

    def _example_shapes(self, batch: int) -> list[tuple[str, tuple[int, ...], str]]:
        embedded = _embedded_inputs(self._graph)
        out = []
        for name, shape, dtype in self._inputs:
            dims = tuple(batch if i == 0 else (_FREE_SIZE if d is None else d) for i, d in enumerate(shape))
            out.append((name, dims, "int32" if name in embedded or dtype.startswith("int") else "float32"))
        return out

    @property
    def input_specs(self) -> list[str]:
        """Example inputs as `--input-shape` specs ("image=2x9x9x3:float32"; token ids in [0, the smallest
        Embedding's input_dim)): what graph exports and their checks run on when the caller gives none."""
        vocab = min((int(n.config["input_dim"]) for n in _calls(self._graph) if n.cls == "Embedding"), default=None)
        specs = []
        for name, dims, dtype in self._example_shapes(_EXAMPLE_BATCH):
            label = f"{name}=" if name.isidentifier() else ""
            ids = f":0..{vocab}" if dtype == "int32" and vocab else ""
            specs.append(f"{label}{'x'.join(map(str, dims))}:{dtype}{ids}")
        return specs

    # -- running the graph ---------------------------------------------------------------------------------------

    def forward(self, x0: torch.Tensor, x1: torch.Tensor | None = None, x2: torch.Tensor | None = None,
                x3: torch.Tensor | None = None, x4: torch.Tensor | None = None, x5: torch.Tensor | None = None,
                x6: torch.Tensor | None = None, x7: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # named parameters, not *inputs: torch.export gives each its own dynamic shape
        return self._run([x for x in (x0, x1, x2, x3, x4, x5, x6, x7) if x is not None])

    def _run(self, inputs: list[torch.Tensor], *, build: bool = False) -> Any:
        outs = self._run_graph(self._graph, inputs, build)
        return outs[0] if len(outs) == 1 else outs

    def _run_graph(self, graph: _Graph, inputs: list[torch.Tensor], build: bool) -> tuple[torch.Tensor, ...]:
        """A model's layer calls in order; a nested model's graph on the tensors its call takes."""
        if len(inputs) != len(graph.inputs):
            raise ConfigError(f"the Keras model takes {len(graph.inputs)} input(s), got {len(inputs)}")
        values: dict[Ref, torch.Tensor] = {(name, 0, 0): x for (name, _, _), x in zip(graph.inputs, inputs, strict=True)}
        for node in graph.nodes:
            args = [values[ref] for ref in node.inputs]
            if node.sub is not None:
                outs = self._run_graph(node.sub, args, build)
            else:
                outs = (self._layer(node, args, build),)
            for index, y in enumerate(outs):
                values[(node.name, node.call, index)] = y
        missing = next((ref for ref in graph.outputs if ref not in values), None)
        if missing is not None:
            raise ConfigError(f"the model's output {list(missing)} is not an output of layer {missing[0]!r}")
        return tuple(values[ref] for ref in graph.outputs)

    def _weight(self, node: _Node, variable: str, shape: tuple[int, ...] | None) -> torch.Tensor:
        """The layer's Keras variable; made (uninitialized, `shape`) on the building pass, named as the file
        names it: `layer/variable` (TF.js) or `layers/<path>/vars/<i>` (Keras 3's .weights.h5). A shared layer's
        later calls take the weights its first call made."""
        if shape is not None and (node.path, variable) in self._keys:
            made = self._parameters[self._keys[(node.path, variable)]]
            if tuple(made.shape) != tuple(shape):
                raise ConfigError(f"layer {node.name!r} ({node.cls}) is called on inputs that need its {variable} "
                                  f"{list(made.shape)} and {list(shape)}")
        elif shape is not None:
            if self.config.weights == "keras3":
                index = sum(1 for layer, _ in self._keys if layer == node.path)
                key = f"layers/{node.path}/vars/{index}"
            else:
                key = f"{node.name}/{variable}"
            if "." in key:
                raise ConfigError(f"layer {node.name!r} ({node.cls}): a layer name with '.' cannot name a weight")
            if key in self._parameters:
                raise ConfigError(f"two layers are named {node.name!r}, so their weights would share the name {key!r}")
            self._keys[(node.path, variable)] = key
            self.register_parameter(key, nn.Parameter(torch.empty(shape), requires_grad=False))
        return self._parameters[self._keys[(node.path, variable)]]

    def _layer(self, node: _Node, args: list[torch.Tensor], build: bool) -> torch.Tensor:
        c, where = node.config, f"layer {node.name!r} ({node.cls})"
        kind = _KINDS[node.cls]
        if kind in _MERGE:
            if len(args) < 2:
                raise ConfigError(f"{where}: takes at least two inputs, got {len(args)}")
            if kind == "concatenate":
                return torch.cat(args, dim=int(c.get("axis", -1)))
            out = args[0]
            for x in args[1:]:
                out = _MERGE[kind](out, x)
            return out / len(args) if kind == "average" else out
        if len(args) != 1:
            raise ConfigError(f"{where}: takes one input, got {len(args)}")
        x = args[0]
        channels_first = c.get("data_format", "channels_last") == "channels_first"
        if kind == "dense":
            kernel = self._weight(node, "kernel", (x.shape[-1], int(c["units"])) if build else None)
            x = torch.matmul(x, kernel)
            if c.get("use_bias", True):
                x = x + self._weight(node, "bias", (int(c["units"]),) if build else None)
            return _activation(_activation_name(c.get("activation"), where), where)(x)
        if kind in ("conv1d", "conv2d", "depthwise_conv2d"):
            return self._conv(node, kind, x, channels_first, build, where)
        if kind in ("max_pooling1d", "max_pooling2d", "average_pooling1d", "average_pooling2d"):
            return _pool(kind, c, x, channels_first, where)
        if kind in ("global_average_pooling1d", "global_average_pooling2d", "global_max_pooling1d",
                    "global_max_pooling2d"):
            axes = tuple(range(2, x.dim())) if channels_first else tuple(range(1, x.dim() - 1))
            keep = bool(c.get("keepdims", False))
            return x.mean(dim=axes, keepdim=keep) if "average" in kind else x.amax(dim=axes, keepdim=keep)
        if kind == "flatten":
            if channels_first and x.dim() > 2:
                x = x.permute(0, *range(2, x.dim()), 1)
            return x.flatten(1)
        if kind == "reshape":
            target = c.get("target_shape")
            if not isinstance(target, list) or not all(isinstance(d, int) for d in target):
                raise ConfigError(f"{where}: target_shape {target!r} is not a list of integers")
            return x.reshape(x.shape[0], *target)
        if kind == "dropout":
            return x
        if kind == "activation":
            return _activation(_activation_name(c.get("activation"), where), where)(x)
        if kind == "softmax":
            return torch.softmax(x, dim=int(c.get("axis", -1)))
        if kind == "relu":
            return _relu(c, x, where)
        if kind == "leaky_relu":
            slope = c.get("negative_slope", c.get("alpha", 0.3))
            return F.leaky_relu(x, float(slope))
        if kind == "batch_normalization":
            return self._batch_norm(node, x, build, where)
        if kind == "layer_normalization":
            return self._layer_norm(node, x, build, where)
        if kind == "embedding":
            table = self._weight(node, "embeddings", (int(c["input_dim"]), int(c["output_dim"])) if build else None)
            return F.embedding(x.long(), table)
        raise ConfigError(f"{where}: not built")          # _graph refused every other class

    def _conv(self, node: _Node, kind: str, x: torch.Tensor, channels_first: bool, build: bool,
              where: str) -> torch.Tensor:
        c = node.config
        rank = 1 if kind == "conv1d" else 2
        if x.dim() != rank + 2:
            raise ConfigError(f"{where}: takes a rank-{rank + 2} input, got rank {x.dim()}")
        if not channels_first:
            x = x.permute(0, x.dim() - 1, *range(1, x.dim() - 1))     # (B, *spatial, C) -> (B, C, *spatial)
        channels = x.shape[1]
        size = _ints(c.get("kernel_size"), rank, "kernel_size", where)
        strides = _ints(c.get("strides", 1), rank, "strides", where)
        dilation = _ints(c.get("dilation_rate", 1), rank, "dilation_rate", where)
        if kind == "depthwise_conv2d":
            mult = int(c.get("depth_multiplier", 1))
            kernel = self._weight(node, "depthwise_kernel", (*size, channels, mult) if build else None)
            weight = kernel.reshape(*size, channels * mult).permute(2, 0, 1).unsqueeze(1)   # (C*m, 1, kh, kw)
            groups, filters = channels, channels * mult
        else:
            groups, filters = int(c.get("groups", 1)), int(c["filters"])
            if channels % groups:
                raise ConfigError(f"{where}: {channels} input channels do not split into {groups} groups")
            kernel = self._weight(node, "kernel", (*size, channels // groups, filters) if build else None)
            weight = kernel.permute(rank + 1, rank, *range(rank))          # (*k, in, out) -> (out, in, *k)
        padding = c.get("padding", "valid")
        if padding == "same":
            pads: list[int] = []
            for axis in reversed(range(rank)):                               # F.pad takes the last axis first
                pads += _same_padding(x.shape[2 + axis], size[axis], strides[axis], dilation[axis])
            x = F.pad(x, pads)
        elif padding != "valid":
            raise ConfigError(f"{where}: padding {padding!r} (modelkit builds 'valid' and 'same')")
        conv = F.conv1d if rank == 1 else F.conv2d
        bias = self._weight(node, "bias", (filters,) if build else None) if c.get("use_bias", True) else None
        y = conv(x, weight, bias, stride=strides, dilation=dilation, groups=groups)
        if not channels_first:
            y = y.permute(0, *range(2, y.dim()), 1)
        return _activation(_activation_name(c.get("activation"), where), where)(y)

    def _batch_norm(self, node: _Node, x: torch.Tensor, build: bool, where: str) -> torch.Tensor:
        c = node.config
        axis = c.get("axis", -1)
        axis = axis[0] if isinstance(axis, list) and len(axis) == 1 else axis
        if not isinstance(axis, int):
            raise ConfigError(f"{where}: axis {axis!r} (modelkit builds one axis)")
        axis %= x.dim()
        width = (x.shape[axis],) if build else None
        shape = [1] * x.dim()
        shape[axis] = x.shape[axis]
        gamma = self._weight(node, "gamma", width) if c.get("scale", True) else None
        beta = self._weight(node, "beta", width) if c.get("center", True) else None
        mean = self._weight(node, "moving_mean", width)
        var = self._weight(node, "moving_variance", width)
        y = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + float(c.get("epsilon", 1e-3)))
        if gamma is not None:
            y = y * gamma.reshape(shape)
        return y + beta.reshape(shape) if beta is not None else y

    def _layer_norm(self, node: _Node, x: torch.Tensor, build: bool, where: str) -> torch.Tensor:
        c = node.config
        axes = c.get("axis", -1)
        axes = sorted({int(a) % x.dim() for a in (axes if isinstance(axes, list) else [axes])})
        if 0 in axes or not axes:
            raise ConfigError(f"{where}: axis {c.get('axis')!r} (modelkit normalizes over non-batch axes)")
        shape = [x.shape[a] if a in axes else 1 for a in range(x.dim())]
        width = tuple(x.shape[a] for a in axes) if build else None
        mean = x.mean(dim=axes, keepdim=True)
        var = ((x - mean) ** 2).mean(dim=axes, keepdim=True)
        y = (x - mean) * torch.rsqrt(var + float(c.get("epsilon", 1e-3)))
        if c.get("scale", True):
            y = y * self._weight(node, "gamma", width).reshape(shape)
        if c.get("center", True):
            y = y + self._weight(node, "beta", width).reshape(shape)
        return y


_MERGE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "average": torch.add,
    "maximum": torch.maximum, "minimum": torch.minimum, "concatenate": torch.add}


def _relu(c: dict[str, Any], x: torch.Tensor, where: str) -> torch.Tensor:
    slope, threshold, top = float(c.get("negative_slope", 0.0)), float(c.get("threshold", 0.0)), c.get("max_value")
    y = torch.where(x >= threshold, x, slope * (x - threshold))
    return y.clamp(max=float(top)) if top is not None else y


def _pool(kind: str, c: dict[str, Any], x: torch.Tensor, channels_first: bool, where: str) -> torch.Tensor:
    rank = 1 if kind.endswith("1d") else 2
    if x.dim() != rank + 2:
        raise ConfigError(f"{where}: takes a rank-{rank + 2} input, got rank {x.dim()}")
    size = _ints(c.get("pool_size", 2), rank, "pool_size", where)
    strides = _ints(c.get("strides") or size, rank, "strides", where)
    if not channels_first:
        x = x.permute(0, x.dim() - 1, *range(1, x.dim() - 1))
    padding = c.get("padding", "valid")
    pads: list[int] = []
    if padding == "same":
        for axis in reversed(range(rank)):
            pads += _same_padding(x.shape[2 + axis], size[axis], strides[axis])
    elif padding != "valid":
        raise ConfigError(f"{where}: padding {padding!r} (modelkit builds 'valid' and 'same')")
    maximum = kind.startswith("max")
    pool = (F.max_pool1d if rank == 1 else F.max_pool2d) if maximum else (F.avg_pool1d if rank == 1 else F.avg_pool2d)
    if any(pads):
        if maximum:
            y = pool(F.pad(x, pads, value=-math.inf), size, strides)
        else:            # TensorFlow averages over the window's real pixels: sum of x / count of pixels
            ones = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype)
            y = pool(F.pad(x, pads), size, strides) / pool(F.pad(ones, pads), size, strides)
    else:
        y = pool(x, size, strides)
    return y if channels_first else y.permute(0, *range(2, y.dim()), 1)


# ---------------------------------------------------------------------------------------------
# The topology: layers, their inputs, the model's inputs and outputs (Sequential or functional)

_MODELS = {"Sequential": "sequential", "Functional": "functional", "Model": "functional"}    # nested models: Keras 3's
                                                                                          # name for each in a path


def _graph(topology: dict[str, Any], prefix: str = "") -> _Graph:
    """The model a topology describes; `prefix`: the path of the model it is nested in (Keras 3's weight names)."""
    if not topology:
        raise ConfigError("a Keras model is built from a file's topology (a TF.js model.json or Keras architecture "
                          "JSON); this one names none")
    cls, config = topology.get("class_name"), topology.get("config")
    if isinstance(config, list):                                   # Keras 1 / early TF.js Sequential: a bare list
        config = {"layers": config}
    if not isinstance(config, dict) or not isinstance(config.get("layers"), list) or not config["layers"]:
        raise ConfigError(f"the Keras {cls} has no list of layers")
    layers = [_layer_entry(entry, i) for i, entry in enumerate(config["layers"])]
    for name, layer_cls, _, _ in layers:
        if layer_cls not in _KINDS and layer_cls not in _MODELS:
            raise ConfigError(f"layer {name!r} is a {layer_cls}, which modelkit does not build into a torch module "
                              f"(it builds {', '.join(sorted([*_KINDS, *_MODELS]))})")
    counts: dict[str, int] = {}
    paths = {}
    for name, layer_cls, _, _ in layers:            # Keras 3 numbers a model's layers per class, in its order
        kind = _KINDS.get(layer_cls) or _MODELS[layer_cls]
        n = counts[kind] = counts.get(kind, -1) + 1
        paths[name] = prefix + (kind if n == 0 else f"{kind}_{n}")
    subs = {name: _graph({"class_name": layer_cls, "config": layer_config}, f"{paths[name]}/layers/")
            for name, layer_cls, layer_config, _ in layers if layer_cls in _MODELS}
    if cls == "Sequential":
        return _sequential(layers, paths, subs)
    if cls in ("Model", "Functional"):
        return _functional(config, layers, paths, subs)
    raise ConfigError(f"the model is a {cls!r}; modelkit builds Keras Sequential and functional models")


def _calls(graph: _Graph) -> list[_Node]:
    """Every layer call of the model, nested models' included."""
    return [call for node in graph.nodes for call in ([node] if node.sub is None else _calls(node.sub))]


def _embedded_inputs(graph: _Graph) -> set[str]:
    """The model's inputs an Embedding takes (token ids), through nested models too."""
    names: set[str] = set()
    for node in graph.nodes:
        if node.cls == "Embedding":
            names |= {ref[0] for ref in node.inputs}
        elif node.sub is not None:
            inner = _embedded_inputs(node.sub)
            names |= {ref[0] for ref, (name, _, _) in zip(node.inputs, node.sub.inputs, strict=False) if name in inner}
    return names


def _layer_entry(entry: Any, index: int) -> tuple[str, str, dict[str, Any], Any]:
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ConfigError(f"layer {index} of the topology is not a {{class_name, config}} object")
    config = entry.get("config") if isinstance(entry.get("config"), dict) else {}
    name = entry.get("name", config.get("name"))
    if not isinstance(name, str) or not name:
        raise ConfigError(f"layer {index} ({entry['class_name']}) has no name")
    return name, entry["class_name"], config, entry.get("inbound_nodes", [])


def _input_of(name: str, config: dict[str, Any], where: str | None = None) -> tuple[str, tuple, str]:
    shape = config.get("batch_input_shape", config.get("batch_shape"))
    if shape is None and config.get("input_shape") is not None:
        shape = [None, *config["input_shape"]]
    if not isinstance(shape, list) or not shape or not all(d is None or isinstance(d, int) and d > 0 for d in shape):
        raise ConfigError(f"{where or f'input {name!r}'} declares no input shape (batch_input_shape / batch_shape), "
                          "so the model's input is unknown")
    dtype = config.get("dtype", "float32")
    return name, tuple(shape), dtype if isinstance(dtype, str) else "float32"


def _sequential(layers: list[tuple[str, str, dict, Any]], paths: dict[str, str], subs: dict[str, _Graph]) -> _Graph:
    first_name, first_cls, first_config, _ = layers[0]
    if first_cls == "InputLayer":
        inputs = [_input_of(first_name, first_config)]
    elif first_name in subs and len(subs[first_name].inputs) == 1:      # a nested model first: its input
        inputs = [("input", *subs[first_name].inputs[0][1:])]
    else:
        inputs = [_input_of("input", first_config, f"the first layer, {first_name!r} ({first_cls}),")]
    previous = inputs[0][0]
    nodes = []
    for name, cls, config, _ in layers[1:] if first_cls == "InputLayer" else layers:
        if cls == "InputLayer":
            raise ConfigError(f"layer {name!r} is an InputLayer inside a Sequential")
        nodes.append(_Node(name, cls, config, [(previous, 0, 0)], paths[name], sub=subs.get(name)))
        previous = name
    return _Graph(inputs, nodes, [(previous, 0, 0)])


def _refs(value: Any, where: str) -> list[tuple[str, int, int]]:
    """Tensor references [layer, node, index] in a Keras 2 / TF.js list, or Keras 3's `keras_history`."""
    if isinstance(value, dict):
        history = value.get("config", {}).get("keras_history") if value.get("class_name") == "__keras_tensor__" else None
        if history is None:
            return []
        value = history
    if isinstance(value, list) and len(value) >= 3 and isinstance(value[0], str):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value[1:3]):
            raise ConfigError(f"{where}: tensor reference {value!r} is not [layer, node, index]")
        return [(value[0], int(value[1]), int(value[2]))]
    if isinstance(value, list):
        return [ref for v in value for ref in _refs(v, where)]
    return []


def _functional(config: dict[str, Any], layers: list[tuple[str, str, dict, Any]], paths: dict[str, str],
                subs: dict[str, _Graph]) -> _Graph:
    """A functional model: one node per call of each layer (inbound_nodes lists the calls), in an order that runs.

    A tensor is [layer, node, output]. Keras 3 (calls as {"args": ...}) counts a layer's nodes from its first
    call; Keras 2 and TF.js count a nested model's from 1, its own node 0 being the one that made it (measured on
    what TF.js 4.22 writes: ["sequential_1", 1, 0] is the first call)."""
    by_name: dict[str, tuple[str, dict[str, Any], Any]] = {}
    for name, cls, layer_config, inbound in layers:
        if name in by_name:
            raise ConfigError(f"two layers are named {name!r}")
        by_name[name] = (cls, layer_config, inbound)
    keras3 = any(isinstance(node, dict) for _, _, _, inbound in layers if isinstance(inbound, list) for node in inbound)
    calls = {name: 1 if cls == "InputLayer" else len(inbound) if isinstance(inbound, list) else 0
             for name, (cls, _, inbound) in by_name.items()}

    def tensor(ref: Ref, where: str) -> Ref:
        layer, node, output = ref
        if layer not in by_name:
            raise ConfigError(f"{where} takes {layer!r}, which no layer of the model makes")
        call = node - (1 if layer in subs and not keras3 else 0)
        if not 0 <= call < calls[layer]:
            raise ConfigError(f"{where} takes node {node} of layer {layer!r}, which is called {calls[layer]} time(s)")
        outputs = len(subs[layer].outputs) if layer in subs else 1
        if not 0 <= output < outputs:
            raise ConfigError(f"{where} takes output {output} of layer {layer!r}, which has {outputs}")
        return layer, call, output

    inputs, nodes = [], []
    for name, (cls, layer_config, inbound) in by_name.items():
        where = f"layer {name!r} ({cls})"
        if cls == "InputLayer":
            continue
        if not calls[name]:
            raise ConfigError(f"{where} has no input tensors")
        for call, node in enumerate(inbound):                      # a shared layer: one node per call
            refs = _refs(node.get("args", []) if isinstance(node, dict) else node, where)
            if not refs:
                raise ConfigError(f"{where} has no input tensors")
            nodes.append(_Node(name, cls, layer_config, [tensor(ref, where) for ref in refs], paths[name], call,
                               subs.get(name)))
    for name, _, _ in _refs(config.get("input_layers", []), "input_layers"):
        if name not in by_name or by_name[name][0] != "InputLayer":
            raise ConfigError(f"input_layers names {name!r}, which is not an InputLayer of the model")
        inputs.append(_input_of(name, by_name[name][1]))
    outputs = [tensor(ref, "output_layers") for ref in _refs(config.get("output_layers", []), "output_layers")]
    if not inputs or not outputs:
        raise ConfigError("the functional model names no input_layers or output_layers")
    known = {(name, 0) for name, _, _ in inputs}
    order: list[_Node] = []
    pending = nodes
    while pending:                                                 # each call after the calls it takes
        ready = [n for n in pending if all(ref[:2] in known for ref in n.inputs)]
        if not ready:
            missing = next(ref for n in pending for ref in n.inputs if ref[:2] not in known)
            raise ConfigError(f"layer {pending[0].name!r} takes {missing[0]!r}, which no layer of the model makes "
                              "from the model's inputs")
        order += ready
        known |= {(n.name, n.call) for n in ready}
        pending = [n for n in pending if not any(n is r for r in ready)]
    for ref in outputs:
        if ref[:2] not in known:
            raise ConfigError(f"output_layers names {ref[0]!r}, which is not a layer of the model")
    return _Graph(inputs, order, outputs)


CONFIG = KerasGraphConfig
MODEL = KerasGraph
TASK = None
TRAINING = None


def example_inputs(batch_size: int = _EXAMPLE_BATCH) -> Any:
    raise ConfigError("a Keras model's inputs come from its topology (KerasGraph.input_specs)")


def keras_layers(config: KerasGraphConfig) -> KerasLayout | None:
    """None: the module keeps Keras's own names and layouts (a Keras-layout writer copies the weights as stored)."""
    return None


def onnx_axes(config: KerasGraphConfig) -> dict[int, Axis]:
    return {}


def prune_groups(config: KerasGraphConfig) -> list[PruneGroup] | None:
    return None


DISTILL = None
STUDENT: dict[str, Any] = {}
QUALITY = None
GGUF = None

