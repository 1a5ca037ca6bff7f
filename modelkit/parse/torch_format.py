"""torch.save's serialization format, read without torch and without unpickling: the checkpoint's object
as plain Python values, each tensor as a checked record, its bytes as numpy views of the mapped file.

Layouts (torch/serialization.py `_save`, `_legacy_save`, `_load`, `_legacy_load`):
    zip     `<prefix>/data.pkl` (the object), `<prefix>/data/<key>` (each storage's raw bytes, stored at
            64-byte aligned offsets), `<prefix>/byteorder` ("little" or "big"; absent means little),
            version records that are not needed here.
    legacy  five pickles back to back: the magic number, the protocol version (1001), sys info, the object,
            the storage keys; then for each key in that order an 8-byte element count and the raw bytes.

The object pickle is walked by modelkit.parse.pickle's symbolic Machine. Only what a weights-only
checkpoint holds is given a value: dicts and `collections.OrderedDict` (keeping the `_metadata` a
state_dict carries), lists, tuples, sets, str/bytes/int/float/bool/None, `torch.Size`, `torch.device`,
and tensors: `torch._utils._rebuild_tensor`, `_rebuild_tensor_v2`, `_rebuild_tensor_v3` (dtype argument),
`_rebuild_parameter`, `_rebuild_parameter_with_state`, `torch._tensor._rebuild_from_type_v2` around a
plain tensor, over storages named by persistent ids ('storage', <storage class>, key, location, numel).
Anything else a pickle names (a module's class, numpy scalars, argparse.Namespace, quantized or sparse
tensors) becomes an `Opaque` placeholder that says what it was; nothing is ever imported or called.

TorchScript archives (torch.jit.save: `<prefix>/data.pkl`, `constants.pkl`, `code/`, `data/<key>`) are read
by `read_script`/`parse_script`: their data.pkl is the module tree, each object made from a `__torch__.<class>`
global (GLOBAL, EMPTY_TUPLE, NEWOBJ, then BUILD with its attribute dict; torch/csrc/jit/serialization/pickler.cpp)
and given as a `ScriptObject(qualname, state)`; `torch.jit._pickle`'s type-tag and list wrappers give their
argument. Tensors and storages are the same records as torch.save's (`data/<key>`); constants.pkl and its
`constants/<key>` records belong to the code and are not read.

Every storage record is found inside the file and every view inside its storage (offset + the last
element its sizes and strides reach) before anything is mapped or allocated; errors are ParseError
naming the file. Standard library only at import (the scanner uses the legacy layout helpers);
numpy is imported when tensor bytes are first read.
"""
from __future__ import annotations

import mmap
import os
import struct
import time
import zlib
from collections import OrderedDict

from modelkit.errors import ParseError
from modelkit.parse import zipdir
from modelkit.parse.pickle import LEGACY_MAGIC, Blob, Bounds, Global, Machine, Obj, PDict, PList, PSet
from modelkit.parse.sniff import torch_zip_roots

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

__all__ = ["DTYPE_BITS", "STORAGE_DTYPES", "Device", "Opaque", "ScriptObject", "StorageRef", "TensorRecord",
           "TorchFile", "check_views", "legacy_records", "map_file", "parse", "parse_script", "read", "read_script",
           "storage_claim", "storage_record", "tied_names"]

# torch dtype name -> numpy type of the stored bits (little-endian). bfloat16 and the 8-bit floats have
# no numpy type: their bits are kept as unsigned integers, never widened. modelkit.storage.dtypes maps
# these names to DTypes; a dtype listed here but not there is read as a record and refused by the converter.
DTYPE_BITS: dict[str, str] = {
    "bool": "|b1", "uint8": "|u1", "int8": "|i1", "int16": "<i2", "uint16": "<u2", "int32": "<i4",
    "uint32": "<u4", "int64": "<i8", "uint64": "<u8", "float16": "<f2", "bfloat16": "<u2", "float32": "<f4",
    "float64": "<f8", "complex32": "<u4", "complex64": "<c8", "complex128": "<c16",
    "float8_e4m3fn": "|u1", "float8_e5m2": "|u1", "float8_e4m3fnuz": "|u1", "float8_e5m2fnuz": "|u1",
    "float8_e8m0fnu": "|u1", "float4_e2m1fn_x2": "|u1", "bits8": "|u1", "bits16": "<u2", "bits1x8": "|u1",
    "bits2x4": "|u1", "bits4x2": "|u1",
    "qint8": "|i1", "quint8": "|u1", "qint32": "<i4", "quint4x2": "|u1", "quint2x4": "|u1",
}
# torch's storage classes (torch.storage._dtype_to_storage_type_map) -> dtype name. UntypedStorage
# holds bytes: a tensor on it takes its dtype from _rebuild_tensor_v3's argument.
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "LongStorage": "int64",
    "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "BFloat16Storage": "bfloat16", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64", "QInt8Storage": "qint8", "QInt32Storage": "qint32",
    "QUInt8Storage": "quint8", "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
    "UntypedStorage": "uint8",
}
_QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})
_PICKLE_LIMIT = 256 << 20      # bytes of a compressed data.pkl we inflate; real ones are a few MB at most
_SMALL_RECORD = 1 << 16        # byteorder, version: tiny records
_MAX_DEPTH = 200               # nesting of the object's containers; real checkpoints have a handful
_MAX_DIMS = 64                 # numpy's limit
_MAX_EXPANDED = 1 << 30        # bytes a view that repeats its storage (stride 0) may expand to when read
_MAX_ELEMENTS = 1 << 48        # any dimension, and the product of the non-zero ones (an empty tensor too)
_DEFLATE_RATIO = 1032          # deflate's largest expansion: a record claiming more is refused unread
_PROTOCOL_VERSION = 1001       # torch/serialization.py PROTOCOL_VERSION (legacy stream)
# Python 2 and old torch module names, as the unpickler's fix_imports and torch's load_module_mapping map them.
_RENAMED = {"__builtin__": "builtins", "copy_reg": "copyreg", "torch.tensor": "torch._tensor"}


def _itemsize(dtype: str) -> int:
    return int(DTYPE_BITS[dtype][2:])         # numpy's codes count bytes: "<c8" is 8 bytes


def _dtype_of(value: Any) -> str | None:
    """The dtype name of a pickled `torch.<dtype>` global, else None."""
    if isinstance(value, Global) and value.module == "torch" and value.name in DTYPE_BITS:
        return value.name
    return None


class Opaque:
    """A value the reader does not rebuild: what the pickle named (`what`, e.g. "argparse.Namespace"),
    never imported or called. `how` says how it was made (REDUCE, NEWOBJ, BUILD, a bare global, ...)."""

    __slots__ = ("what", "how")

    def __init__(self, what: str, how: str = "") -> None:
        self.what, self.how = what, how

    def __repr__(self) -> str:
        return f"<opaque {self.what}>"


class Device:
    """A pickled torch.device: type ("cpu", "cuda") and index (None when not given)."""

    __slots__ = ("type", "index")

    def __init__(self, type: str, index: int | None = None) -> None:  # noqa: A002 - torch.device's names
        self.type, self.index = type, index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and (other.type, other.index) == (self.type, self.index)

    def __hash__(self) -> int:
        return hash((self.type, self.index))

    def __repr__(self) -> str:
        return f"device({self.type!r})" if self.index is None else f"device({self.type!r}, {self.index})"


class ScriptObject:
    """An object of a TorchScript archive's data.pkl (a module, or a TorchScript class): `qualname` is
    the `__torch__.<class>` it was made from (never imported or called) and `state` what BUILD gave it,
    as plain values. A module's state is its attribute dict: parameters and buffers (TensorRecord),
    submodules (ScriptObject), `training` and other attributes. A class with its own `__getstate__`
    may have any other state; `state` is None when the pickle never BUILDs the object."""

    __slots__ = ("qualname", "state")

    def __init__(self, qualname: str, state: Any = None) -> None:
        self.qualname, self.state = qualname, state

    def __repr__(self) -> str:
        return f"<script object {self.qualname}>"


class StorageRef:
    """One persistent id: storage `key` of `numel` elements of `dtype` ("uint8" for UntypedStorage)."""

    __slots__ = ("key", "dtype", "numel", "location", "untyped")

    def __init__(self, key: str, dtype: str, numel: int, location: str, untyped: bool) -> None:
        self.key, self.dtype, self.numel, self.location, self.untyped = key, dtype, numel, location, untyped

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def __repr__(self) -> str:
        return f"StorageRef({self.key!r}, {self.dtype}, numel={self.numel})"


class TensorRecord:
    """A tensor as the pickle describes it: a strided view of `dtype` elements into a storage.

    `offset` counts elements of `dtype` from the storage's first byte; `size` and `stride` are in
    elements. `parameter` is True for an nn.Parameter. The bytes are read by `TorchFile.array`.
    """

    __slots__ = ("storage", "dtype", "offset", "size", "stride", "requires_grad", "parameter")

    def __init__(self, storage: StorageRef, dtype: str, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                 requires_grad: bool = False, parameter: bool = False) -> None:
        self.storage, self.dtype, self.offset, self.size, self.stride = storage, dtype, offset, size, stride
        self.requires_grad, self.parameter = requires_grad, parameter

    @property
    def shape(self) -> tuple[int, ...]:
        return self.size

    @property
    def numel(self) -> int:
        n = 1
        for d in self.size:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        """As torch's is_contiguous: row-major strides, ignoring dimensions of size 1; empty tensors are."""
        if self.numel == 0:
            return True
        expected = 1
        for d, s in zip(reversed(self.size), reversed(self.stride), strict=True):
            if d != 1 and s != expected:
                return False
            expected *= d
        return True

    @property
    def extent(self) -> int:
        """Elements of the storage the view reaches from `offset`: its last index + 1 (0 when empty)."""
        if self.numel == 0:
            return 0
        return 1 + sum((d - 1) * s for d, s in zip(self.size, self.stride, strict=True))

    @property
    def identity(self) -> tuple[Any, ...]:
        """Equal for two records that are the same tensor (tied weights)."""
        return (self.storage.key, self.dtype, self.offset, self.size, self.stride)

    def as_parameter(self, requires_grad: Any) -> TensorRecord:
        return TensorRecord(self.storage, self.dtype, self.offset, self.size, self.stride, requires_grad is True, True)

    def __repr__(self) -> str:
        return (f"TensorRecord({self.dtype}, size={list(self.size)}, stride={list(self.stride)}, "
                f"storage={self.storage.key!r}, offset={self.offset})")


class _ODict(PDict):
    """collections.OrderedDict() during the walk: key/value pairs, plus the `_metadata` BUILD sets."""

    metadata: Any = None
    has_metadata = False


class _Script:
    """A `__torch__` object during the walk: its class's name and the state of its last BUILD."""

    __slots__ = ("qualname", "state")

    def __init__(self, qualname: str) -> None:
        self.qualname, self.state = qualname, None


def _is_script_class(module: str) -> bool:
    """TorchScript's own namespace: every class compiled into an archive is `__torch__.<...>`."""
    return module == "__torch__" or module.startswith("__torch__.")


# ---------------------------------------------------------------------------------------------
# The legacy stream's storage records (shared with the scanner, which skips them the same way).

def storage_claim(pid: Any) -> tuple[str, str, int]:
    """(key, storage class name, numel) of a pickled storage id ('storage', <class>, key, location, numel[, view]).

    Raises:
        ParseError: anything else.
    """
    if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage" and isinstance(pid[1], Global)
            and isinstance(pid[2], str) and type(pid[4]) is int and pid[4] >= 0):
        raise ParseError("a storage reference in the pickle is not ('storage', type, key, location, size)")
    return pid[2], pid[1].name, pid[4]


def legacy_records(buf, pos: int, end: int, keys: Any, claims: dict[str, tuple[int, int]]) -> tuple[dict[str, tuple[int, int]], int]:
    """The storage records after a legacy stream's pickles: u64 element count, then count * itemsize bytes.

    Args:
        buf: the file's bytes (bytes or an mmap); `pos` is where the records start, `end` where the data ends.
        keys: the storage-keys pickle's value (a list of str, in the order the records are written).
        claims: key -> (numel, bytes per element) from the object pickle's storage ids.

    Returns:
        ({key: (data offset, nbytes)}, where the last record ends).

    Raises:
        ParseError: a key the object never claimed, a count that disagrees with the claim (for
            storages wider than a byte), or a record that runs past `end`.
    """
    if not isinstance(keys, (list, tuple)):
        raise ParseError("the legacy storage-keys pickle is not a list")
    records: dict[str, tuple[int, int]] = {}
    for key in keys:
        if not isinstance(key, str) or key not in claims:
            raise ParseError(f"the legacy stream has data for storage {str(key)[:40]!r}, which no tensor claims",
                             offset=pos)
        if pos + 8 > end:
            raise ParseError(f"the file ends before the record of storage {key!r}; it is truncated", offset=pos)
        count = struct.unpack_from("<Q", buf, pos)[0]
        numel, size = claims[key]
        if count != numel and size != 1:
            raise ParseError(f"storage {key!r} is claimed with {numel} elements but its record holds {count}",
                             offset=pos)
        nbytes = count * size
        if nbytes > end - pos - 8:
            raise ParseError(f"storage {key!r} claims {nbytes} bytes of tensor data but only {end - pos - 8} bytes "
                             "follow in the file; it is truncated or corrupt", offset=pos)
        records[key] = (pos + 8, nbytes)
        pos += 8 + nbytes
    return records, pos


def claimed_itemsize(storage_class: str) -> int | None:
    """Bytes per element of a storage class name (FloatStorage -> 4, UntypedStorage -> 1); None if unknown."""
    dtype = STORAGE_DTYPES.get(storage_class)
    return None if dtype is None else _itemsize(dtype)


# ---------------------------------------------------------------------------------------------
# The object pickle, rebuilt symbolically.

def _ints(value: Any, what: str, at: int) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int for v in value):
        raise ParseError(f"a tensor's {what} is not a tuple of integers", offset=at)
    if len(value) > _MAX_DIMS:
        raise ParseError(f"a tensor with {len(value)} dimensions (at most {_MAX_DIMS} are read)", offset=at)
    if any(v < 0 for v in value):
        raise ParseError(f"a tensor's {what} {list(value)} has a negative entry", offset=at)
    product = 1
    for v in value:           # an empty tensor's other dimensions are checked too: numpy refuses them later
        product *= max(v, 1)
        if product > _MAX_ELEMENTS:
            raise ParseError(f"a tensor's {what} {list(value)[:8]} reaches past {_MAX_ELEMENTS} elements", offset=at)
    return value


class _Rebuilder(Machine):
    """parse.pickle's machine with values: containers, storages and tensors; every other call is Opaque.
    With `script`, `__torch__` objects and torch.jit._pickle's wrappers too (a TorchScript data.pkl)."""

    def __init__(self, buf, start: int, end: int, limits: Any, deadline: float, script: bool = False) -> None:
        super().__init__(buf, start, end, limits, deadline)
        self.tensors: list[TensorRecord] = []
        self.storages: dict[str, StorageRef] = {}        # key -> the first reference (torch uses the first)
        self.computed = False
        self.script = script

    def unresolved_global(self, module: Any, name: Any, how: str) -> None:
        self.computed = True

    def on_global(self, module: Any, name: Any, how: str) -> Any:
        if isinstance(module, str):
            module = _RENAMED.get(module, module)
        return super().on_global(module, name, how)

    def step(self, name: str, arg: Any) -> None:
        if name == "BINPERSID" or name == "PERSID":
            pid = arg if name == "PERSID" else self.pop()
            self.result.persistent_ids.append(pid)
            self.stack.append(self.persistent(pid))
        else:
            super().step(name, arg)

    def persistent(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 4 and pid[0] == "module":   # legacy whole-module pickles
            return pid[1]
        if isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage" and pid[5] is not None:
            raise ParseError("a storage view (torch < 1.0's view_metadata) is not supported; load the file with "
                             "that torch and save it again", offset=self.op_at)
        try:
            key, cls, numel = storage_claim(pid)
        except ParseError as e:
            raise ParseError(e.reason, offset=self.op_at) from None
        module = pid[1].module
        if cls not in STORAGE_DTYPES or not (module == "torch" or module.startswith("torch.")):
            raise ParseError(f"storage {key!r} has type {module}.{cls}, which is not a torch storage class",
                             offset=self.op_at)
        ref = StorageRef(key, STORAGE_DTYPES[cls], numel, pid[3] if isinstance(pid[3], str) else "",
                         cls == "UntypedStorage")
        first = self.storages.setdefault(key, ref)
        if (first.dtype, first.untyped) != (ref.dtype, ref.untyped):
            raise ParseError(f"storage {key!r} is claimed as both {first.dtype} and {ref.dtype} "
                             "(torch.save never writes that)", offset=self.op_at)
        return ref

    def call(self, callee: Any, how: str, args: Any = None) -> Any:
        if not isinstance(callee, Global):
            self.dynamic_call(callee, how)
            return Opaque("<computed callable>", how)
        qualname = f"{callee.module}.{callee.name}"
        if self.script and _is_script_class(callee.module):    # NEWOBJ, NEWOBJ_EX, REDUCE, OBJ or INST
            return _Script(qualname)
        handler = None
        if how == "REDUCE":
            handler = _CALLS.get(qualname) or (_SCRIPT_CALLS.get(qualname) if self.script else None)
        if handler is None:
            return Opaque(qualname, how)
        return handler(self, args if isinstance(args, tuple) else ())

    def build(self, state: Any, target: Any) -> None:
        super().build(state, target)
        if isinstance(target, _Script):
            target.state = state
        elif isinstance(target, _ODict):
            parts = state if isinstance(state, tuple) else (state,)
            for part in parts:
                if isinstance(part, PDict):
                    for k, v in part:
                        if k == "_metadata":
                            target.metadata, target.has_metadata = v, True

    # -- the callables a weights-only checkpoint uses
    def tensor(self, args: tuple, how: str, dtype: str | None = None) -> TensorRecord:
        at = self.op_at
        if len(args) < 4:
            raise ParseError(f"{how} with {len(args)} arguments (a storage, offset, size and stride are needed)",
                             offset=at)
        storage, offset = args[0], args[1]
        if not isinstance(storage, StorageRef):
            raise ParseError(f"{how}'s first argument is not a storage", offset=at)
        if type(offset) is not int or offset < 0:
            raise ParseError(f"a tensor's storage offset {offset!r} is not a non-negative integer", offset=at)
        size, stride = _ints(args[2], "size", at), _ints(args[3], "stride", at)
        if len(size) != len(stride):
            raise ParseError(f"a tensor's size {list(size)} and stride {list(stride)} differ in length", offset=at)
        dtype = dtype or storage.dtype
        if dtype in _QUANTIZED:
            raise ParseError(f"a plain tensor on a {dtype} storage; quantized tensors are rebuilt otherwise",
                             offset=at)
        at_metadata = 7 if how == "_rebuild_tensor_v3" else 6       # after (..., requires_grad, hooks[, dtype])
        metadata = args[at_metadata] if len(args) > at_metadata else None
        if isinstance(metadata, PDict) and any(v is True for _, v in metadata):
            raise ParseError("a tensor with its conjugate or negative bit set (a lazy view); call .resolve_conj() "
                             "and .resolve_neg() before saving it", offset=at)
        record = TensorRecord(storage, dtype, offset, size, stride, len(args) > 4 and args[4] is True)
        self.tensors.append(record)
        return record

    def rebuild_v1(self, args: tuple) -> TensorRecord:
        return self.tensor(args, "_rebuild_tensor")

    def rebuild_v2(self, args: tuple) -> TensorRecord:
        return self.tensor(args, "_rebuild_tensor_v2")

    def rebuild_v3(self, args: tuple) -> TensorRecord:
        dtype = _dtype_of(args[6]) if len(args) > 6 else None
        if dtype is None:
            raise ParseError("_rebuild_tensor_v3 without a torch dtype argument", offset=self.op_at)
        return self.tensor(args, "_rebuild_tensor_v3", dtype)

    def parameter(self, args: tuple) -> Any:
        if not args or not isinstance(args[0], TensorRecord):
            return Opaque("torch._utils._rebuild_parameter", "REDUCE")
        return args[0].as_parameter(args[1] if len(args) > 1 else False)

    def from_type(self, args: tuple) -> Any:
        """_rebuild_from_type_v2(func, new_type, args, state): a plain Tensor with Python state."""
        if (len(args) >= 3 and isinstance(args[0], Global) and isinstance(args[2], tuple)
                and args[1] in (Global("torch", "Tensor"), Global("torch._tensor", "Tensor"),
                                Global("torch.nn.parameter", "Parameter"))):
            handler = _CALLS.get(f"{args[0].module}.{args[0].name}")
            if handler is not None and handler in (_Rebuilder.rebuild_v2, _Rebuilder.rebuild_v3):
                value = handler(self, args[2])
                return value.as_parameter(False) if args[1].name == "Parameter" else value
        what = f"{args[1].module}.{args[1].name}" if len(args) > 1 and isinstance(args[1], Global) else "a tensor subclass"
        return Opaque(what, "torch._tensor._rebuild_from_type_v2")

    def ordered_dict(self, args: tuple) -> Any:
        od = _ODict()
        if args and isinstance(args[0], (PList, tuple)):
            for item in args[0]:
                if not (isinstance(item, tuple) and len(item) == 2):
                    return Opaque("collections.OrderedDict", "REDUCE")
                od.append(item)
        elif args:
            return Opaque("collections.OrderedDict", "REDUCE")
        return od

    def torch_size(self, args: tuple) -> Any:
        if args and isinstance(args[0], tuple) and all(type(v) is int for v in args[0]):
            return args[0]
        return Opaque("torch.Size", "REDUCE")

    def device(self, args: tuple) -> Any:
        if args and isinstance(args[0], str):
            index = args[1] if len(args) > 1 and type(args[1]) is int else None
            kind, _, number = args[0].partition(":")
            if number.isdigit() and index is None:
                index = int(number)
            return Device(kind, index)
        return Opaque("torch.device", "REDUCE")

    def collection(self, args: tuple, kind: str) -> Any:
        items = args[0] if args else PList()
        if isinstance(items, (PList, PSet, tuple)):
            return PSet(items) if kind in ("set", "frozenset") else (PList(items) if kind == "list" else tuple(items))
        return Opaque(f"builtins.{kind}", "REDUCE")

    def encode(self, args: tuple) -> Any:
        """_codecs.encode(text, 'latin1'): how protocol 2 pickles bytes."""
        if len(args) == 2 and isinstance(args[0], str) and args[1] in ("latin1", "latin-1"):
            try:
                return args[0].encode("latin-1")
            except UnicodeEncodeError:
                pass
        return Opaque("_codecs.encode", "REDUCE")

    def first_argument(self, args: tuple) -> Any:
        """torch.jit._pickle's wrappers: restore_type_tag(value, type_str), build_intlist(list), ..."""
        return args[0] if args else Opaque("torch.jit._pickle", "REDUCE")


_CALLS = {
    "torch._utils._rebuild_tensor": _Rebuilder.rebuild_v1,
    "torch._utils._rebuild_tensor_v2": _Rebuilder.rebuild_v2,
    "torch._utils._rebuild_tensor_v3": _Rebuilder.rebuild_v3,
    "torch._utils._rebuild_parameter": _Rebuilder.parameter,
    "torch._utils._rebuild_parameter_with_state": _Rebuilder.parameter,
    "torch._tensor._rebuild_from_type_v2": _Rebuilder.from_type,
    "collections.OrderedDict": _Rebuilder.ordered_dict,
    "torch.Size": _Rebuilder.torch_size,
    "torch.device": _Rebuilder.device,
    "builtins.set": lambda self, args: self.collection(args, "set"),
    "builtins.frozenset": lambda self, args: self.collection(args, "frozenset"),
    "builtins.list": lambda self, args: self.collection(args, "list"),
    "builtins.tuple": lambda self, args: self.collection(args, "tuple"),
    "_codecs.encode": _Rebuilder.encode,
}


# TorchScript's wrappers (torch/jit/_pickle.py): each returns its first argument, tagged for the C++ loader.
_SCRIPT_CALLS = {f"torch.jit._pickle.{name}": _Rebuilder.first_argument for name in (
    "restore_type_tag", "build_intlist", "build_floatlist", "build_boollist", "build_tensorlist", "build_doublelist")}


# How a long argument (parse.pickle's Blob) decodes, by its kind: what the unpickler would make of it.
_DECODED = "decoded bytes"      # a key of _plain's `seen` (ids are ints): the long-string budget used so far
_MAX_DECODED = 64 << 20         # bytes of long strings (metadata JSON) one pickle may decode in all
_TEXT_DECODERS = {"str": lambda raw: raw.decode("utf-8", "surrogatepass"), "latin1": lambda raw: raw.decode("latin-1"),
                  "bytes": bytes}


def _plain(value: Any, seen: dict[Any, Any], depth: int = 0, buf: Any = None) -> Any:
    """The walk's symbolic values as plain Python ones (shared containers stay shared)."""
    if isinstance(value, (str, int, float, bytes, TensorRecord, Opaque, Device)) or value is None:
        return value
    if id(value) in seen:
        return seen[id(value)]
    if depth > _MAX_DEPTH:
        raise ParseError(f"the pickled object nests containers deeper than {_MAX_DEPTH} levels")
    if isinstance(value, _Script):    # registered before its state: a state may reach its own object
        out = seen[id(value)] = ScriptObject(value.qualname)
        out.state = _plain(value.state, seen, depth + 1, buf)
        return out
    if isinstance(value, PDict):
        out: Any = OrderedDict() if isinstance(value, _ODict) else {}
        seen[id(value)] = out
        for k, v in value:
            key = _plain(k, seen, depth + 1, buf)
            try:
                out[key] = _plain(v, seen, depth + 1, buf)
            except TypeError:
                raise ParseError(f"a dict key that cannot be a key ({type(key).__name__})") from None
        if isinstance(value, _ODict) and value.has_metadata:
            out._metadata = _plain(value.metadata, seen, depth + 1, buf)
        return out
    if isinstance(value, PList):
        out = []
        seen[id(value)] = out
        out.extend(_plain(v, seen, depth + 1, buf) for v in value)
        return out
    if isinstance(value, tuple):
        out = tuple(_plain(v, seen, depth + 1, buf) for v in value)
        seen[id(value)] = out
        return out
    if isinstance(value, PSet):
        try:
            out = set(_plain(v, seen, depth + 1, buf) for v in value)
        except TypeError:
            raise ParseError("a set member that cannot be hashed") from None
        seen[id(value)] = out
        return out
    if isinstance(value, StorageRef):
        return Opaque(f"a torch storage ({value.dtype})", "persistent id")
    if isinstance(value, Global):
        return Opaque(f"{value.module}.{value.name}", "global")
    if isinstance(value, Blob):     # a long string (metadata JSON) or bytes value: read now, within the pickle's bound
        if buf is not None and value.offset is not None and value.kind in _TEXT_DECODERS:
            # Decoded once however often the pickle refers to it (memo GETs), within a total budget:
            # a few bytes of GETs must not make many copies of one long string.
            seen[_DECODED] = seen.get(_DECODED, 0) + value.size
            if seen[_DECODED] > _MAX_DECODED:
                raise ParseError(f"the pickle's long strings add up to more than {_MAX_DECODED} bytes",
                                 offset=value.offset)
            raw = bytes(buf[value.offset:value.offset + value.size])
            try:
                out = seen[id(value)] = _TEXT_DECODERS[value.kind](raw)
            except UnicodeDecodeError:
                raise ParseError("invalid UTF-8 in a string value", offset=value.offset) from None
            return out
        return Opaque(f"a {value.size}-byte string or bytes value", "argument")
    if isinstance(value, Obj):
        what = f"{value.origin.module}.{value.origin.name}" if value.origin else f"a {value.kind} value"
        return Opaque(what, value.kind)
    return Opaque(type(value).__name__, "value")


# ---------------------------------------------------------------------------------------------
# The file.

class _Record:
    """Where a storage's bytes are: `start` in the buffer, `nbytes`, and the zip entry when compressed."""

    __slots__ = ("start", "nbytes", "entry")

    def __init__(self, start: int, nbytes: int, entry: zipdir.ZipEntry | None = None) -> None:
        self.start, self.nbytes, self.entry = start, nbytes, entry


class TorchFile:
    """A parsed torch.save checkpoint or TorchScript archive. Build it with `read(path)` (or `parse(buf)`
    for bytes in memory), `read_script(path)` (or `parse_script(buf)`) for TorchScript.

    Attributes:
        source: the file's path (or the name given to `parse`), for messages.
        layout: "zip", "legacy" or "torchscript".
        value: the checkpoint's object: dicts, OrderedDicts (with `_metadata` when the file has one),
            lists, tuples, sets, scalars, bytes, TensorRecord, Device and Opaque; for TorchScript, the
            root module as a ScriptObject (or whatever else data.pkl holds).
        tensors: every TensorRecord of the object, in pickle order.
        globals: "module.name" of every global the object pickle names, in order of first appearance
            (Python 2 names mapped as the unpickler maps them); "<computed>.<computed>" for a computed one.
        build_keys: the string keys of the states BUILD set (a whole module sets _modules, _parameters).
        byteorder: "little" or "big" (storages of big-endian files are byte-swapped when read).
    """

    def __init__(self, buf, source: str, layout: str, value: Any, machine: _Rebuilder | None, records: dict[str, _Record],
                 byteorder: str) -> None:
        self._buf = buf
        self.source, self.layout, self.value = source, layout, value
        # machine None: storages described by something other than a pickle (a PT2 archive's JSON configs);
        # the caller fills `tensors` and `storages` and checks them with `check_views`.
        self.tensors: list[TensorRecord] = machine.tensors if machine is not None else []
        self.storages: dict[str, StorageRef] = machine.storages if machine is not None else {}
        self.globals = [] if machine is None else [f"{m}.{n}" for m, n in machine.result.globals] + (
            ["<computed>.<computed>"] if machine.computed else [])
        self.build_keys = set(machine.result.build_keys) if machine is not None else set()
        self.byteorder = byteorder
        self._records = records
        self._inflated: tuple[str, Any] | None = None

    def _error(self, message: str) -> ParseError:
        return ParseError(message, source=self.source)

    def span(self, tensor: TensorRecord) -> tuple[int, int] | None:
        """(offset, nbytes) of the tensor's exact bytes in the file, when they lie there as they are:
        a contiguous, non-empty view of an uncompressed record, little-endian."""
        record = self._records[tensor.storage.key]
        if record.entry is not None or self.byteorder != "little" or not tensor.is_contiguous or not tensor.numel:
            return None
        return record.start + tensor.offset * tensor.itemsize, tensor.nbytes

    def array(self, tensor: TensorRecord) -> Any:
        """The tensor's stored bits as a numpy array of DTYPE_BITS[dtype] and its size: a view of the mapped
        file for contiguous tensors, a copy for strided ones (and byte-swapped ones, and compressed records).

        Raises:
            ParseError: a compressed record that does not inflate to its size and CRC-32.
        """
        import numpy as np

        dtype = np.dtype(DTYPE_BITS[tensor.dtype])
        if tensor.numel == 0:
            return np.empty(tensor.size, dtype)
        record = self._records[tensor.storage.key]
        data = self._storage_bytes(tensor.storage.key, record)
        start = tensor.offset * dtype.itemsize
        stored = dtype.newbyteorder(">") if self.byteorder == "big" else dtype
        if tensor.is_contiguous:
            flat = np.frombuffer(data, stored, tensor.numel, record.start + start if record.entry is None else start)
            out = flat.reshape(tensor.size)
        else:
            flat = np.frombuffer(data, stored, tensor.extent, record.start + start if record.entry is None else start)
            strides = tuple(s * dtype.itemsize for s in tensor.stride)
            view = np.lib.stride_tricks.as_strided(flat, tensor.size, strides, writeable=False)
            out = np.ascontiguousarray(view).reshape(tensor.size)
        return out.astype(dtype) if self.byteorder == "big" else out

    def _storage_bytes(self, key: str, record: _Record) -> Any:
        if record.entry is None:
            return self._buf
        if self._inflated is not None and self._inflated[0] == key:
            return self._inflated[1]
        entry = record.entry
        if entry.file_size > _DEFLATE_RATIO * entry.compress_size + 64:
            raise self._error(f"storage record data/{key} claims {entry.file_size} bytes from {entry.compress_size} "
                              "compressed ones, more than deflate can give; refusing to inflate it")
        raw = self._buf[record.start:record.start + entry.compress_size]
        try:
            data = zlib.decompressobj(-15).decompress(raw, entry.file_size + 1)
        except zlib.error as e:
            raise self._error(f"storage record data/{key} has corrupt deflate data ({e})") from None
        if len(data) != entry.file_size or zlib.crc32(data) != entry.CRC:
            raise self._error(f"storage record data/{key} does not match its size or CRC-32 in the zip directory")
        data = bytearray(data)    # writable, as the mapped records are: torch.from_numpy takes it without a warning
        self._inflated = (key, data)
        return data


def read(path: str | os.PathLike[str], *, limits: Any = None) -> TorchFile:
    """Parse the torch.save checkpoint at `path` (zip or legacy); no tensor bytes are read yet.

    The file is mapped once, copy-on-write (arrays of contiguous tensors are writable views of it;
    writing to them never changes the file).

    Returns:
        A TorchFile.

    Raises:
        ParseError: the file is not a torch.save checkpoint, or its structure does not hold
            (naming the file; OSError when it cannot be opened).
    """
    return parse(map_file(path, "a torch.save checkpoint"), source=os.fspath(path), limits=limits)


def read_script(path: str | os.PathLike[str], *, limits: Any = None) -> TorchFile:
    """Parse the TorchScript archive (torch.jit.save) at `path`: its data.pkl's module tree and storage
    records, mapped as `read` maps a checkpoint; no code is compiled or run and nothing is imported.

    Returns:
        A TorchFile of layout "torchscript" whose `value` is the root module, a ScriptObject.

    Raises:
        ParseError: not a zip archive with data.pkl, constants.pkl and code/ in one folder, or a
            structure that does not hold (every storage and view is checked as `read` checks them).
    """
    return parse_script(map_file(path, "a TorchScript archive"), source=os.fspath(path), limits=limits)


def map_file(path: str | os.PathLike[str], what: str) -> Any:
    """The file mapped copy-on-write (arrays of its records are writable views that never change it)."""
    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            raise ParseError(f"an empty file, not {what}", source=os.fspath(path))
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def parse(buf, *, source: str = "<bytes>", limits: Any = None) -> TorchFile:
    """Parse a torch.save checkpoint held in `buf` (bytes or an mmap); see `read`."""
    limits = limits or Bounds()
    try:
        if bytes(buf[:4]) == b"PK\x03\x04":
            return _parse_zip(buf, source, limits)
        return _parse_legacy(buf, source, limits)
    except ParseError as e:
        raise _named(e, source) from None


def parse_script(buf, *, source: str = "<bytes>", limits: Any = None) -> TorchFile:
    """Parse a TorchScript archive held in `buf` (bytes or an mmap); see `read_script`."""
    limits = limits or Bounds()
    try:
        if bytes(buf[:4]) != b"PK\x03\x04":
            raise ParseError("not a zip archive, so not a TorchScript archive")
        return _parse_zip(buf, source, limits, script=True)
    except ParseError as e:
        raise _named(e, source) from None


def _named(error: ParseError, source: str) -> ParseError:
    if error.source:
        return error
    where = f" (at byte {error.offset})" if error.offset is not None else ""
    return ParseError(f"{error.reason}{where}", source=source)


def _walk(buf, start: int, end: int, limits: Any, script: bool = False) -> _Rebuilder:
    machine = _Rebuilder(buf, start, end, limits, time.monotonic() + limits.seconds, script)
    try:
        machine.run()
    except ParseError as e:
        raise ParseError(f"the pickle is malformed ({e.reason})", offset=e.offset) from None
    except RecursionError:
        raise ParseError("the pickle nests too deeply") from None
    return machine


def _plain_value(machine: _Rebuilder) -> Any:
    try:
        return _plain(machine.result.value, {}, buf=machine.buf)
    except RecursionError:
        raise ParseError("the pickled object nests too deeply") from None


def _check_views(machine: _Rebuilder, records: dict[str, _Record]) -> None:
    check_views(machine.storages, machine.tensors, records)


def check_views(storages: dict[str, StorageRef], tensors: list[TensorRecord], records: dict[str, _Record]) -> None:
    """Every claimed storage inside its record, every view inside its storage; before any allocation.

    Raises:
        ParseError: a storage larger than its record, or a view reaching past its storage.
    """
    for key, ref in storages.items():
        record = records[key]
        if ref.nbytes > record.nbytes:
            raise ParseError(f"storage {key!r} claims {ref.numel} {ref.dtype} elements ({ref.nbytes} bytes) but its "
                             f"record holds {record.nbytes} bytes; the file is truncated or corrupt")
    for t in tensors:
        if not t.numel:
            continue
        itemsize = t.itemsize
        first = storages[t.storage.key]
        limit = first.nbytes // itemsize
        if t.offset + t.extent > limit:
            raise ParseError(f"a {t.dtype} tensor of size {list(t.size)}, stride {list(t.stride)} at offset {t.offset} "
                             f"reaches element {t.offset + t.extent - 1} of storage {t.storage.key!r}, which holds "
                             f"{limit}; the file is corrupt")
        if t.numel > t.extent and t.nbytes > max(_MAX_EXPANDED, first.nbytes):
            raise ParseError(f"a tensor of size {list(t.size)} repeats {t.extent} stored elements into {t.nbytes} "
                             f"bytes; refusing to expand a view beyond {_MAX_EXPANDED} bytes")


def _member(buf, entry: zipdir.ZipEntry, what: str) -> int:
    try:
        return zipdir.member_data(buf, entry)
    except ParseError as e:
        raise ParseError(f"{what}: {e.reason}", offset=e.offset) from None


def _small_member(buf, entry: zipdir.ZipEntry, limit: int) -> bytes:
    """A small member's bytes (byteorder, data.pkl when compressed), inflated with a bound."""
    if entry.file_size > limit:
        raise ParseError(f"{entry.filename} is {entry.file_size} bytes; refusing more than {limit}")
    start = _member(buf, entry, entry.filename)
    raw = bytes(buf[start:start + entry.compress_size])
    if entry.compress_type == zipdir.STORED:
        return raw[:entry.file_size]
    if entry.compress_type != zipdir.DEFLATED:
        raise ParseError(f"{entry.filename} uses zip compression method {entry.compress_type}, which torch does not write")
    try:
        return zlib.decompressobj(-15).decompress(raw, limit)
    except zlib.error as e:
        raise ParseError(f"{entry.filename} has corrupt deflate data ({e})") from None


def tied_names(records: dict[str, TensorRecord]) -> dict[str, str]:
    """Names whose tensor is the very same view of one storage as an earlier name's (tied weights) -> that name."""
    first: dict[tuple[Any, ...], str] = {}
    ties = {}
    for name, record in records.items():
        if record.numel:
            target = first.setdefault(record.identity, name)
            if target != name:
                ties[name] = target
    return ties


def storage_record(buf, entry: zipdir.ZipEntry, what: str) -> _Record:
    """Where a zip member holding raw storage bytes lies in `buf` (stored: mapped as it is; deflated:
    inflated when first read).

    Raises:
        ParseError: a local header that disagrees, stored sizes that differ, another compression method.
    """
    start = _member(buf, entry, f"storage record {what}")
    if entry.compress_type == zipdir.STORED:
        if entry.compress_size != entry.file_size:
            raise ParseError(f"storage record {what} is stored but its sizes differ in the zip directory")
        return _Record(start, entry.file_size)
    if entry.compress_type == zipdir.DEFLATED:
        return _Record(start, entry.file_size, entry)
    raise ParseError(f"storage record {what} uses zip compression method {entry.compress_type}, which "
                     "torch does not write")


def _parse_zip(buf, source: str, limits: Any, script: bool = False) -> TorchFile:
    entries = zipdir.read_directory(buf)
    by_name = {e.filename: e for e in entries}            # zipfile's pick among duplicate names: the last
    names = [e.filename for e in entries]
    roots = list(torch_zip_roots(names))
    if script:     # the folder holding data.pkl, constants.pkl and code/, as parse.detect.torchscript_prefix
        prefix = next((folder for folder, constants, code in roots if constants and code), None)
        if prefix is None:
            raise ParseError("not a TorchScript archive (needs data.pkl, constants.pkl and code/ in one folder)")
    elif not roots:
        raise ParseError("a zip archive without <folder>/data.pkl: not a torch.save checkpoint")
    else:
        prefix, constants, code = roots[0]
        if constants or code:
            raise ParseError("a TorchScript archive, not a torch.save checkpoint (read it with --from torchscript)")
    byteorder = "little"
    if f"{prefix}/byteorder" in by_name:
        mark = _small_member(buf, by_name[f"{prefix}/byteorder"], _SMALL_RECORD)
        if mark not in (b"little", b"big"):
            raise ParseError(f"the byteorder record says {mark[:20]!r}, not 'little' or 'big'")
        byteorder = mark.decode()
    pkl = by_name[f"{prefix}/data.pkl"]
    if pkl.compress_type == zipdir.STORED:
        start = _member(buf, pkl, "data.pkl")
        machine = _walk(buf, start, start + pkl.compress_size, limits, script)
    else:
        data = _small_member(buf, pkl, _PICKLE_LIMIT)
        machine = _walk(data, 0, len(data), limits, script)
    records: dict[str, _Record] = {}
    for key in machine.storages:
        entry = by_name.get(f"{prefix}/data/{key}")
        if entry is None:
            raise ParseError(f"storage {key!r} has no record {prefix}/data/{key} in the archive")
        records[key] = storage_record(buf, entry, f"data/{key}")
    _check_views(machine, records)
    return TorchFile(buf, source, "torchscript" if script else "zip", _plain_value(machine), machine, records,
                     byteorder)


def _parse_legacy(buf, source: str, limits: Any) -> TorchFile:
    end = len(buf)
    heads = []
    pos = 0
    for what in ("magic number", "protocol version", "sys info"):
        machine = _walk(buf, pos, end, limits)
        heads.append(machine.result.value)
        pos = machine.result.end
        if what == "magic number" and heads[0] != LEGACY_MAGIC:
            raise ParseError("neither a zip archive nor torch.save's legacy stream (no magic number)")
    if heads[1] != _PROTOCOL_VERSION:
        raise ParseError(f"legacy stream of protocol version {repr(heads[1])[:40]}; only {_PROTOCOL_VERSION} exists")
    info = {k: v for k, v in heads[2]} if isinstance(heads[2], PDict) else {}
    if info.get("little_endian") is False:
        raise ParseError("a legacy checkpoint written on a big-endian machine; only little-endian legacy files "
                         "are read (load and save it again with torch on that machine)")
    machine = _walk(buf, pos, end, limits)
    keys = _walk(buf, machine.result.end, end, limits).result
    claims = {key: (ref.numel, _itemsize(ref.dtype)) for key, ref in machine.storages.items()}
    found, _ = legacy_records(buf, keys.end, end, keys.value, claims)
    missing = [key for key in machine.storages if key not in found]
    if missing:
        raise ParseError(f"storage {missing[0]!r} has no record in the legacy stream")
    records = {key: _Record(start, nbytes) for key, (start, nbytes) in found.items()}
    _check_views(machine, records)
    return TorchFile(buf, source, "legacy", _plain_value(machine), machine, records, "little")
