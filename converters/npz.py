"""npz: numpy's archive of named arrays (`numpy.savez`, `numpy.savez_compressed`), read and written without torch.

Spec: numpy/lib/_npyio_impl.py (`savez`, `NpzFile`), numpy/lib/format.py (the .npy format, NEP 1) and
the zip format (https://pkware.cachefly.net/webdocs/casestudies/APPNOTE.TXT, 4.3 records, 4.5.3 zip64).
A zip archive whose members are `<name>.npy`, each a whole .npy file; `np.savez(path, **{"a.weight": x})`
gives the member `a.weight.npy`, and `np.load(path)["a.weight"]` reads it back.

Layout of a file modelkit writes (docs/formats/npz.md), every member stored (uncompressed):

    for each tensor, in the checkpoint's order:
        local header (30 bytes) | "<name>.npy" | extra field: the zip64 sizes when the member is over
            2 GiB, then padding (id 0xD935, as Android's zipalign writes it) so the member starts
            64-byte aligned in the file
        .npy version 1.0, byte for byte what `numpy.save` writes: "\\x93NUMPY" 1 0 | u16 header length |
            "{'descr': '<f4', 'fortran_order': False, 'shape': (64, 32), }" padded with spaces and a
            newline to a multiple of 64 bytes | the elements, little-endian, C order (so 64-byte
            aligned in the file: a reader can map them)
    modelkit.json (when there is anything to record), stored:
        {"layout": "modelkit.npz/1", "metadata": {str: str}, "dtypes": {name: "bfloat16", ...}}
        metadata is the Checkpoint's, plus "modelkit.arch" (the ArchSpec), "modelkit.aliases" (tied
        names) and "modelkit.quantized" (quantized weights' parts) as JSON strings, as in safetensors;
        dtypes names the true dtype of tensors numpy has no type for (bfloat16 stored as uint16 bits,
        float8 as uint8 bits)
    central directory | zip64 end record and locator when the directory's offset or size passes
        2 GiB or there are 65535 members or more | end record

Every member carries its CRC-32 and a fixed 1980-01-01 timestamp, so one checkpoint always gives the
same bytes. Tied tensors are stored once (the other names in "modelkit.aliases", as safetensors);
quantized weights are stored as their parts (modelkit/storage/quantized_layout.py).

Reading takes any .npz numpy writes: members stored or deflated, zip64 or not, C or Fortran order,
little- or big-endian. The central directory, each local header and each .npy header are read
through modelkit.parse.npz before anything else, and each member's size is checked against its
header. A stored little-endian C-order member becomes a view of the mapped file (with a FileSpan, so
writers copy its bytes file to file); a Fortran-order, big-endian or deflated member is read into
memory when its tensor is loaded, decompressed straight into an array of exactly the size its
header gives and refused as soon as it expands past it. Every member's CRC-32 is checked when its
tensor is loaded.

Object arrays (numpy pickles them) are refused with a message: modelkit never unpickles. The scanner
gate (modelkit.scan.gate) is not run first, as it is for pth: this reader has no unpickler at all,
and scanning an npz reads every member in full (up to 1 GiB each and 4 GiB in all, after which the
scan refuses the file), which would read each tensor twice and refuse large files. `modelkit scan`
still reports object arrays and their pickles.
"""
from __future__ import annotations

import json
import mmap
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from modelkit.checkpoint import ALIASES_KEY, ARCH_KEY, ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import FormatError, ParseError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import NPZ_LAYOUT, NPZ_MEMBER, tied_names
from modelkit.parse import npy, zipdir
from modelkit.parse import npz as npz_members
from modelkit.parse.detect import npz as detect  # noqa: F401  (the converter's detect)
from modelkit.parse.paths import member_problem
from modelkit.storage import quantized_layout
from modelkit.storage.dtypes import DTYPES, DType, as_dtype, contiguous, tensor_bytes
from modelkit.storage.mapped import FileSpan, MappedFile, copy_span
from modelkit.storage.write_behind import write_all

MEMBER = NPZ_MEMBER                 # "modelkit.json"
SUFFIX = npz_members.SUFFIX         # ".npy"
_JSON_LIMIT = 64 << 20              # bytes of modelkit.json read; far above any real model's metadata
_ALIGN = 64                         # numpy's ARRAY_ALIGN: where .npy elements start
_GROWTH_DIGITS = 21                 # numpy's GROWTH_AXIS_MAX_DIGITS: spare room numpy leaves in each header
_ZIP64_LIMIT = (1 << 31) - 1        # as Python's zipfile: sizes and offsets above this go in zip64 fields
_COUNT_LIMIT = 0xFFFE               # 65535 members (0xFFFF, the zip64 marker) or more need the zip64 end record
_ALIGN_EXTRA = 0xD935               # the extra field id Android's zipalign pads with
_DOS_TIME, _DOS_DATE = 0, (0 << 9) | (1 << 5) | 1      # 1980-01-01 00:00:00, the earliest zip date
_UNIX = 3                           # "version made by" host: Unix, as Python's zipfile on Linux
_FILE_MODE = 0o644 << 16            # external attributes: a regular file, rw-r--r--


# ---------------------------------------------------------------------------------------------
# Reading

def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """Names, dtypes, shapes and metadata from the directory and each member's .npy header; the
    elements are read when a tensor is loaded."""
    try:
        if not path.stat().st_size:
            raise FormatError(path, "empty file: not an npz archive")
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            members, extra = npz_members.read_members(buf)
            metadata, dtypes = _read_document(path, buf, extra) if extra is not None else ({}, {})
    except ParseError as e:
        raise FormatError(path, f"not a readable npz archive ({e})") from e
    except FormatError:
        raise
    except (OSError, ValueError) as e:
        raise FormatError(path, f"cannot read the npz archive ({e})") from e
    mapped = MappedFile(path)
    tensors: dict[str, LazyTensor] = {}
    for member in members:
        stored, dtype = _dtypes(path, member, dtypes.get(member.name))
        tensors[member.name] = _lazy(path, mapped, member, stored, dtype)
    unknown = sorted(set(dtypes) - set(tensors))
    if unknown:
        raise FormatError(path, f"{MEMBER} gives the dtype of {unknown[0]!r}, which the archive does not hold")
    for alias, target in tied_names(path, metadata, tensors).items():
        if alias in tensors:
            raise FormatError(path, f"tied tensor {alias!r} is also stored as an array of its own")
        tensors[alias] = tensors[target]
    arch_json = metadata.pop(ARCH_KEY, None)
    arch = ArchSpec.from_json(arch_json, source=path) if arch_json is not None else None
    return quantized_layout.group(path, Checkpoint(tensors=tensors, metadata=metadata, arch=arch))


def _read_document(path: Path, buf: Any, entry: zipdir.ZipEntry) -> tuple[dict[str, str], dict[str, str]]:
    """modelkit.json: the metadata (str -> str) and the true dtypes by tensor name, each checked."""
    if entry.file_size > _JSON_LIMIT:
        raise FormatError(path, f"{MEMBER} is {entry.file_size} bytes; refusing anything over {_JSON_LIMIT}")
    data = bytearray(entry.file_size)
    zipdir.read_into(buf, entry, data)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:   # RecursionError: nested too deep
        raise FormatError(path, f"{MEMBER} is not valid UTF-8 JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("layout") != NPZ_LAYOUT:
        found = doc.get("layout") if isinstance(doc, dict) else type(doc).__name__
        raise FormatError(path, f"{MEMBER} is not in modelkit's layout {NPZ_LAYOUT!r} (found {found!r}); "
                                "a newer modelkit may have written it, or another program: rename or remove "
                                "that member to read the arrays alone")
    metadata, dtypes = doc.get("metadata", {}), doc.get("dtypes", {})
    for key, table in (("metadata", metadata), ("dtypes", dtypes)):
        if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
            raise FormatError(path, f"the {key!r} entry of {MEMBER} must map strings to strings")
    bad = next((v for v in dtypes.values() if v not in DTYPES), None)
    if bad is not None:
        raise FormatError(path, f"{MEMBER} names dtype {bad!r}, which modelkit does not know "
                                f"(known: {', '.join(DTYPES)})")
    return dict(metadata), dict(dtypes)


def _dtypes(path: Path, member: npz_members.Member, true_name: str | None) -> tuple[np.dtype, DType]:
    """The member's numpy dtype as stored, and the tensor's DType; FormatError for what is not a tensor."""
    header, name = member.header, member.name
    if header.has_object:
        raise FormatError(path, f"array {name!r} holds pickled Python objects (a numpy object array); modelkit "
                                "never unpickles, so it does not read it: save numeric arrays instead (np.savez "
                                "of object arrays needs allow_pickle on loading, which runs code from the file)")
    if not isinstance(header.descr, str):
        raise FormatError(path, f"array {name!r} is a structured array ({header.descr!r}); modelkit reads numeric "
                                "and boolean arrays only")
    try:
        stored = np.dtype(header.descr)
    except (TypeError, ValueError, SyntaxError) as e:
        raise FormatError(path, f"array {name!r} has dtype {header.descr!r}, which numpy does not know ({e})") from e
    if stored.hasobject:
        raise FormatError(path, f"array {name!r} holds pickled Python objects; modelkit never unpickles")
    little = stored.newbyteorder("<")
    dtype = None
    if stored.kind in "biufc" and not stored.fields and stored.subdtype is None and header.itemsize == stored.itemsize:
        try:
            dtype = as_dtype(little)
        except ValueError:
            dtype = None
    if dtype is None:
        raise FormatError(path, f"array {name!r} has dtype {header.descr!r} ({stored}), which is not a tensor dtype "
                                f"modelkit stores (known: {', '.join(DTYPES)})")
    if true_name is not None:
        true = DTYPES[true_name]
        if true.numpy != little:
            raise FormatError(path, f"{MEMBER} says {name!r} is {true_name}, stored as {true.numpy}, but the array "
                                    f"is {little}")
        dtype = true
    return stored, dtype


def _lazy(path: Path, mapped: MappedFile, member: npz_members.Member, stored: np.dtype, dtype: DType) -> LazyTensor:
    header = member.header
    nbytes = header.numel * stored.itemsize
    # Fortran order with at most one axis longer than 1 lays the elements out as C order does.
    c_order = not header.fortran_order or sum(d > 1 for d in header.shape) <= 1
    source = f"{path}:{member.name}"
    if member.stored and c_order and stored == stored.newbyteorder("<"):
        return LazyTensor(dtype, header.shape, lambda: _view(path, mapped, member, dtype), source,
                          span=FileSpan(path, member.data_offset, nbytes))
    return LazyTensor(dtype, header.shape, lambda: _copy(path, member, stored, dtype, c_order), source)


def _view(path: Path, mapped: MappedFile, member: npz_members.Member, dtype: DType) -> np.ndarray:
    """A stored little-endian C-order member: a view of the file's pages, after its CRC-32 is checked."""
    whole = mapped.view(member.start, member.entry.file_size, f"array {member.name!r}")
    if zlib.crc32(whole) != member.entry.CRC:
        raise FormatError(path, f"array {member.name!r} does not match its CRC-32 (the file is corrupt, or was "
                                "changed after it was written)")
    data = whole[member.header_len:]
    if not data.size:
        return np.empty(member.header.shape, dtype=dtype.numpy)
    return data.view(dtype.numpy).reshape(member.header.shape)


def _copy(path: Path, member: npz_members.Member, stored: np.dtype, dtype: DType, c_order: bool) -> np.ndarray:
    """A deflated, Fortran-order or big-endian member, read (decompressed) into a 64-byte aligned array of
    exactly the member's size, then put in little-endian C order."""
    size = member.entry.file_size
    raw = np.empty(size + _ALIGN, dtype=np.uint8)
    shift = -(raw.ctypes.data + member.header_len) % _ALIGN          # the elements start aligned
    whole = raw[shift:shift + size]
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            zipdir.read_into(buf, member.entry, whole)
    except ParseError as e:
        raise FormatError(path, f"array {member.name!r}: {e.reason}") from e
    except (OSError, ValueError) as e:
        raise FormatError(path, f"array {member.name!r} cannot be read ({e})") from e
    shape = member.header.shape
    flat = whole[member.header_len:]
    elements = flat.view(stored) if flat.size else np.empty(0, dtype=stored)
    array = elements.reshape(shape) if c_order else elements.reshape(shape[::-1]).T
    if array.dtype == dtype.numpy and array.flags.c_contiguous:
        return array                                      # deflated, little-endian, C order: the buffer itself
    out = np.array(array, order="C")                      # C order, still as stored
    if stored != stored.newbyteorder("<"):
        out.byteswap(inplace=True)                        # big-endian bits -> little-endian bits, exactly
    return out.view(dtype.numpy)



# ---------------------------------------------------------------------------------------------
# Writing

def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    """Write one .npz of stored .npy members, one tensor at a time (unchanged bytes copied file to
    file), then modelkit.json and the central directory."""
    ckpt, _ = quantized_layout.flatten(ckpt, target="npz")
    tensors, aliases = _stored_tensors(ckpt)
    document = _document(ckpt, tensors, aliases)
    with path.open("wb") as out:
        archive = _ZipWriter(out)
        for name, entry in tensors.items():
            archive.add_array(name + SUFFIX, entry)
        if document is not None:
            archive.add_bytes(MEMBER, document)
        archive.finish()


def _stored_tensors(ckpt: Checkpoint) -> tuple[dict[str, LazyTensor], dict[str, str]]:
    """The tensors to store, and the tied names left out (alias -> stored name); everything npz
    cannot hold is refused here, before the file is created."""
    for name, entry in ckpt.tensors.items():
        if isinstance(entry, QuantizedTensor):          # flatten() leaves none; a guard for a layout it skips
            raise UnsupportedConversionError("quantized checkpoint", "npz", f"tensor {name!r} is quantized "
                                             f"({entry.scheme}); dequantize it first")
        problem = member_problem(name)
        if problem:
            raise UnsupportedConversionError("checkpoint", "npz", f"tensor name {name!r} {problem}; a zip member "
                                             "named so is unsafe to extract (rename the tensor)")
        if name == MEMBER or name.endswith(SUFFIX):
            raise UnsupportedConversionError("checkpoint", "npz", f"tensor name {name!r} would be ambiguous in "
                                             f"np.load (it strips one {SUFFIX!r} and lists {MEMBER!r} as it is); "
                                             "rename the tensor")
        try:
            encoded = (name + SUFFIX).encode("utf-8")
        except UnicodeEncodeError:
            raise UnsupportedConversionError("checkpoint", "npz", f"tensor name {name!r} is not valid Unicode (a "
                                             "lone surrogate); a zip member name must be UTF-8") from None
        if len(encoded) > 0xFFFF:
            raise UnsupportedConversionError("checkpoint", "npz", f"tensor name {name[:40]!r}... is longer than a "
                                             "zip member name can be (65535 bytes)")
    try:
        aliases = json.loads(ckpt.metadata.get(ALIASES_KEY, "{}"))
    except json.JSONDecodeError:
        aliases = {}
    aliases = aliases if isinstance(aliases, dict) else {}
    tied = {}
    for alias, target in aliases.items():     # stored once when the target is stored and the same tensor
        a, t = ckpt.tensors.get(alias), ckpt.tensors.get(target) if isinstance(target, str) else None
        if a is not None and t is not None and target not in aliases and (a.dtype, a.shape) == (t.dtype, t.shape):
            tied[alias] = target
    stored = {name: entry for name, entry in ckpt.tensors.items() if name not in tied}
    return stored, tied


def _document(ckpt: Checkpoint, tensors: dict[str, LazyTensor], aliases: dict[str, str]) -> bytes | None:
    """modelkit.json, or None when a plain numpy archive says everything (no metadata, numpy dtypes only)."""
    metadata = {k: v for k, v in ckpt.metadata.items() if k != ALIASES_KEY}
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    if ckpt.arch is not None:
        metadata[ARCH_KEY] = ckpt.arch.to_json()
    dtypes = {name: entry.dtype.name for name, entry in tensors.items() if not entry.dtype.exact}
    if not metadata and not dtypes and tensors:
        return None
    doc = {"layout": NPZ_LAYOUT, "metadata": metadata, "dtypes": dtypes}
    return (json.dumps(doc, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


def npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    """The .npy header numpy.save writes for a C-order array: version 1.0 (2.0 past 64 KiB), the dict with
    numpy's spare room for growing the first axis, padded to a multiple of 64 bytes."""
    shape = tuple(int(d) for d in shape)
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    if shape:
        text += " " * (_GROWTH_DIGITS - len(repr(shape[0])))
    for version, length in ((1, "<H"), (2, "<I")):
        prefix = len(npy.MAGIC) + 2 + struct.calcsize(length)
        pad = _ALIGN - (prefix + len(text) + 1) % _ALIGN
        if len(text) + 1 + pad < 1 << (8 * struct.calcsize(length)):
            return (npy.MAGIC + bytes((version, 0)) + struct.pack(length, len(text) + 1 + pad)
                    + text.encode("latin-1") + b" " * pad + b"\n")
    raise UnsupportedConversionError("checkpoint", "npz", f"a shape of {len(shape)} axes does not fit a .npy header")


def _span_crc(span: FileSpan, crc: int) -> int:
    """CRC-32 of a span's bytes, continuing `crc`, read through a map of the source (no copy)."""
    return zlib.crc32(MappedFile(span.path).view(span.offset, span.nbytes, "a tensor"), crc)


class _ZipWriter:
    """Stored members one after another, then the central directory (APPNOTE 4.3; zip64 as 4.5.3).

    Sizes, offsets and counts past Python zipfile's limits go into zip64 fields exactly as zipfile
    writes them; `_ZIP64_LIMIT` and `_COUNT_LIMIT` are module constants so a test can lower them.
    """

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.entries: list[tuple[bytes, int, int, int, int]] = []     # name, flags, crc, size, offset

    def add_array(self, member: str, entry: LazyTensor) -> None:
        header = npy_header(entry.dtype.numpy.str, entry.shape)
        if entry.span is not None and entry.span.nbytes == entry.nbytes:   # unchanged bytes: copied in the kernel
            self._local(member, zlib.crc32(header) if not entry.nbytes else _span_crc(entry.span, zlib.crc32(header)),
                        len(header) + entry.nbytes, align=True)
            self.out.write(header)
            if entry.nbytes:
                copy_span(entry.span, self.out)
            elif entry.span.copied is not None:
                entry.span.copied()
            return
        data = tensor_bytes(contiguous(entry.array()))        # stored bits, little-endian, C order
        self._local(member, zlib.crc32(data, zlib.crc32(header)), len(header) + len(data), align=True)
        self.out.write(header)
        write_all(self.out, data)

    def add_bytes(self, member: str, data: bytes) -> None:
        self._local(member, zlib.crc32(data), len(data), align=False)
        self.out.write(data)

    def _local(self, member: str, crc: int, size: int, *, align: bool) -> None:
        raw = member.encode("utf-8")
        flags = 0 if member.isascii() else 0x800                    # bit 11: the name is UTF-8
        offset = self.out.tell()
        zip64 = size > _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        if align:                                                   # the member's data starts 64-byte aligned
            pad = -(offset + 30 + len(raw) + len(extra) + 6) % _ALIGN
            extra += struct.pack("<HHH", _ALIGN_EXTRA, 2 + pad, _ALIGN) + bytes(pad)
        version = 45 if zip64 else 20
        field = 0xFFFFFFFF if zip64 else size
        self.out.write(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", version, flags, zipdir.STORED, _DOS_TIME,
                                   _DOS_DATE, crc, field, field, len(raw), len(extra)) + raw + extra)
        self.entries.append((raw, flags, crc, size, offset))

    def finish(self) -> None:
        start = self.out.tell()
        for raw, flags, crc, size, offset in self.entries:
            extra = b""
            if size > _ZIP64_LIMIT:
                extra += struct.pack("<QQ", size, size)
            if offset > _ZIP64_LIMIT:
                extra += struct.pack("<Q", offset)
            if extra:
                extra = struct.pack("<HH", 1, len(extra)) + extra
            version = 45 if extra else 20
            size_field = 0xFFFFFFFF if size > _ZIP64_LIMIT else size
            offset_field = 0xFFFFFFFF if offset > _ZIP64_LIMIT else offset
            self.out.write(struct.pack("<4sBBHHHHHIIIHHHHHII", b"PK\x01\x02", version, _UNIX, version, flags,
                                       zipdir.STORED, _DOS_TIME, _DOS_DATE, crc, size_field, size_field, len(raw),
                                       len(extra), 0, 0, 0, _FILE_MODE, offset_field) + raw + extra)
        size = self.out.tell() - start
        count = len(self.entries)
        if count > _COUNT_LIMIT or size > _ZIP64_LIMIT or start > _ZIP64_LIMIT:
            record = self.out.tell()
            self.out.write(struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, start))
            self.out.write(struct.pack("<4sIQI", b"PK\x06\x07", 0, record, 1))
        count16 = 0xFFFF if count > _COUNT_LIMIT else count
        self.out.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count16, count16,
                                   0xFFFFFFFF if size > _ZIP64_LIMIT else size,
                                   0xFFFFFFFF if start > _ZIP64_LIMIT else start, 0))
