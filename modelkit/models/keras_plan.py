"""Where a checkpoint's tensors go in the Keras model it equals, and back: one plan for every Keras-layout
writer and reader (the HDF5 converter's `.weights.h5`, the TF.js Layers model).

`keras_plan(ckpt, module, example)` takes the layout a registered model declares (`keras_layers`, mlp and
cnn) or maps a user's Sequential (modelkit.models.keras_map), checks it against the model's shapes, and
says for each state_dict tensor which Keras layer and variable holds it and how its array is laid out
(`to_keras`) and undone (`from_keras`): Dense kernels transposed (out, in) -> (in, out), Conv kernels
(out, in, *k) -> (*k, in, out), a Dense after Flatten with its rows reordered from torch's (C, H, W)
flatten order to Keras's (H, W, C). Every transform is a transpose or a reshape, so arrays come back
bit for bit. Plain numpy: torch only to take the model's shapes (on the meta device), when a plan is made.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from modelkit.errors import ConfigError, UnknownModelError
from modelkit.models.plugin import KerasLayer, KerasLayout, KerasWeight
from modelkit.storage.dtypes import dtype_name
from modelkit.storage.tensors import LazyTensor
from modelkit.storage.transpose import Bands, RowBlocks, transpose_into

Transform = Callable[[np.ndarray], np.ndarray]
KERAS_DTYPES = ("float16", "float32", "float64", "bfloat16")


def _same(w: np.ndarray) -> np.ndarray:
    return w


def _dense_kernel(w: np.ndarray) -> np.ndarray:
    """(out, in) <-> (in, out), contiguous; a large matrix through transpose_into."""
    if w.ndim != 2 or w.size < 1 << 20:
        return w.T
    out = np.empty((w.shape[1], w.shape[0]), dtype=w.dtype)
    transpose_into(out, w)
    return out


def keras_pieces(target: KerasTarget, array: np.ndarray, piece_bytes: int,
                 bands: Bands | None = None) -> Iterator[np.ndarray]:
    """`target.to_keras(array)` as contiguous pieces in order, for writers that stream: a large Dense kernel
    in bands of whole Keras rows (about `piece_bytes` each) transposed into two buffers in turn (`bands`:
    the writer's, shared by all its kernels), each band valid until the one after next is asked for (a
    writer may still be writing one while the next is made), so no kernel-sized copy is made; anything
    else in one piece."""
    if target.spec.transform != "dense_kernel" or array.ndim != 2 or array.size < 1 << 20:
        yield np.ascontiguousarray(target.to_keras(array))
        return
    yield from RowBlocks([(0, array)], array.shape, array.dtype).transposed_chunks(piece_bytes, bands)


def _conv_kernel(w: np.ndarray) -> np.ndarray:
    return w.transpose(*range(2, w.ndim), 1, 0)     # (out, in, kh, kw) -> (kh, kw, in, out); (out, in, k) -> (k, in, out)


def _conv_kernel_back(w: np.ndarray) -> np.ndarray:
    return w.transpose(w.ndim - 1, w.ndim - 2, *range(w.ndim - 2))


def _dense_after_flatten(channels: int, height: int, width: int) -> Transform:
    """torch flattens (C, H, W); Keras (channels_last) flattens (H, W, C): reorder the kernel's rows."""
    def transform(w: np.ndarray) -> np.ndarray:
        out = w.shape[0]
        return w.reshape(out, channels, height, width).transpose(2, 3, 1, 0).reshape(height * width * channels, out)
    return transform


def _dense_after_flatten_back(channels: int, height: int, width: int) -> Transform:
    def transform(w: np.ndarray) -> np.ndarray:
        out = w.shape[-1]
        return w.reshape(height, width, channels, out).transpose(3, 2, 0, 1).reshape(out, channels * height * width)
    return transform


_TRANSFORMS: dict[str, tuple[Transform, Transform]] = {
    "same": (_same, _same), "dense_kernel": (_dense_kernel, _dense_kernel), "conv_kernel": (_conv_kernel, _conv_kernel_back)}


TRANSFORM_NAMES = (*_TRANSFORMS, "dense_after_flatten")


def keras_shape(weight: KerasWeight, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Keras shape of a torch tensor of `shape` (what `to_keras` gives, without touching data)."""
    if weight.transform == "dense_kernel":
        return tuple(reversed(shape))
    if weight.transform == "conv_kernel":
        return (*shape[2:], shape[1], shape[0])
    if weight.transform == "dense_after_flatten":
        return (math.prod(shape[1:]), shape[0])
    return tuple(shape)


def torch_shape(weight: KerasWeight, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The torch shape of a Keras weight of `shape` (what `from_keras` gives); None where the transform
    cannot apply (a rank or a flattened size that does not fit)."""
    if weight.transform == "dense_kernel":
        return tuple(reversed(shape)) if len(shape) == 2 else None
    if weight.transform == "conv_kernel":
        return (shape[-1], shape[-2], *shape[:-2]) if len(shape) >= 3 else None
    if weight.transform == "dense_after_flatten":
        fits = len(shape) == 2 and weight.flatten is not None and math.prod(weight.flatten) == shape[0]
        return (shape[1], shape[0]) if fits else None
    return tuple(shape)


def transforms(weight: KerasWeight) -> tuple[Transform, Transform]:
    """(torch -> Keras, Keras -> torch) for one weight of a layout."""
    if weight.transform == "dense_after_flatten":
        if weight.flatten is None:
            raise ConfigError(f"{weight.tensor}: dense_after_flatten needs the flattened (C, H, W)")
        return _dense_after_flatten(*weight.flatten), _dense_after_flatten_back(*weight.flatten)
    return _TRANSFORMS[weight.transform]


@dataclass(frozen=True)
class KerasTarget:
    """Where one state_dict tensor lives in the Keras model: layer `path` ("dense_1"), variable `index`
    and name (`weight`: "kernel"), the Keras shape, and the array transforms both ways."""

    path: str
    index: int
    weight: str
    shape: tuple[int, ...]
    to_keras: Transform
    from_keras: Transform
    spec: KerasWeight


@dataclass(frozen=True)
class KerasPlan:
    paths: list[tuple[str, KerasLayer]]                 # ("dense_1", layer), in model order
    targets: dict[str, KerasTarget]                     # state_dict name -> where it goes
    description: str
    layout: KerasLayout

    @property
    def keras_json(self) -> str:
        """The model for keras.models.model_from_json."""
        return json.dumps(self.layout.keras_json(), separators=(",", ":"))


def keras_plan(tensors: dict[str, Any] | None, arch: Any, module: Any = None, example: tuple[Any, ...] | None = None,
               *, owner: str = "the lossless copy") -> KerasPlan | str:
    """The Keras layout for a checkpoint's `tensors` (None: a reader's plan, nothing to check yet) and
    `arch` (an ArchSpec or None), or why there is none: a user's `module` (no registered model) is mapped
    layer by layer (modelkit.models.keras_map); a registered model declares its keras_layers. `owner`
    names what keeps a model without one, for the reason."""
    if module is not None and getattr(type(module), "arch", None) is None:
        from modelkit.models.keras_map import keras_layout

        try:
            layout = keras_layout(module, example)
        except ConfigError as e:
            return str(e)
        expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        return plan(tensors, layout, expected, type(module).__name__)
    from modelkit.models import build_from_spec, config_from_dict, load_model_module

    if arch is None:
        return ("the checkpoint names no architecture, so its Keras model is unknown (pass --arch mlp, --arch cnn "
                "or --arch module:function, a Sequential of your own)")
    try:
        layout = load_model_module(arch.name).keras_layers(config_from_dict(arch.name, arch.config))
    except (ConfigError, UnknownModelError) as e:
        return f"its ArchSpec does not build ({e})"
    try:
        import torch  # the model's shapes come from building it
    except ImportError:
        # a slim install: the layout (plain data) checked against the checkpoint's own shapes, layer to layer
        if layout is None or tensors is None:
            return (f"the Keras layout of {arch.name} is checked against the model, which needs torch "
                    "(pip install 'modelkit[torch]')")
        expected = layout_shapes(layout, tensors, arch.name)
        return expected if isinstance(expected, str) else plan(tensors, layout, expected, arch.name)
    try:
        with torch.device("meta"):                  # shapes only: nothing is allocated
            model = build_from_spec(arch)
        if layout is None:
            from modelkit.models.keras_map import first_unmapped

            why = first_unmapped(model) or f"{type(model).__name__}'s forward is code of its own"
            return (f"{arch.name} has no standard Keras equivalent (its model declares no keras_layers: {why}); "
                    f"{owner} keeps it losslessly")
    except (ConfigError, UnknownModelError) as e:
        return f"its ArchSpec does not build ({e})"
    return plan(tensors, layout, {k: tuple(v.shape) for k, v in model.state_dict().items()}, arch.name)


def layout_shapes(layout: KerasLayout, tensors: dict[str, Any], label: str) -> dict[str, tuple[int, ...]] | str:
    """The shapes a layout's tensors must have, taken from the checkpoint and checked layer to layer without
    building the model (no torch): each layer's input width is the one before's output (the input's channels
    first), units and filters as the layout declares, a Dense after Flatten as wide as the flattened map;
    or why not."""
    expected = {name: tuple(entry.shape) for name, entry in tensors.items()}
    width = layout.input_shape[-1] if layout.input_shape else None
    for layer in layout.layers:
        shapes = {w.keras: expected.get(w.tensor) for w in layer.weights}
        kernel = next((w for w in layer.weights if w.keras in ("kernel", "embeddings")), None)
        shape = shapes.get(kernel.keras) if kernel is not None else None
        if kernel is not None and shape is None:
            return f"tensor {kernel.tensor!r} of the {label} layout is missing"
        want: tuple[int | None, ...] | None = None
        if layer.kind == "dense":
            takes = math.prod(kernel.flatten) if kernel.transform == "dense_after_flatten" and kernel.flatten else width
            want, width = (layer.config.get("units"), takes), layer.config.get("units")
        elif layer.kind in ("conv1d", "conv2d"):
            groups = layer.config.get("groups", 1)
            want = (layer.config.get("filters"), None if width is None else width // groups,
                    *layer.config.get("kernel_size", ()))
            width = layer.config.get("filters")
        elif layer.kind == "embedding":
            want, width = (layer.config.get("input_dim"), layer.config.get("output_dim")), layer.config.get("output_dim")
        elif layer.kind == "flatten":
            width = None
        if want is not None and (len(want) != len(shape) or any(w is not None and w != d for w, d in zip(want, shape, strict=True))):
            return (f"tensor {kernel.tensor!r} is {list(shape)}, the {label} layout expects "
                    f"{['?' if w is None else w for w in want]}")
        for weight in layer.weights:                # biases and normalization variables: one per output feature
            got = shapes.get(weight.keras)
            if weight is not kernel and got is not None and width is not None and got != (width,):
                return f"tensor {weight.tensor!r} is {list(got)}, the {label} layout expects [{width}]"
    return expected


def plan(tensors: dict[str, Any] | None, layout: KerasLayout, expected: dict[str, tuple[int, ...]],
         label: str) -> KerasPlan | str:
    """Where each tensor goes in the Keras layout (the model's tensors have the `expected` shapes);
    `tensors` (names to entries with shape and dtype) are checked against it unless None."""
    counts: dict[str, int] = {}
    paths, targets = [], {}
    for layer in layout.layers:                     # Keras names layers dense, dense_1, ...
        n = counts[layer.kind] = counts.get(layer.kind, -1) + 1
        path = layer.kind if n == 0 else f"{layer.kind}_{n}"
        paths.append((path, layer))
        for index, weight in enumerate(layer.weights):
            to_keras, from_keras = transforms(weight)
            shape = keras_shape(weight, expected[weight.tensor]) if weight.tensor in expected else ()
            targets[weight.tensor] = KerasTarget(path, index, weight.keras, shape, to_keras, from_keras, weight)
    if tensors is None:
        return KerasPlan(paths, targets, layout.description, layout)
    for name, entry in tensors.items():
        if name in layout.unmapped and name in expected:
            continue
        if name not in targets:
            return f"tensor {name!r} has no Keras mapping in the {label} layout"
        if tuple(entry.shape) != expected.get(name):
            return f"tensor {name!r} is {list(entry.shape)}, the {label} layout expects {list(expected[name])}"
        if entry.dtype.name not in KERAS_DTYPES:
            return f"tensor {name!r} is {dtype_name(entry.dtype)}; Keras weights are floating point"
    missing = sorted(set(targets) - set(tensors))
    if missing:
        return f"tensor {missing[0]!r} of the {label} layout is missing"
    return KerasPlan(paths, targets, layout.description, layout)


# ---------------------------------------------------------------------------------------------
# The torch names of a Keras-layout file (metadata.NAMES_KEY), for every Keras-layout reader and writer

def names_record(plan: KerasPlan, order: list[str], stored: Callable[[KerasTarget], str]) -> str:
    """JSON {state_dict name: {"weight": the name the file stores it under (`stored(target)`), "transform",
    "flatten"?}}: what a reader needs to give the torch names and layouts back without building a model."""
    return json.dumps({name: {"weight": stored(t), "transform": t.spec.transform,
                              **({"flatten": list(t.spec.flatten)} if t.spec.flatten else {})}
                       for name in order for t in [plan.targets[name]]}, separators=(",", ":"))


def torch_names(tensors: dict[str, LazyTensor], names: dict[str, Any],
                fail: Callable[[str], Exception]) -> dict[str, LazyTensor]:
    """`tensors` (stored names, Keras layouts) under the torch names a names record gives, in torch layouts
    (transforms from a closed set of transposes and reshapes), then the tensors it does not name; `fail(reason)`
    is the error raised for an entry that is not a stored weight with a known transform that fits."""
    tensors = dict(tensors)
    out: dict[str, LazyTensor] = {}
    for name, entry in names.items():
        weight = entry.get("weight") if isinstance(entry, dict) else None
        transform = entry.get("transform") if isinstance(entry, dict) else None
        flatten = entry.get("flatten") if isinstance(entry, dict) else None
        if weight not in tensors or transform not in TRANSFORM_NAMES or not (
                flatten is None or isinstance(flatten, list) and len(flatten) == 3
                and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in flatten)):
            raise fail(f"entry {name!r} is not a stored weight with a known transform")
        stored = tensors.pop(weight)
        spec = KerasWeight(name, weight, transform, tuple(flatten) if flatten else None)
        _, back = transforms(spec)
        shape = torch_shape(spec, stored.shape)
        if shape is None:
            raise fail(f"entry {name!r}: {weight} {list(stored.shape)} does not take the {transform} layout")
        out[name] = in_torch_layout(stored, back, shape)
    return {**out, **tensors}


def in_torch_layout(stored: LazyTensor, back: Transform, shape: tuple[int, ...]) -> LazyTensor:
    """A stored Keras weight as the torch tensor it was (`back`: a transform's Keras -> torch half)."""
    return LazyTensor(stored.dtype, shape, lambda: np.ascontiguousarray(back(stored.array())), stored.source)
