"""tfjs: a TensorFlow.js Layers model, a folder with `model.json` and its weight shards.

Spec: tfjs-core/src/io/types.ts (ModelJSON, WeightsManifestEntry) and io_utils.ts (how weights are
decoded), TensorFlow.js 4.22; tfjs-layers loads the topology as a Keras model config.

Layout of a folder modelkit writes:

    model.json                 {"format": "layers-model", "generatedBy": "modelkit <version>",
                                "convertedBy": "modelkit <version>",
                                "modelTopology": the Keras model config (modelkit.models.plugin's table, the
                                                 one the HDF5 converter's .weights.h5 uses),
                                "weightsManifest": [{"paths": ["group1-shard1ofN.bin", ...],
                                                     "weights": [{"name": "dense/kernel", "shape", "dtype"}, ...]}],
                                "userDefinedMetadata": {"modelkit.arch": ArchSpec JSON,
                                                        "modelkit.names": JSON {state_dict name: {"weight": "dense/kernel",
                                                            "transform": "dense_kernel", "flatten"?: [C, H, W]}},
                                                        ...the Checkpoint's metadata}}
    group1-shardKofN.bin       the weights end to end in manifest order (the Keras model's layer by layer,
                               each layer's variables in Keras's order), cut every `shard_size` bytes
                               (4 MiB, TF.js's default; a weight may straddle two shards, as TF.js allows)

Weights are stored as Keras holds them (Dense kernel (in, out), Conv2D (kh, kw, in, out), channels_last,
a Dense after Flatten with its rows in Keras's (H, W, C) order): modelkit.models.keras_plan. float32 as
`"dtype": "float32"`; float16 as TF.js reads it, `"dtype": "float32", "quantization": {"dtype": "float16"}`;
TF.js's uint8/uint16 codes (QuantizedTensors of layout "tfjs", from `modelkit quantize --scheme tfjs-uint8`)
as `"quantization": {"dtype": "uint8", "min", "scale", "original_dtype": "float32"}`. A large Dense kernel
is transposed and written in bands (keras_plan.keras_pieces), never copied whole.
A checkpoint without a Keras layout (no mlp, cnn or user Sequential) cannot be a Layers model and is refused.

Reading (ours and TF.js's or tensorflowjs_converter's): the topology with or without the `model_config`
wrapper, any number of groups and shards, float32, int32, float16 (plain or as quantization), and the
quantized uint8/uint16 weights with `quantization: {dtype, min, scale}` or `{dtype, scale, original_dtype}`
(decoded as TF.js does: q * scale + min in double precision, then float32). Shards are mapped into memory
and weights are views of them (a Dense kernel is transposed straight from the pages into torch's layout, streamed
to writers in bands, and compared with an array in the shards' own layout: storage.transpose.RowBlocks).
The JSON and the manifest are read by modelkit.parse.tfjs
(size caps, every shard path inside the folder, the shards' sizes equal to what the manifest declares)
and the file goes through the scanner's gate (a Lambda layer carrying code is refused). A file whose
`userDefinedMetadata` records modelkit's names ("modelkit.names": state_dict name -> manifest weight and
the layout transform, which modelkit writes) gets its torch state_dict names and layouts back without
building any model (no torch needed); anything else keeps the manifest's names ("dense/kernel") and
Keras layouts.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from modelkit.checkpoint import ARCH_KEY, ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import FormatError, ParseError, UnsupportedConversionError, reading
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import NAMES_KEY, json_object
from modelkit.models.keras_plan import (
    KerasPlan,
    in_torch_layout,
    keras_pieces,
    keras_plan,
    names_record,
    torch_names,
    torch_shape,
)
from modelkit.models.plugin import KERAS_TOPOLOGY_MODEL
from modelkit.parse import keras as keras_json
from modelkit.parse import tfjs as tfjs_json
from modelkit.parse.detect import tfjs as detect  # noqa: F401  (the converter's detect)
from modelkit.parse.paths import read_capped
from modelkit.storage import dtypes
from modelkit.storage.atomic import file_finished
from modelkit.storage.mapped import FileSpan, MappedFile
from modelkit.storage.tensors import decode_tfjs_codes
from modelkit.storage.transpose import Bands, RowBlocks
from modelkit.storage.write_behind import WriteBehind, write_all

MODEL_JSON = "model.json"
DEFAULT_SHARD_SIZE = 4 * 1024 * 1024        # tensorflowjs_converter's weight_shard_size_bytes default
_PIECE = 4 * 1024 * 1024                    # a large Dense kernel is transposed and written this much at a time
FORMAT = "layers-model"
METADATA_KEY = "userDefinedMetadata"
KERAS_VERSION = "tfjs-layers 4.22.0"        # what tfjs-layers' own model.save writes
# Checkpoint dtype -> (manifest dtype, quantization) as TF.js decodes it (io_utils.ts decodeWeight).
# A QuantizedTensor of this layout (modelkit.quantizers.tfjs_uint) is written as TF.js's uint8/uint16 weights.
QUANTIZED_LAYOUT = "tfjs"
_WRITTEN = {"float32": ("float32", None), "float16": ("float32", {"dtype": "float16"}), "int32": ("int32", None)}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"modelkit {version('modelkit')}"
    except PackageNotFoundError:
        return "modelkit"


# ---------------------------------------------------------------------------------------------
# Reading

def model_json(path: Path) -> Path:
    """The model.json of a folder, or the file itself."""
    return path / MODEL_JSON if path.is_dir() else path


def _model(file: Path) -> tfjs_json.Model:
    """model.json parsed by modelkit.parse.tfjs, its size checked before it is read."""
    with reading(file):
        return tfjs_json.read_model(read_capped(file, keras_json.MAX_JSON, "a model.json"))


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """The manifest's weights as lazy tensors (each read from its shards when loaded)."""
    from modelkit.scan import gate

    file = model_json(path)
    gate(file, trust=options.trust)
    model = _model(file)
    try:
        if model.format != FORMAT:
            raise ParseError(f"is a TF.js {model.format}; modelkit reads Layers models ({FORMAT}) only")
        shards = tfjs_json.resolve_shards(model, str(file.parent))
    except ParseError as e:
        raise FormatError(file, str(e)) from e
    tensors: dict[str, LazyTensor] = {}
    pieces: dict[str, Callable[[], list[np.ndarray]]] = {}
    for group, names in zip(model.groups, shards, strict=True):
        # sizes checked against the manifest just now; each shard mapped into memory on first use
        files = [_Shard(MappedFile(Path(name)), os.stat(name).st_size) for name in names]
        offset = 0
        for weight in group.weights:
            if weight.name in tensors:
                raise FormatError(file, f"weight {weight.name!r} appears twice in the manifest")
            tensors[weight.name] = _lazy(file, weight, files, offset)
            if weight.quantization is None:
                pieces[weight.name] = partial(_pieces, files, offset, weight.nbytes)
            offset += weight.nbytes
    metadata, arch = _metadata(file, model.document.get(METADATA_KEY))
    names = metadata.pop(NAMES_KEY, None)
    if arch is None and names is None and model.config is not None:         # built from the file's own topology
        # tensorflowjs_converter names a Keras 3 model's weights by their .weights.h5 paths (layers/dense/vars/0)
        keras3 = bool(tensors) and all(_KERAS3_WEIGHT.fullmatch(name) for name in tensors)
        arch = ArchSpec(KERAS_TOPOLOGY_MODEL, {"topology": model.config, **({"weights": "keras3"} if keras3 else {})})
    return _torch_names(file, Checkpoint(tensors=tensors, metadata=metadata, arch=arch), names, pieces)


def layers(path: Path) -> list[dict[str, str]]:
    """The topology's layers, for `modelkit inspect`: name, Keras class and the arguments that shape it."""
    return keras_json.describe_layers(_model(model_json(path)).config or {})


def _metadata(file: Path, given: Any) -> tuple[dict[str, str], ArchSpec | None]:
    if not isinstance(given, dict):
        return {}, None
    metadata = {k: v for k, v in given.items() if isinstance(k, str) and isinstance(v, str)}
    arch_json = metadata.pop(ARCH_KEY, None)
    return metadata, ArchSpec.from_json(arch_json, source=file) if arch_json is not None else None


_KERAS3_WEIGHT = re.compile(r"layers/.+/vars/\d+")
_DECODED = {"float32": "float32", "int32": "int32", "float16": "float16", "uint8": "uint8", "int8": "int8",
            "uint16": "uint16", "int16": "int16"}


class _Shard(NamedTuple):
    file: MappedFile
    size: int                       # what the manifest declares, checked when the model was opened


def _lazy(file: Path, weight: tfjs_json.Weight, files: list[_Shard], offset: int) -> LazyTensor:
    """One manifest weight at `offset` in its group's shards, decoded as TF.js decodes it."""
    q = weight.quantization
    source = f"{file}:{weight.name}"
    if weight.nbytes is None or (q is None and weight.dtype not in _DECODED):
        raise FormatError(file, f"weight {weight.name!r} is {weight.dtype}; modelkit reads numeric weights only")
    if q is None:
        dtype = dtypes.DTYPES[_DECODED[weight.dtype]]
        return LazyTensor(dtype, weight.shape, lambda: _bytes(files, offset, weight.nbytes).view(dtype.numpy)
                          .reshape(weight.shape), source, span=_span(files, offset, weight.nbytes))
    if q["dtype"] == "float16":
        dtype = dtypes.DTYPES["float16"]
        return LazyTensor(dtype, weight.shape, lambda: _bytes(files, offset, weight.nbytes).view(np.float16)
                          .reshape(weight.shape), source, span=_span(files, offset, weight.nbytes))
    scale, low = q.get("scale"), q.get("min", 0.0)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (scale, low)):
        raise FormatError(file, f"weight {weight.name!r} is {q['dtype']}-quantized without a finite scale and min")
    original = q.get("original_dtype", weight.dtype)
    stored = np.uint8 if q["dtype"] == "uint8" else np.dtype("<u2")
    out = dtypes.DTYPES["int32" if original == "int32" else "float32"]

    def dequantize() -> np.ndarray:
        codes = _bytes(files, offset, weight.nbytes).view(stored)
        return decode_tfjs_codes(codes, float(low), float(scale), integer=out.name == "int32").reshape(weight.shape)
    return LazyTensor(out, weight.shape, dequantize, source)


def _pieces(files: list[_Shard], offset: int, nbytes: int) -> list[np.ndarray]:
    """`nbytes` bytes at `offset` of the group's shards taken end to end (a weight may straddle shards), as
    uint8 views of the mapped shards, one per shard it lies in: nothing is copied."""
    pieces = []
    for shard in files:
        if nbytes == 0:
            break
        if offset >= shard.size:
            offset -= shard.size
            continue
        if os.stat(shard.file.path).st_size != shard.size:
            raise FormatError(shard.file.path, "the weight shards changed since the model was opened "
                              "(not the size the manifest says)")
        want = min(shard.size - offset, nbytes)
        pieces.append(shard.file.view(offset, want, "a weight"))
        nbytes, offset = nbytes - want, 0
    if nbytes:
        raise FormatError(files[-1].file.path if files else "<shards>", "the weight shards changed since the model "
                          "was opened (shorter than the manifest says)")
    return pieces


def _bytes(files: list[_Shard], offset: int, nbytes: int) -> np.ndarray:
    """The weight's bytes as one uint8 array: a view of its shard, or joined where it straddles shards."""
    pieces = _pieces(files, offset, nbytes)
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.empty(0, np.uint8)


def _span(files: list[_Shard], offset: int, nbytes: int) -> FileSpan | None:
    """Where the weight's bytes lie, when they lie in one shard (writers then copy them in the kernel)."""
    for shard in files:
        if offset < shard.size:
            return shard.file.span(offset, nbytes) if offset + nbytes <= shard.size and nbytes else None
        offset -= shard.size
    return None


def _dense_kernel(pieces: Callable[[], list[np.ndarray]], stored: LazyTensor, shape: tuple[int, ...],
                  bands: Bands) -> LazyTensor:
    """torch's (out, in) Dense kernel of a Keras (in, out) one stored across the shards (`pieces`: uint8
    views of them), never joined first: made by transposing each shard's rows straight from the mapped
    pages, streamed to a writer in bands (`chunks`, in the band buffers the model's kernels share), and
    compared with an array in the stored layout (`equals`: verification reads the shards, not a transposed
    copy of them)."""
    def blocks() -> RowBlocks:
        return RowBlocks.of_bytes(pieces(), stored.shape, stored.dtype.numpy)
    return LazyTensor(stored.dtype, shape, lambda: blocks().transposed(), stored.source,
                      equals=lambda array: blocks().equals_transposed(array),
                      chunks=lambda nbytes: blocks().transposed_chunks(nbytes, bands))


def _torch_names(file: Path, ckpt: Checkpoint, raw: str | None,
                 pieces: dict[str, Callable[[], list[np.ndarray]]]) -> Checkpoint:
    """The torch state_dict names and layouts back, where the file records them (modelkit's NAMES_KEY:
    state_dict name -> {"weight", "transform", "flatten"}, transforms from a closed set of transposes and
    reshapes); anything else as the manifest names it ("dense/kernel"), in Keras layouts."""
    if raw is None:
        return ckpt
    names = json_object(file, NAMES_KEY, raw, what="the torch name of each weight")
    tensors = torch_names(ckpt.tensors, names, lambda reason: FormatError(file, f"{NAMES_KEY} {reason}"))
    bands = Bands()                 # a writer streams the kernels one after another: one pair of buffers
    for name, entry in names.items():           # checked by torch_names: a stored weight, a known transform
        weight, transform = entry["weight"], entry["transform"]
        stored, shape = ckpt.tensors[weight], tensors[name].shape
        if transform == "dense_kernel" and len(shape) == 2 and weight in pieces:
            tensors[name] = _dense_kernel(pieces[weight], stored, shape, bands)
        elif transform == "same" and stored.span is not None:      # the same bytes: writers copy them file to file
            tensors[name] = LazyTensor(stored.dtype, shape, stored.reader, stored.source, span=stored.span)
    return Checkpoint(tensors=tensors, metadata=ckpt.metadata, arch=ckpt.arch)


def adopt_arch(ckpt: Checkpoint) -> Checkpoint:
    """A model TF.js wrote (Keras names, Keras layouts) given an architecture by the user (`--arch mlp`):
    its weights, in manifest order, taken as that architecture's Keras weights in Keras's order when every
    shape fits, under the torch names and layouts; unchanged otherwise (building the model then says what
    does not fit)."""
    if ckpt.arch is None or not ckpt.tensors:
        return ckpt
    plan = keras_plan(None, ckpt.arch)
    if isinstance(plan, str) or set(ckpt.tensors) <= set(plan.targets):
        return ckpt
    order = _order(plan)
    entries = list(ckpt.tensors.values())
    if len(entries) != len(order) or any(not isinstance(e, LazyTensor) or tuple(e.shape) != plan.targets[n].shape
                                         for e, n in zip(entries, order, strict=True)):
        return ckpt
    tensors = {name: in_torch_layout(entry, plan.targets[name].from_keras,
                                      torch_shape(plan.targets[name].spec, entry.shape))
               for entry, name in zip(entries, order, strict=True)}
    return Checkpoint(tensors=tensors, metadata=ckpt.metadata, arch=ckpt.arch)


# ---------------------------------------------------------------------------------------------
# Writing

def verify_plan(ckpt: Checkpoint, options: WriteOptions = WriteOptions()) -> tuple[set[str], dict[str, float]]:
    """Tensors Keras has no variable for (BatchNorm's num_batches_tracked) are not written."""
    plan = keras_plan(ckpt.tensors, ckpt.arch, options.module, options.example_inputs)
    return (set(ckpt.tensors) - set(plan.targets) if not isinstance(plan, str) else set()), {}


def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    """Write the folder at `path`: model.json and the shards, one weight at a time."""
    plan = keras_plan(ckpt.tensors, ckpt.arch, options.module, options.example_inputs, owner="no TF.js model")
    source = ckpt.arch.name if ckpt.arch else type(options.module).__name__ if options.module is not None else "checkpoint"
    if isinstance(plan, str):
        raise UnsupportedConversionError(source, "tfjs", f"a TF.js Layers model is a Keras model: {plan}")
    order = _order(plan)
    for name in order:
        entry = ckpt.tensors[name]
        if isinstance(entry, QuantizedTensor) and entry.layout != QUANTIZED_LAYOUT:
            raise UnsupportedConversionError("quantized checkpoint", "tfjs", f"tensor {name!r} is quantized "
                                             f"({entry.scheme}); TF.js stores its own uint8/uint16 weights "
                                             "(--scheme tfjs-uint8 or tfjs-uint16): quantize the float model so")
        if entry.dtype.name not in _WRITTEN:
            raise UnsupportedConversionError(source, "tfjs", f"tensor {name!r} is {entry.dtype.name}; TF.js reads "
                                             "float32, float16 and int32 weights: convert with --dtype f32 or f16")
    shard_size = options.shard_size or DEFAULT_SHARD_SIZE
    total = sum(ckpt.tensors[name].nbytes for name in order)
    count = max(1, -(-total // shard_size))
    paths = [f"group1-shard{i}of{count}.bin" for i in range(1, count + 1)]
    weights = []
    for name in order:
        target, entry = plan.targets[name], ckpt.tensors[name]
        dtype, quantization = _WRITTEN[entry.dtype.name]
        if isinstance(entry, QuantizedTensor):        # TF.js's uint8/uint16 codes with their min and scale
            quantization = {"dtype": entry.params["dtype"], "min": entry.params["min"],
                            "scale": entry.params["scale"], "original_dtype": dtype}
        spec: dict[str, Any] = {"name": f"{target.path}/{target.weight}", "shape": list(target.shape), "dtype": dtype}
        if quantization is not None:
            spec["quantization"] = quantization
        weights.append(spec)
    metadata = dict(ckpt.metadata)
    metadata[NAMES_KEY] = names_record(plan, order, lambda t: f"{t.path}/{t.weight}")
    if ckpt.arch is not None:
        metadata[ARCH_KEY] = ckpt.arch.to_json()
    document = {"format": FORMAT, "generatedBy": _version(), "convertedBy": _version(),
                "modelTopology": topology(plan), "weightsManifest": [{"paths": paths, "weights": weights}],
                METADATA_KEY: metadata}
    path.mkdir(exist_ok=True)
    bands = Bands()                                  # one pair of band buffers for every kernel
    with _Shards(path, paths, shard_size) as out:
        for name in order:
            target = plan.targets[name]
            entry = ckpt.tensors[name]
            stored = entry.parts["qdata"] if isinstance(entry, QuantizedTensor) else entry
            for piece in keras_pieces(target, stored.array(), _PIECE, bands):
                out.write(piece)
    (path / MODEL_JSON).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


def topology(plan: KerasPlan) -> dict[str, Any]:
    """The Keras model config in the dialect TF.js 4.22 reads: Keras 3's to_json, with the InputLayer's
    `batch_shape` spelled `batch_input_shape` (TF.js refuses an InputLayer without it: "An InputLayer should
    be passed either a `batchInputShape` or an `inputShape`") and the Keras version tfjs-layers records."""
    config = plan.layout.keras_json()
    for layer in config["config"]["layers"]:
        if layer["class_name"] == "InputLayer":
            layer["config"]["batch_input_shape"] = layer["config"].pop("batch_shape")
    return {**config, "keras_version": KERAS_VERSION, "backend": "tensor_flow.js"}


def _order(plan: KerasPlan) -> list[str]:
    """State_dict names in the order TF.js lists a model's weights: layer by layer, each layer's variables
    in Keras's order (Dense: kernel, bias; BatchNormalization: gamma, beta, moving_mean, moving_variance)."""
    return [name for name, _ in sorted(plan.targets.items(),
                                       key=lambda item: ([p for p, _ in plan.paths].index(item[1].path), item[1].index))]


class _Shards:
    """Bytes written end to end into the named shard files, each `size` bytes but the last, one step
    behind the caller (storage.write_behind): `write` returns once the piece before this one is written,
    so the caller makes the next piece (a transposed band) while this one goes to the page cache, and may
    reuse the buffer of two pieces ago."""

    def __init__(self, folder: Path, names: list[str], size: int) -> None:
        self.names: Iterator[str] = iter(names)
        self.folder, self.size, self.file, self.room = folder, size, None, 0
        self.behind = WriteBehind(self._write)

    def __enter__(self) -> _Shards:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        try:
            self.behind.__exit__(kind, *exc)         # the writes' own errors surface here
        finally:
            self._close()
        if kind is None:
            for name in self.names:                  # a model without weights still gets its (empty) shard
                (self.folder / name).write_bytes(b"")

    def write(self, array: np.ndarray) -> None:
        self.behind.write(array)

    def _close(self) -> None:
        """Close the shard being written; its write-back starts now (storage.atomic.file_finished)."""
        if self.file is not None:
            self.file.close()
            file_finished(Path(self.file.name))
            self.file = None

    def _write(self, array: np.ndarray) -> None:
        data = memoryview(array.reshape(-1).view(np.uint8))
        while len(data):
            if self.room == 0:
                self._close()
                self.file, self.room = open(self.folder / next(self.names), "wb"), self.size
            n = min(self.room, len(data))
            write_all(self.file, data[:n])
            data, self.room = data[n:], self.room - n
