"""HDF5: a lossless `modelkit` group, plus the weights in the layout Keras loads where a Keras model exists.

Spec: https://docs.hdfgroup.org/hdf5/latest/_f_m_t3.html (read and written with h5py, the
reference Python binding). Keras layouts: keras/src/saving/saving_lib.py (H5IOStore, Keras 3
`.weights.h5`) and keras/src/legacy/saving/legacy_h5_format.py (Keras 2 `.h5`), Keras 3.15.

Layout of a file modelkit writes:

    /                          attrs: modelkit.keras_layout ("keras" | "none"),
                                      modelkit.keras_note (the Keras model it fits, or why none),
                                      modelkit.keras_json (with a Keras layout: the model as Keras's
                                      to_json() writes it, for keras.models.model_from_json);
                                      Keras 2 legacy: layer_names, keras_version
    /modelkit                  attrs: version = 1
    /modelkit/metadata         attrs: the Checkpoint's str -> str metadata; modelkit.arch (ArchSpec JSON)
                               (every string modelkit reads is fixed-length UTF-8, see _str_attr)
    /modelkit/tensors/<name>   one dataset per tensor in state_dict order, named by its state_dict key
                               ('%' -> %25, '/' -> %2F, NUL -> %00, a lone '.' -> %2E); attr dtype: the
                               torch dtype. Dtypes HDF5 lacks are stored as the unsigned integer of the
                               same width (bfloat16 as uint16, float8 as uint8, complex32 as uint32).
    /vars, /layers/<layer>/vars/<i>   Keras 3 `.weights.h5`: for models that declare keras_layers (mlp, cnn)
                               and users' nn.Sequential modules (modelkit.models.keras_map), copies
                               (Dense kernel (in, out); Conv2D kernel (kh, kw, in, out))
    /<layer>/<layer>/kernel:0 ...     Keras 2 legacy `.h5`: hard links to the Keras 3 datasets (no extra
                               bytes; float32 copies of bfloat16 weights, which that reader lacks)

Keras 3's `load_weights` picks its reader by file name (`.weights.h5`: H5IOStore; `.h5`/`.hdf5`:
the legacy reader), so a file holding both layouts loads under either name. The Keras layouts are
derived data: reading always takes the `modelkit` group. A file without it (written by Keras)
reads as a Checkpoint of its dataset paths ("layers/dense/vars/0").

Reading is lazy (datasets are read when a tensor is loaded) and follows hard links only: soft and
external links, external raw storage and virtual datasets are refused, and a dataset whose size
exceeds what the file can hold is refused before anything is allocated. Writing streams one
tensor at a time.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import h5py
import numpy as np

from modelkit.checkpoint import ALIASES_KEY, ARCH_KEY, ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import FormatError, ModelkitError, UnsupportedConversionError, reading
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import KERAS_JSON_ATTR, KERAS_LAYOUT_ATTR, KERAS_NOTE_ATTR
from modelkit.models.keras_plan import KerasPlan, keras_plan
from modelkit.models.plugin import KERAS_TOPOLOGY_MODEL
from modelkit.parse import hdf5 as hdf5_header
from modelkit.parse import keras as keras_json
from modelkit.parse.detect import KERAS_WEIGHTS, keras_weights
from modelkit.parse.detect import hdf5 as detect  # noqa: F401  (the converter's detect)
from modelkit.parse.paths import read_capped
from modelkit.storage import hdf5_files
from modelkit.storage.atomic import companion_name
from modelkit.storage.dtypes import DType, contiguous, dtype_name, widen_to_float32
from modelkit.storage.mapped import FileSpan, copy_span

logger = logging.getLogger(__name__)

SIGNATURE = hdf5_header.SIGNATURE      # the superblock signature, at offset 0 in files h5py and Keras write
GROUP = "modelkit"
VERSION = 1
LAYOUT_ATTR = KERAS_LAYOUT_ATTR
NOTE_ATTR = KERAS_NOTE_ATTR
JSON_ATTR = KERAS_JSON_ATTR
# A `.weights.h5` output gets the architecture beside it, `m.weights.h5` -> `m.json` (Keras's model.to_json(), for
# keras.models.model_from_json; FORMATS["hdf5"].companions, so it is renamed into place with the weights).
ARCHITECTURE_SIDECAR = (".weights.h5", ".json")
_LIBVER = ("v108", "latest")           # HDF5 1.8 format: attributes over 64 KiB (long metadata) fit


DTYPES = hdf5_files.DTYPES


# ---------------------------------------------------------------------------------------------
# Reading

def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """Names, dtypes, shapes and metadata now; each dataset is read when its tensor is loaded. A Keras
    architecture JSON (`m.json`, scanned first) reads as the `m.weights.h5` beside it."""
    if path.suffix == ".json":
        ckpt = read(_architecture_weights(path, options), options)
        if ckpt.arch is not None or not all(name.startswith("layers/") for name in ckpt.tensors):
            return ckpt
        # Keras's own pair: built from the architecture JSON (models/keras_graph), the weights as Keras 3 names them
        config = keras_json.model_config(keras_json.load_json(read_capped(path, keras_json.MAX_JSON,
                                                                          "a Keras architecture")))
        arch = ArchSpec(KERAS_TOPOLOGY_MODEL, {"topology": config, "weights": "keras3"}) if config is not None else None
        return Checkpoint(tensors=ckpt.tensors, metadata=ckpt.metadata, arch=arch)
    try:
        size = path.stat().st_size
        with h5py.File(path, "r", locking=False) as f:
            if f.id.links.exists(GROUP.encode()):
                entries, metadata = _modelkit_header(path, f, size)
            else:
                entries, metadata = hdf5_files.plain_header(path, f, size), {}
    except ModelkitError:
        raise
    except hdf5_files.H5_ERRORS as e:
        raise FormatError(path, f"not a readable HDF5 file ({hdf5_files.one_line(e)})") from e
    tensors = hdf5_files.lazy_tensors(path, entries, lambda: h5py.File(path, "r", locking=False))
    arch_json = metadata.pop(ARCH_KEY, None)
    arch = ArchSpec.from_json(arch_json, source=path) if arch_json is not None else None
    return Checkpoint(tensors=tensors, metadata=metadata, arch=arch)


def _architecture_weights(path: Path, options: ReadOptions) -> Path:
    """The `.weights.h5` of a Keras architecture JSON, once the scanner's gate passed the JSON (a Lambda
    layer carrying code is refused there)."""
    from modelkit.scan import gate

    weights = keras_weights(path)
    if weights is None:
        raise FormatError(path, f"is not a Keras architecture JSON with its weights beside it "
                          f"({path.stem}{KERAS_WEIGHTS}); write both with modelkit convert SRC {path.stem}{KERAS_WEIGHTS}")
    gate(path, trust=options.trust)
    return weights


def layers(path: Path) -> list[dict[str, str]] | None:
    """A Keras architecture JSON's layers, for `modelkit inspect` (None for an HDF5 file)."""
    if path.suffix != ".json":
        return None
    with reading(path):
        config = keras_json.model_config(keras_json.load_json(read_capped(path, keras_json.MAX_JSON,
                                                                          "a Keras architecture")))
    if config is None:
        raise FormatError(path, "is not a Keras model config (no class_name)")
    return keras_json.describe_layers(config)


def _modelkit_header(path: Path, f: h5py.File, size: int) -> tuple[dict[str, hdf5_files.Entry], dict[str, str]]:
    group = hdf5_files.child(path, f, GROUP, h5py.Group)
    kind = group.attrs.get_id("version").dtype if "version" in group.attrs else None
    version = group.attrs["version"] if kind is not None and kind.kind in "iu" and not kind.shape else None
    if not isinstance(version, (int, np.integer)) or version < 1:
        raise FormatError(path, f"the {GROUP} group has no valid version attribute (an integer >= 1)")
    if version > VERSION:
        raise FormatError(path, f"written by a newer modelkit ({GROUP} layout version {version}, this one reads "
                                f"{VERSION}); upgrade modelkit")
    meta_group = hdf5_files.child(path, group, "metadata", h5py.Group)
    metadata = {key: _str_attr(path, meta_group, key) for key in meta_group.attrs}
    tensors = hdf5_files.child(path, group, "tensors", h5py.Group)
    entries: dict[str, hdf5_files.Entry] = {}
    for key in tensors:
        dataset = hdf5_files.child(path, tensors, key, h5py.Dataset)
        name = _unescape(key)
        code = _str_attr(path, dataset, "dtype")
        stored = DTYPES.get(code)
        if stored is None:
            raise FormatError(path, f"tensor {name!r} has dtype {code!r}; known: {', '.join(DTYPES)}")
        hdf5_files.check_dataset(path, name, dataset, size, stored.numpy)
        if name in entries:
            raise FormatError(path, f"tensor {name!r} appears twice in the {GROUP} group")
        entries[name] = hdf5_files.Entry((GROUP, "tensors", key), stored, tuple(dataset.shape),
                                         hdf5_files.raw_offset(dataset, size))
    return entries, metadata


def _str_attr(path: Path, obj: h5py.HLObject, key: str) -> str:
    """A fixed-length UTF-8 string attribute (variable-length strings live in HDF5's global heap,
    where a corrupt file can make the HDF5 library loop: modelkit neither writes nor reads them)."""
    if key not in obj.attrs:
        raise FormatError(path, f"{obj.name} has no {key!r} attribute")
    kind = obj.attrs.get_id(key).dtype
    string = h5py.check_string_dtype(kind)
    if string is None or string.length is None or kind.shape:
        raise FormatError(path, f"attribute {key!r} of {obj.name} is not a fixed-length string ({kind})")
    value = obj.attrs[key]
    if not isinstance(value, bytes):
        raise FormatError(path, f"attribute {key!r} of {obj.name} is not a single string")
    return value.decode("utf-8")


def _set_str_attr(obj: h5py.HLObject, key: str, value: str) -> None:
    data = value.encode("utf-8")
    obj.attrs.create(key, np.bytes_(data), dtype=h5py.string_dtype("utf-8", max(len(data), 1)))


_ESCAPE = re.compile(r"%([0-9A-F]{2})")


def _escape(name: str) -> str:
    """A state_dict key as one HDF5 link name ('/' would make groups; '.' names the group itself)."""
    key = name.replace("%", "%25").replace("/", "%2F").replace("\x00", "%00")
    return "%2E" if key == "." else key


def _unescape(key: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), key)


# ---------------------------------------------------------------------------------------------
# Keras layouts (modelkit.models.keras_plan)

def _write_keras_groups(f: h5py.File, plan: KerasPlan) -> None:
    hdf5_files.keras_groups(f, [path for path, _ in plan.paths])
    weighted = [(path, layer) for path, layer in plan.paths if layer.weights]
    f.attrs["layer_names"] = np.array([path.encode() for path, _ in weighted])
    f.attrs["keras_version"] = b"2.0.0"             # any but "1": Keras 2 rewrites weights it thinks Keras 1 wrote
    for path, layer in weighted:
        f.create_group(path).attrs["weight_names"] = np.array([f"{path}/{w.keras}:0".encode() for w in layer.weights])


def _write_keras_weight(f: h5py.File, plan: KerasPlan, name: str, array: np.ndarray, dtype: DType) -> None:
    target = plan.targets[name]
    path, index, weight = target.path, target.index, target.weight
    value = np.ascontiguousarray(target.to_keras(array))
    legacy_name = f"{path}/{weight}:0"
    dataset = hdf5_files.keras_variable(f, path, index, value, dtype)
    if dtype.name == "bfloat16":
        # The Keras 2 reader knows no bfloat16, so its copy is float32 (exact: bfloat16 is float32's top half).
        f[path].create_dataset(legacy_name, data=widen_to_float32(value, dtype))
    else:
        f[path][legacy_name] = dataset              # a hard link: the same bytes under the Keras 2 name


# ---------------------------------------------------------------------------------------------
# Writing

def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    """Write the `modelkit` group and, for mlp, cnn and a user's Sequential (`options.module`, mapped
    by modelkit.models.keras_map), the Keras layouts; one tensor at a time.

    A final name ending in `.weights.h5` asks for the Keras layout: when the checkpoint has none,
    this raises UnsupportedConversionError before writing anything. Any other name gets the
    `modelkit` group alone in that case, and the file's `modelkit.keras_note` says why.
    """
    final = options.final_path or path
    keys = _check_writable(ckpt)
    plan = keras_plan(ckpt.tensors, ckpt.arch, options.module, options.example_inputs, owner=f"the {GROUP} group")
    if isinstance(plan, str):
        if final.name.endswith(".weights.h5"):
            raise UnsupportedConversionError(
                ckpt.arch.name if ckpt.arch else type(options.module).__name__ if options.module is not None
                else "checkpoint", "Keras .weights.h5",
                f"{plan}; choose a name without .weights.h5 (e.g. {final.name.removesuffix('.weights.h5')}.h5) "
                f"to write the lossless {GROUP} group alone",
            )
        logger.info("%s: no Keras layout written: %s", final, plan)
    aliases = _aliases(ckpt)
    reserved: list[tuple[int, FileSpan]] = []     # (offset in the new file, where the bytes are now)
    with h5py.File(path, "w", libver=_LIBVER) as f:
        if isinstance(plan, str):
            f.attrs[LAYOUT_ATTR] = "none"
            f.attrs[NOTE_ATTR] = plan
        else:
            f.attrs[LAYOUT_ATTR] = "keras"
            f.attrs[NOTE_ATTR] = f"the weights of Keras {plan.description}"
            f.attrs[JSON_ATTR] = plan.keras_json
            _write_keras_groups(f, plan)
        group = f.create_group(GROUP, track_order=True)
        group.attrs["version"] = VERSION
        meta = group.create_group("metadata", track_order=True)
        for key, value in ckpt.metadata.items():
            _set_str_attr(meta, key, value)
        if ckpt.arch is not None:
            _set_str_attr(meta, ARCH_KEY, ckpt.arch.to_json())
        tensors = group.create_group("tensors", track_order=True)
        for name, entry in ckpt.tensors.items():
            keras = not isinstance(plan, str) and name in plan.targets
            if name in aliases and not keras:
                tensors[keys[name]] = tensors[keys[aliases[name]]]     # tied: a hard link, stored once
                continue
            if not keras and name not in aliases and _copyable(entry):
                dataset, offset = _reserve(tensors, keys[name], entry)
                _set_str_attr(dataset, "dtype", dtype_name(entry.dtype))
                reserved.append((offset, entry.span))
                continue
            array = contiguous(entry.array())                  # stored bits (uint16 for bfloat16)
            if name in aliases:
                tensors[keys[name]] = tensors[keys[aliases[name]]]
            else:
                _set_str_attr(tensors.create_dataset(keys[name], data=array), "dtype", dtype_name(entry.dtype))
            if keras:
                _write_keras_weight(f, plan, name, array, entry.dtype)
            del array
    with path.open("r+b") as out:                  # HDF5 is closed: fill the reserved bytes, file to file
        for offset, span in reserved:
            copy_span(span, out, at=offset)
    sidecar = companion_name(final, ARCHITECTURE_SIDECAR)
    if sidecar is not None and not isinstance(plan, str):      # m.weights.h5 -> m.json, as Keras users pair them
        path.with_name(sidecar).write_text(plan.keras_json + "\n", encoding="utf-8")


def _copyable(entry: LazyTensor | QuantizedTensor) -> bool:
    """Bytes stored unchanged from another file, in a dataset HDF5 lays out contiguously."""
    return isinstance(entry, LazyTensor) and entry.span is not None and len(entry.shape) > 0 and entry.numel > 0


def _reserve(group: h5py.Group, name: str, entry: LazyTensor) -> tuple[h5py.Dataset, int]:
    """A contiguous dataset whose space is allocated now and never filled (its bytes come later
    from copy_span); returns it and the file offset of its data."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)                # as h5py's create_dataset: the same bytes on every run
    space = h5py.h5s.create_simple(tuple(entry.shape))
    dataset = h5py.Dataset(h5py.h5d.create(group.id, name.encode("utf-8"), h5py.h5t.py_create(DTYPES[entry.dtype.name].numpy), space,
                                           dcpl=dcpl))
    offset = dataset.id.get_offset()
    if offset is None or dataset.id.get_storage_size() != entry.nbytes:
        raise UnsupportedConversionError("checkpoint", "hdf5", f"HDF5 did not lay out {name!r} contiguously")
    return dataset, offset


def _check_writable(ckpt: Checkpoint) -> dict[str, str]:
    """Everything HDF5 cannot hold, refused before the file is created; returns name -> link name."""
    for name, entry in ckpt.tensors.items():
        if isinstance(entry, QuantizedTensor):
            raise UnsupportedConversionError(
                "quantized checkpoint", "hdf5",
                f"tensor {name!r} is quantized ({entry.scheme}); HDF5 does not store quantized tensors yet: "
                "dequantize it first",
            )
        if entry.dtype.name not in DTYPES:
            raise UnsupportedConversionError(str(entry.dtype), "hdf5", f"tensor {name!r} has a dtype modelkit cannot "
                                             f"store in HDF5 (known: {', '.join(DTYPES)})")
        if not name:
            raise UnsupportedConversionError("checkpoint", "hdf5", "a tensor has an empty name, which HDF5 cannot hold")
    for key, value in ckpt.metadata.items():
        if not key or "\x00" in key or "\x00" in value:
            raise UnsupportedConversionError(
                "checkpoint", "hdf5", f"metadata entry {key!r} is empty or holds a NUL character; HDF5 strings cannot")
    return {name: _escape(name) for name in ckpt.tensors}


def _aliases(ckpt: Checkpoint) -> dict[str, str]:
    """Tied names (alias -> stored name) that can share the stored dataset."""
    try:
        aliases = json.loads(ckpt.metadata.get(ALIASES_KEY, "{}"))
    except json.JSONDecodeError:
        return {}
    if not isinstance(aliases, dict):
        return {}
    order = {name: i for i, name in enumerate(ckpt.tensors)}
    spec = {name: (t.dtype, tuple(t.shape)) for name, t in ckpt.tensors.items()}
    # The stored name must come first (it is written before its alias) and be stored itself.
    return {alias: target for alias, target in aliases.items()
            if isinstance(target, str) and target not in aliases and alias in order and target in order
            and order[target] < order[alias] and spec[target] == spec[alias]}
