"""keras: a Keras 3 `.keras` archive (what `model.save("m.keras")` writes and `keras.saving.load_model` reads).

Spec: keras/src/saving/saving_lib.py (save_model, _load_model_from_fileobj, H5IOStore), Keras 3.15.

Layout of a file modelkit writes (docs/formats/keras.md), a zip whose members are all stored, dated
1980-01-01, in this order (exactly three members: Keras reads a fourth as an assets folder):

    metadata.json      {"keras_version": "3.15.1" (the saving layout this follows),
                        "modelkit": {the Checkpoint's metadata, "modelkit.arch": ArchSpec JSON,
                                     "modelkit.names": JSON {state_dict name: {"weight": "layers/dense/vars/0",
                                                             "transform": "dense_kernel", "flatten"?: [C, H, W]}}}}
    config.json        the Keras model config (modelkit.models.keras_plan's layout, the one the HDF5
                       converter's .weights.h5 and the tfjs converter use): a Sequential of Keras layers
    model.weights.h5   Keras 3's weights layout: /vars (the model's own, none), /layers/<layer>/vars/<i>
                       (Dense kernel (in, out); Conv kernels (*k, in, out); channels_last; a Dense after
                       Flatten with its rows in Keras's (H, W, C) order), every layer's group present

Only models Keras can express are written: mlp, cnn and users' nn.Sequential modules (modelkit.models.keras_map);
anything else (tinylm's attention, plain tensors without an architecture) is refused before anything is written,
naming the first layer or reason. BatchNorm's num_batches_tracked has no Keras variable and is not stored.

Reading (ours and Keras's own): the scanner's gate first (a Lambda layer, a module outside Keras or a custom
object in config.json is judged there), then the directory and the two JSON members through
modelkit.parse.keras, and model.weights.h5 through modelkit.storage.hdf5_files (hard links only, sizes
checked before allocating). A stored weights member is read in place: each contiguous dataset is a view of
the mapped archive; a deflated one is decompressed into memory once, bounded by its declared size. With
modelkit's names record, tensors come back under their torch names and layouts (no model built, no torch
needed); otherwise as Keras names them ("layers/dense/vars/0"), and `--arch NAME` maps them by layer.
"""
from __future__ import annotations

import json
import mmap
import shutil
import zipfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from modelkit.checkpoint import ARCH_KEY, ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import FormatError, ModelkitError, ParseError, UnsupportedConversionError, reading
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import NAMES_KEY, json_object
from modelkit.models.keras_plan import (
    KERAS_DTYPES,
    KerasPlan,
    in_torch_layout,
    keras_plan,
    names_record,
    torch_names,
    torch_shape,
)
from modelkit.parse import keras as keras_json
from modelkit.parse import zipdir
from modelkit.parse.detect import keras as detect  # noqa: F401  (the converter's detect)
from modelkit.storage import hdf5_files

KERAS_VERSION = "3.15.1"          # the Keras release whose saving layout this follows (Keras reads no version)
METADATA_KEY = "modelkit"         # metadata.json: modelkit's str -> str entries
_DATE = (1980, 1, 1, 0, 0, 0)     # every member's timestamp: the same checkpoint gives the same bytes
_COPY_CHUNK = 16 << 20


# ---------------------------------------------------------------------------------------------
# Reading

def _archive(path: Path) -> keras_json.Archive:
    with reading(path, ".keras archive"), path.open("rb") as f:
        if not path.stat().st_size:
            raise ParseError("empty file: not a zip archive")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return keras_json.read_archive(buf)


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """The weights of model.weights.h5 as lazy tensors; metadata and ArchSpec from metadata.json."""
    from modelkit.scan import gate

    gate(path, trust=options.trust)
    archive = _archive(path)
    weights = archive.weights
    if weights.compress_type == zipdir.STORED:
        base = archive.weights_start

        def opener() -> h5py.File:
            return h5py.File(hdf5_files.Window(path, base, weights.file_size), "r")
    else:
        data = bytearray(weights.file_size)      # bounded: the directory's size, checked against deflate's ratio
        try:
            with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                zipdir.read_into(buf, weights, data)
        except ParseError as e:
            raise FormatError(path, f"{keras_json.ARCHIVE_WEIGHTS} cannot be read ({e})") from e
        raw, base = bytes(data), None

        def opener() -> h5py.File:
            import io
            return h5py.File(io.BytesIO(raw), "r")
    try:
        with opener() as f:
            entries = hdf5_files.plain_header(path, f, weights.file_size)
    except ModelkitError:
        raise
    except hdf5_files.H5_ERRORS as e:
        raise FormatError(path, f"{keras_json.ARCHIVE_WEIGHTS} is not a readable HDF5 file "
                                f"({hdf5_files.one_line(e)})") from e
    if base is None:                              # in memory: no span of the archive to view
        entries = {name: hdf5_files.Entry(e.link, e.stored, e.shape) for name, e in entries.items()}
    tensors = hdf5_files.lazy_tensors(path, entries, opener, base or 0)
    metadata, arch = _metadata(path, archive.metadata.get(METADATA_KEY))
    names = metadata.pop(NAMES_KEY, None)
    if names is not None:
        record = json_object(path, NAMES_KEY, names, what="the torch name of each weight")
        tensors = torch_names(tensors, record, lambda reason: FormatError(path, f"{NAMES_KEY} {reason}"))
    return Checkpoint(tensors=tensors, metadata=metadata, arch=arch)


def _metadata(path: Path, given: Any) -> tuple[dict[str, str], ArchSpec | None]:
    if not isinstance(given, dict):
        return {}, None
    metadata = {k: v for k, v in given.items() if isinstance(k, str) and isinstance(v, str)}
    arch_json = metadata.pop(ARCH_KEY, None)
    return metadata, ArchSpec.from_json(arch_json, source=path) if arch_json is not None else None


def layers(path: Path) -> list[dict[str, str]]:
    """config.json's layers, for `modelkit inspect`: name, Keras class and the arguments that shape it."""
    return keras_json.describe_layers(_archive(path).config)


def _stored_name(target: Any) -> str:
    return f"layers/{target.path}/vars/{target.index}"


def adopt_arch(ckpt: Checkpoint) -> Checkpoint:
    """An archive Keras wrote (Keras names) given an architecture by the user (`--arch mlp`): each of the
    architecture's Keras variables taken from its layer's path when every one is there with its shape, under
    the torch names and layouts; unchanged otherwise (building the model then says what does not fit)."""
    if ckpt.arch is None or not ckpt.tensors:
        return ckpt
    plan = keras_plan(None, ckpt.arch)
    if isinstance(plan, str) or set(ckpt.tensors) <= set(plan.targets):
        return ckpt
    found = {name: ckpt.tensors.get(_stored_name(t)) for name, t in plan.targets.items()}
    if any(not isinstance(e, LazyTensor) or tuple(e.shape) != plan.targets[n].shape for n, e in found.items()):
        return ckpt
    tensors = {name: in_torch_layout(entry, plan.targets[name].from_keras, torch_shape(plan.targets[name].spec, entry.shape))
               for name, entry in found.items()}
    return Checkpoint(tensors=tensors, metadata=ckpt.metadata, arch=ckpt.arch)


# ---------------------------------------------------------------------------------------------
# Writing

def verify_plan(ckpt: Checkpoint, options: WriteOptions = WriteOptions()) -> tuple[set[str], dict[str, float]]:
    """Tensors Keras has no variable for (BatchNorm's num_batches_tracked) are not written."""
    plan = keras_plan(ckpt.tensors, ckpt.arch, options.module, options.example_inputs)
    return (set(ckpt.tensors) - set(plan.targets) if not isinstance(plan, str) else set()), {}


def _plan(ckpt: Checkpoint, options: WriteOptions) -> KerasPlan:
    """The Keras layout, or UnsupportedConversionError naming why there is none."""
    source = ckpt.arch.name if ckpt.arch else type(options.module).__name__ if options.module is not None else "checkpoint"
    for name, entry in ckpt.tensors.items():
        if isinstance(entry, QuantizedTensor):
            raise UnsupportedConversionError("quantized checkpoint", "keras", f"tensor {name!r} is quantized "
                                             f"({entry.scheme}); dequantize it first")
    plan = keras_plan(ckpt.tensors, ckpt.arch, options.module, options.example_inputs, owner="no .keras model")
    if isinstance(plan, str):
        raise UnsupportedConversionError(source, "keras", f"a .keras archive is a Keras model: {plan}")
    for name in plan.targets:
        if ckpt.tensors[name].dtype.name not in KERAS_DTYPES:
            raise UnsupportedConversionError(source, "keras", f"tensor {name!r} is {ckpt.tensors[name].dtype.name}; "
                                             "Keras variables are floating point")
    return plan


def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    """Write the archive at `path`: model.weights.h5 first (beside it, one weight at a time), then the zip."""
    plan = _plan(ckpt, options)
    metadata = dict(ckpt.metadata)
    metadata[NAMES_KEY] = names_record(plan, list(plan.targets), _stored_name)
    if ckpt.arch is not None:
        metadata[ARCH_KEY] = ckpt.arch.to_json()
    weights = path.with_name(path.name + ".weights.h5")
    try:
        with h5py.File(weights, "w", libver=("v108", "latest")) as f:
            hdf5_files.keras_groups(f, [p for p, _ in plan.paths])
            for name, target in plan.targets.items():
                value = np.ascontiguousarray(target.to_keras(ckpt.tensors[name].array()))
                hdf5_files.keras_variable(f, target.path, target.index, value, ckpt.tensors[name].dtype)
                del value
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
            zf.writestr(_info(keras_json.ARCHIVE_METADATA), _json({"keras_version": KERAS_VERSION, METADATA_KEY: metadata}))
            zf.writestr(_info(keras_json.ARCHIVE_CONFIG), _json(plan.layout.keras_json()))
            info = _info(keras_json.ARCHIVE_WEIGHTS)
            info.file_size = weights.stat().st_size       # so zipfile writes zip64 sizes when they need it
            with weights.open("rb") as src, zf.open(info, "w") as out:
                shutil.copyfileobj(src, out, _COPY_CHUNK)
    finally:
        weights.unlink(missing_ok=True)


def _info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_DATE)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    return info


def _json(doc: Any) -> bytes:
    return json.dumps(doc, indent=1).encode("utf-8")
