"""Which format a file holds, decided from its first bytes (and a zip's central directory).

One function per format, each reading a few KB at most and never unpickling. The format table
(modelkit.formats) calls these without importing the converters, so detecting a file costs no
torch, onnx or h5py import; each converter's `detect` is the same function. Standard library only.
"""
from __future__ import annotations

import mmap
from pathlib import Path

from modelkit.errors import ParseError
from modelkit.parse import gguf as gguf_header
from modelkit.parse import hdf5 as hdf5_header
from modelkit.parse import hf as hf_folder
from modelkit.parse import keras as keras_config
from modelkit.parse import npz as npz_members
from modelkit.parse import openvino as openvino_ir
from modelkit.parse import pt2 as pt2_archive
from modelkit.parse import safetensors as safetensors_header
from modelkit.parse import tfjs as tfjs_json
from modelkit.parse import zipdir
from modelkit.parse.onnx import is_model
from modelkit.parse.pickle_opcodes import LEGACY_MAGIC
from modelkit.parse.sniff import torch_zip_roots

ZIP_MAGIC = b"PK\x03\x04"
# A legacy torch.save file starts with its magic number pickled alone: PROTO 2, LONG1 magic, STOP.
TORCH_LEGACY_HEAD = b"\x80\x02\x8a\x0a" + LEGACY_MAGIC.to_bytes(10, "little") + b"."
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


def _head(path: Path, size: int) -> bytes:
    with path.open("rb") as f:
        return f.read(size)


def hf(path: Path) -> bool:
    """A Hugging Face model folder: config.json naming a model_type, plus safetensors weights."""
    return hf_folder.is_model_folder(path)


TFJS_MODEL = "model.json"
_TFJS_HEAD = 4096


def tfjs(path: Path) -> bool:
    """A TensorFlow.js model.json (or a folder holding one): JSON whose first 4 KB hold a TF.js format name
    or the topology and manifest keys (tensorflowjs_converter and modelkit write `format` first)."""
    try:
        if path.is_dir():
            path = path / TFJS_MODEL
        if not path.is_file():
            return False
        head = _head(path, _TFJS_HEAD).lstrip()
    except OSError:
        return False
    if not head.startswith(b"{"):
        return False
    return (any(b'"%s"' % name.encode() in head for name in tfjs_json.FORMATS)
            or b'"modelTopology"' in head and b'"weightsManifest"' in head
            or path.name == TFJS_MODEL and (b'"modelTopology"' in head or b'"weightsManifest"' in head))


def safetensors(path: Path) -> bool:
    """A safetensors file (plausible 8-byte header length, then '{'), a sharded folder or its index.
    A folder that is a Hugging Face model folder (config.json with a model_type) is `hf`'s."""
    if path.is_dir():
        return ((path / SAFETENSORS_INDEX).is_file() or (path / SAFETENSORS_SINGLE).is_file()) and not hf(path)
    if path.name.endswith(".safetensors.index.json"):
        return path.is_file()
    try:
        return path.is_file() and safetensors_header.plausible(_head(path, 9), path.stat().st_size)
    except OSError:
        return False


def gguf(path: Path) -> bool:
    """A whole GGUF header: the magic, version 2 or 3, and two counts (24 bytes)."""
    try:
        return path.is_file() and gguf_header.plausible(_head(path, gguf_header.HEADER_BYTES))
    except OSError:
        return False


def hdf5(path: Path) -> bool:
    """The HDF5 signature and a plausible superblock at the start (16 bytes).

    HDF5 also allows the signature after a user block (at 512, 1024, ... bytes); such a file
    starts with other bytes, possibly another format's, so detection does not claim it
    (`--format hdf5` still reads it).
    """
    try:
        return path.is_file() and hdf5_header.plausible_superblock(_head(path, hdf5_header.SUPERBLOCK_HEAD))
    except OSError:
        return False


def onnx(path: Path) -> bool:
    """A ModelProto: ir_version first (as every protobuf writer orders it), then known fields up to
    the graph. Walks field headers through an mmap, so only a few pages are read."""
    try:
        if not path.is_file() or path.stat().st_size < 4:
            return False
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return is_model(buf)
    except (OSError, ValueError):
        return False


def torch_save_prefix(names: list[str]) -> str | None:
    """The folder holding data.pkl in a torch.save zip; None for TorchScript and other zips."""
    for prefix, constants, code in torch_zip_roots(names):
        return None if constants or code else prefix
    return None


def torchscript_prefix(names: list[str]) -> str | None:
    """The folder holding data.pkl, constants.pkl and code/ (torch.jit.save); None for other zips."""
    return next((prefix for prefix, constants, code in torch_zip_roots(names) if constants and code), None)


def pth(path: Path) -> bool:
    """A torch.save file: a zip with `<archive>/data.pkl` that is not TorchScript, or the legacy magic."""
    try:
        if not path.is_file():
            return False
        head = _head(path, len(TORCH_LEGACY_HEAD))
        if head == TORCH_LEGACY_HEAD:
            return True
        return head.startswith(ZIP_MAGIC) and torch_save_prefix(zipdir.member_names(path)) is not None
    except (OSError, ParseError):
        return False


def torchscript(path: Path) -> bool:
    """A zip whose folder holds data.pkl, constants.pkl and code/ (what torch.jit.save writes)."""
    try:
        return (path.is_file() and _head(path, 4) == ZIP_MAGIC
                and torchscript_prefix(zipdir.member_names(path)) is not None)   # the central directory only
    except (OSError, ParseError):
        return False


def pt2(path: Path) -> bool:
    """A zip whose folder holds archive_format and models/<name>.json (what torch.export.save writes): the
    central directory only."""
    try:
        return (path.is_file() and _head(path, 4) == ZIP_MAGIC
                and pt2_archive.root_of(zipdir.member_names(path)) is not None)
    except (OSError, ParseError):
        return False


def npz(path: Path) -> bool:
    """A zip (numpy.savez / savez_compressed) whose members are all `<name>.npy`, plus optionally modelkit's
    `modelkit.json`: the central directory only. torch, TorchScript and Keras zips hold other members."""
    try:
        return (path.is_file() and _head(path, 4) == ZIP_MAGIC
                and npz_members.is_npz(zipdir.member_names(path)))
    except (OSError, ParseError):
        return False


def keras(path: Path) -> bool:
    """A Keras 3 `.keras` archive: a zip holding config.json beside metadata.json or model.weights.h5 (the
    central directory only)."""
    try:
        return (path.is_file() and _head(path, 4) == ZIP_MAGIC
                and keras_config.is_archive(zipdir.member_names(path)))
    except (OSError, ParseError):
        return False


def openvino(path: Path) -> bool:
    """An OpenVINO IR .xml: an XML document whose root element is <net> (the first 4 KB)."""
    try:
        return path.is_file() and openvino_ir.looks_like_ir(_head(path, openvino_ir.HEAD))
    except OSError:
        return False


def _saved_model_file(path: Path) -> Path | None:
    from modelkit.parse.savedmodel import SAVED_MODEL_FILE

    file = path / SAVED_MODEL_FILE if path.is_dir() else path
    return file if file.name == SAVED_MODEL_FILE and file.is_file() else None


def savedmodel(path: Path) -> bool:
    """A TensorFlow SavedModel: a folder holding saved_model.pb (or that file), which starts as a SavedModel
    does (schema version 1, then a meta graph)."""
    from modelkit.parse.savedmodel import looks_like

    try:
        file = _saved_model_file(path)
        if file is None:
            return False
        head = _head(file, 64)
        return looks_like(head, 0, len(head))
    except OSError:
        return False


def tf_index(path: Path) -> Path | None:
    """The checkpoint index `path` names: PREFIX.index itself, or the only *.index of a folder that is not a
    SavedModel; None otherwise."""
    try:
        if path.is_dir():
            if (path / "saved_model.pb").exists():
                return None
            found = [p for p in path.glob("*.index") if p.is_file()]
            return found[0] if len(found) == 1 else None
        return path if path.suffix == ".index" and path.is_file() else None
    except OSError:
        return None


def tfcheckpoint(path: Path) -> bool:
    """A TensorFlow checkpoint: PREFIX.index (or a folder with one), a sorted table ending in its magic number."""
    from modelkit.parse.tf_bundle import FOOTER_BYTES, TABLE_MAGIC

    index = tf_index(path)
    try:
        if index is None or index.stat().st_size < FOOTER_BYTES:
            return False
        with index.open("rb") as f:
            f.seek(-8, 2)
            return int.from_bytes(f.read(8), "little") == TABLE_MAGIC
    except OSError:
        return False


def ggml(path: Path) -> bool:
    """A legacy llama.cpp file: the 'ggml', 'ggmf' or 'ggjt' magic (and a known version) in its first 8 bytes."""
    from modelkit.parse.ggml import magic

    try:
        return path.is_file() and magic(_head(path, 8)) is not None
    except OSError:
        return False
