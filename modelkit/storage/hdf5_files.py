"""HDF5 files as tensors, for the converters that hold HDF5 (hdf5: `.h5`/`.weights.h5`; keras: the
`model.weights.h5` member of a `.keras` archive): the datasets of a file, checked before anything is
allocated and read lazily, and Keras 3's `.weights.h5` layout (`/vars`, `/layers/<layer>/vars/<i>`) written
from a Keras plan (modelkit.models.keras_plan).

Spec: https://docs.hdfgroup.org/hdf5/latest/_f_m_t3.html, read and written with h5py. Only hard links are
followed: soft and external links, external raw storage and virtual datasets are refused, and a dataset
whose size exceeds what the file can hold is refused before anything is allocated. An HDF5 file may lie
inside another file (a stored zip member): `base` is where its bytes start, and each reader opens it
again through the `opener` it was given.
"""
from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from modelkit.errors import FormatError, ModelkitError
from modelkit.storage import dtypes
from modelkit.storage.dtypes import DType
from modelkit.storage.mapped import MappedFile
from modelkit.storage.tensors import LazyTensor

_SMALL = 1 << 20                       # any dataset may declare this much, whatever the file size
_MAX_EXPANSION = 1000                  # compressed data may expand this much (as Keras allows)
# What h5py raises on malformed files; wrapped into FormatError.
H5_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError, IndexError, OverflowError, UnicodeError)
Opener = Callable[[], h5py.File]


@dataclass(frozen=True)
class Stored:
    """How one dtype lives in HDF5: the numpy dtype of the dataset (the same-width unsigned type
    for dtypes numpy lacks: bfloat16 as uint16 bits)."""

    dtype: DType
    numpy: np.dtype

    @property
    def bits(self) -> bool:
        """The dataset holds raw bits, not values numpy knows (bfloat16, float8)."""
        return not self.dtype.exact


DTYPES: dict[str, Stored] = {name: Stored(d, d.numpy) for name, d in dtypes.DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    link: tuple[str, ...]        # link names from the root to the dataset
    stored: Stored
    shape: tuple[int, ...]
    offset: int | None = None    # where the raw little-endian bytes lie in the HDF5 file, when they lie in one piece

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.stored.numpy.itemsize


class Window(io.RawIOBase):
    """Bytes [base, base + size) of a file as a read-only file of their own (h5py's file-object driver):
    an HDF5 file stored uncompressed inside a zip archive."""

    def __init__(self, path: Path, base: int, size: int) -> None:
        super().__init__()
        self._file, self._base, self._size, self._pos = open(path, "rb"), base, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, start + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        want = max(0, min(len(buffer), self._size - self._pos))
        self._file.seek(self._base + self._pos)
        got = self._file.readinto(memoryview(buffer)[:want]) or 0
        self._pos += got
        return got

    def close(self) -> None:
        self._file.close()
        super().close()


def lazy_tensors(path: Path, entries: dict[str, Entry], opener: Opener, base: int = 0) -> dict[str, LazyTensor]:
    """Each entry as a LazyTensor: a view of the mapped file (with a FileSpan writers copy file to file) where
    its bytes lie in one piece at `base` + its offset, else read through `opener` when loaded."""
    mapped = MappedFile(path)

    def lazy(name: str, e: Entry) -> LazyTensor:
        if e.offset is None:
            return LazyTensor(e.stored.dtype, e.shape, lambda: load(path, e, opener), f"{path}:{name}")
        at = base + e.offset
        return LazyTensor(e.stored.dtype, e.shape, lambda: _view(mapped, name, e, at), f"{path}:{name}",
                          span=mapped.span(at, e.nbytes))

    return {name: lazy(name, e) for name, e in entries.items()}


def plain_header(path: Path, f: h5py.File, size: int) -> dict[str, Entry]:
    """Every dataset of a file modelkit did not write (a Keras weights file), named by its path."""
    links: list[tuple[bytes, int]] = []
    # The low-level walk: the callback only records (h5py's own wrapper makes calls that a corrupt
    # file turns into SystemError). It lists every link without following any.
    f.id.links.visit(lambda name, info: links.append((name, info.type)), info=True)
    for raw, kind in links:
        if kind != h5py.h5l.TYPE_HARD:
            raise link_error(path, raw.decode("utf-8", "replace"), kind)
    entries: dict[str, Entry] = {}
    for raw, _ in links:
        name = raw.decode("utf-8")
        obj = f[name]
        if isinstance(obj, h5py.Dataset):
            stored = _plain_dtype(path, name, obj)
            check_dataset(path, name, obj, size, stored.numpy)
            entries[name] = Entry(tuple(name.split("/")), stored, tuple(obj.shape), raw_offset(obj, size))
    if not entries:
        raise FormatError(path, "holds no datasets, so no tensors")
    return entries


def _plain_dtype(path: Path, name: str, dataset: h5py.Dataset) -> Stored:
    dtype = dataset.dtype
    if dtype.kind == "V" and dtype.itemsize == 2 and not dtype.fields and "dtype" in dataset.attrs:
        # Keras 3 stores bfloat16 (and only bfloat16) as 2-byte opaque data with a `dtype`
        # attribute. The attribute's value is not read: it is a variable-length string, see the hdf5 converter.
        return Stored(dtypes.DTYPES["bfloat16"], dtype)
    if dtype.kind in "biufc" and not dtype.fields and not dtype.subdtype:
        native = dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
        for stored in DTYPES.values():
            if not stored.bits and stored.numpy == native:
                return stored
    raise FormatError(path, f"dataset {name!r} holds {dtype}, which is not a tensor type modelkit reads")


def check_dataset(path: Path, name: str, dataset: h5py.Dataset, size: int, expected: np.dtype) -> None:
    """Refuse data stored outside the file, and sizes the file cannot hold, before any allocation."""
    if dataset.dtype.kind != expected.kind or dataset.dtype.itemsize != expected.itemsize:
        raise FormatError(path, f"tensor {name!r} is stored as {dataset.dtype}, expected {expected}")
    if dataset.external:
        raise FormatError(path, f"tensor {name!r} keeps its data in another file ({dataset.external[0][0]!r}); "
                                "refusing to read outside the file")
    if dataset.is_virtual:
        raise FormatError(path, f"tensor {name!r} is a virtual dataset mapping other files; refusing it")
    declared = math.prod(dataset.shape) * dataset.dtype.itemsize
    allowed = size
    if dataset.id.get_create_plist().get_nfilters():                  # compressed: may expand, within bounds
        allowed = max(size, dataset.id.get_storage_size() * _MAX_EXPANSION)
    if declared > max(allowed, _SMALL):
        raise FormatError(path, f"tensor {name!r} declares {list(dataset.shape)} ({declared} bytes) but the "
                                f"file is {size} bytes; refusing to allocate it")


_LINK_KINDS = {h5py.h5l.TYPE_SOFT: "SoftLink", h5py.h5l.TYPE_EXTERNAL: "ExternalLink"}


def link_error(path: Path, name: str, kind: int) -> FormatError:
    return FormatError(path, f"{name!r} is a {_LINK_KINDS.get(kind, 'user-defined link')}; modelkit follows hard "
                             "links only (external links point outside the file)")


def child(path: Path, group: h5py.Group, key: str, kind: type) -> h5py.Group | h5py.Dataset:
    """group[key] through a hard link only: the link is inspected, never traversed, before h5py
    (which follows soft and external links) is asked for the object."""
    name = key.encode("utf-8")
    if not group.id.links.exists(name):
        raise FormatError(path, f"{group.name.rstrip('/')}/{key} is missing")
    link = group.id.links.get_info(name).type
    if link != h5py.h5l.TYPE_HARD:
        raise link_error(path, f"{group.name.rstrip('/')}/{key}", link)
    obj = group[key]
    if not isinstance(obj, kind):
        raise FormatError(path, f"{obj.name} is a {type(obj).__name__}, expected a {kind.__name__}")
    return obj


def raw_offset(dataset: h5py.Dataset, size: int) -> int | None:
    """File offset of a dataset's bytes when they are stored in one contiguous, unfiltered piece in
    little-endian order inside the file (h5py's default layout for the datasets modelkit writes); else None."""
    dtype = dataset.dtype
    if dtype.itemsize > 1 and dtype.byteorder == ">":
        return None
    plist = dataset.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters():
        return None
    offset = dataset.id.get_offset()                  # None until the data was written
    nbytes = math.prod(dataset.shape) * dtype.itemsize
    if offset is None or nbytes == 0 or offset < 0 or offset + nbytes > size:
        return None
    return offset


def _view(mapped: MappedFile, name: str, entry: Entry, at: int) -> np.ndarray:
    raw = mapped.view(at, entry.nbytes, f"tensor {name!r}")
    return raw.view(entry.stored.dtype.numpy).reshape(entry.shape)


def load(path: Path, entry: Entry, opener: Opener) -> np.ndarray:
    """Open the file again, check the dataset as the header read did, and read it into a fresh array."""
    name = "/".join(entry.link)
    try:
        with opener() as f:
            size = f.id.get_filesize()
            obj: h5py.Group | h5py.Dataset = f
            for i, key in enumerate(entry.link):
                obj = child(path, obj, key, h5py.Dataset if i == len(entry.link) - 1 else h5py.Group)
            check_dataset(path, name, obj, size, entry.stored.numpy)
            if tuple(obj.shape) != entry.shape:
                raise FormatError(path, f"dataset {name!r} changed shape since the file was opened")
            array = np.empty(entry.shape, dtype=obj.dtype.newbyteorder("<") if obj.dtype.itemsize > 1 else obj.dtype)
            if array.size:
                obj.read_direct(array)
    except ModelkitError:
        raise
    except H5_ERRORS as e:
        raise FormatError(path, f"cannot read dataset {name!r} ({one_line(e)})") from e
    return array.view(entry.stored.dtype.numpy)         # Keras's opaque bfloat16 ("V2") as its uint16 bits


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


# ---------------------------------------------------------------------------------------------
# Keras 3's .weights.h5 layout (keras/src/saving/saving_lib.py, H5IOStore)

def keras_groups(f: h5py.File, paths: list[str]) -> None:
    """The groups Keras 3's loader walks: the model's own `/vars` (none) and `/layers/<layer>/vars` for each
    layer, weights or not, in model order."""
    f.create_group("vars").attrs["name"] = "sequential"
    layers = f.create_group("layers")
    for path in paths:
        layers.create_group(path).create_group("vars").attrs["name"] = path


def keras_variable(f: h5py.File, path: str, index: int, value: np.ndarray, dtype: DType) -> h5py.Dataset:
    """Variable `index` of layer `path`, `value` already in Keras's layout (stored bits for bfloat16, which
    Keras 3 keeps as a 2-byte opaque type with a `dtype` attribute)."""
    group = f[f"layers/{path}/vars"]
    if dtype.name == "bfloat16":
        dataset = group.create_dataset(str(index), data=value.view("V2"))
        dataset.attrs["dtype"] = "bfloat16"
        return dataset
    return group.create_dataset(str(index), data=value)

