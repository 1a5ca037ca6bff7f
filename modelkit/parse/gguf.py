"""The GGUF header: metadata key/value pairs and tensor infos, every length, count and offset checked
against the file before anything is allocated or read. Tensor data is never read.

Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (all little-endian)

    header       'GGUF' | u32 version | u64 tensor_count | u64 kv_count      (v1: u32 counts)
    kv           string key | u32 value type | value
    string       u64 length | UTF-8 bytes                                      (v1: u32 length)
    array        u32 item type | u64 count | items
    tensor info  string name | u32 n_dims | u64 dims[n_dims] | u32 ggml type | u64 offset
    data         starts at the header's end rounded up to general.alignment (default 32)

The scanner (which also reports chat templates) and the GGUF converter (before gguf-py's reader,
which trusts counts and loops without end on some) both read headers here. Standard library only.
"""
from __future__ import annotations

import struct

from modelkit.errors import ParseError

MAGIC = b"GGUF"
HEADER_BYTES = 24
# value types (gguf.md "gguf_metadata_value_type")
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY, UINT32 = 8, 9, 4
_SMALLEST_ITEM = {STRING: 8, ARRAY: 12}     # the least bytes an array item of these types takes
# ggml type -> (block size, bytes per block): gguf-py's GGML_QUANT_SIZES
GGML_TYPES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
              10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
              16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110),
              22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
              29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18)}
MAX_DIMS = 4                     # GGML_MAX_DIMS: llama.cpp refuses tensors with more
MAX_STRING = 64 << 20            # one key or string value; chat templates are a few KB
MAX_ARRAY_ITEMS = 1 << 23        # all metadata arrays together; a 256k vocabulary and its merges use ~1M
ALIGNMENT_KEY = "general.alignment"


class TensorInfo:
    """One tensor's entry: name, dims (GGML order, fastest first), ggml type, offset into the data, size."""

    __slots__ = ("name", "dims", "ggml_type", "offset", "nbytes")

    def __init__(self, name: str, dims: tuple[int, ...], ggml_type: int, offset: int, nbytes: int) -> None:
        self.name, self.dims, self.ggml_type, self.offset, self.nbytes = name, dims, ggml_type, offset, nbytes


class Header:
    """A checked GGUF header. `values` holds scalar and string metadata (arrays are checked, not kept;
    `kv_count` counts every entry); `data_start` is where tensor data begins and `data_end` where the last
    tensor ends, in the buffer."""

    __slots__ = ("version", "kv_count", "values", "tensors", "alignment", "data_start", "data_end")

    def __init__(self, version: int, kv_count: int, values: dict, tensors: list[TensorInfo], alignment: int,
                 data_start: int, data_end: int) -> None:
        self.version, self.kv_count, self.values, self.tensors = version, kv_count, values, tensors
        self.alignment, self.data_start, self.data_end = alignment, data_start, data_end


class _Reader:
    """A cursor over buf[start:end] that checks each read against the bytes left."""

    def __init__(self, buf, start: int, end: int, count_fmt: str = "<Q") -> None:
        self.buf, self.start, self.pos, self.end = buf, start, start, end
        self.count_fmt, self.items = count_fmt, 0

    def fail(self, what: str) -> ParseError:
        return ParseError(f"{what}; the file is truncated or corrupt", offset=self.pos - self.start)

    def take(self, n: int, what: str) -> int:
        if n > self.end - self.pos:
            raise self.fail(f"{what} needs {n} bytes but only {self.end - self.pos} remain")
        at, self.pos = self.pos, self.pos + n
        return at

    def unpack(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack(self.count_fmt, f"{what} length")
        at = self.take(n, what)
        if n > MAX_STRING:
            raise self.fail(f"{what} has {n} bytes, more than the {MAX_STRING} allowed")
        try:
            return bytes(self.buf[at:at + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 ({e.reason})") from None

    def value(self, vtype: int, depth: int = 0, keep: bool = False):
        """A scalar or string; an array is checked and skipped (None): token lists hold 100k+ strings.
        With `keep`, an array of scalars or strings comes back as a list."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], "a value")
        if vtype == STRING:
            return self.string("a string")
        if vtype == ARRAY and depth < 2:
            item_type, count = self.unpack("<I", "an array type"), self.unpack(self.count_fmt, "an array length")
            smallest = struct.calcsize(_SCALARS[item_type]) if item_type in _SCALARS else _SMALLEST_ITEM.get(item_type, 1)
            if count * smallest > self.end - self.pos:
                raise self.fail(f"an array claims {count} items, more than the file can hold")
            self.items += count
            if self.items > MAX_ARRAY_ITEMS:      # readers keep each item as an object
                raise self.fail(f"metadata arrays hold over {MAX_ARRAY_ITEMS} items; refusing to read them")
            if keep and (item_type in _SCALARS or item_type == STRING):
                return [self.value(item_type, depth + 1) for _ in range(count)]
            if item_type in _SCALARS:
                self.take(count * smallest, f"an array of {count} items")
            else:
                for _ in range(count):
                    self.value(item_type, depth + 1)
            return None
        raise self.fail(f"unknown metadata value type {vtype}")


def plausible(head: bytes, *, versions: tuple[int, ...] = (2, 3)) -> bool:
    """The first 24 bytes of a file start a GGUF header: the magic, a known version and room for two counts."""
    return len(head) >= HEADER_BYTES and head[:4] == MAGIC and struct.unpack_from("<I", head, 4)[0] in versions


def read_header(buf, start: int = 0, end: int | None = None, *, versions: tuple[int, ...] = (2, 3),
                arrays: frozenset[str] = frozenset()) -> Header:
    """Read and check the GGUF header of buf[start:end] (bytes or an mmap).

    Args:
        buf: The file's bytes.
        start, end: The file's extent in `buf` (a member of an archive, or all of it).
        versions: The GGUF versions accepted (the scanner reads version 1 too).
        arrays: Keys whose arrays (of scalars or strings) `values` keeps, as lists.

    Returns:
        The Header: every tensor's bytes lie inside the file, aligned, after the header and not
        overlapping another's.

    Raises:
        ParseError: the first thing that does not fit, with where it is.
    """
    end = len(buf) if end is None else end
    if end - start < HEADER_BYTES:
        raise ParseError(f"a GGUF file has a {HEADER_BYTES}-byte header; this file has {end - start} bytes")
    if bytes(buf[start:start + 4]) != MAGIC:
        raise ParseError(f"not a GGUF file: it starts with {bytes(buf[start:start + 4])!r}, not {MAGIC!r}")
    r = _Reader(buf, start, end)
    r.pos += 4
    version = r.unpack("<I", "the version")
    if version not in versions:
        raise ParseError(f"GGUF version {version} is not supported ({', '.join(map(str, versions))} are)")
    r.count_fmt = "<I" if version == 1 else "<Q"
    n_tensors, n_kv = r.unpack(r.count_fmt, "the tensor count"), r.unpack(r.count_fmt, "the metadata count")
    # a metadata entry takes at least 13 bytes (key length, type, one byte), a tensor info 24
    if n_kv * 13 + n_tensors * 24 > end - r.pos:
        raise r.fail(f"the header claims {n_tensors} tensors and {n_kv} metadata entries, more than the file holds")
    values: dict = {}
    alignment = 32
    for _ in range(n_kv):
        key = r.string("a metadata key")
        vtype = r.unpack("<I", "a metadata type")
        value = r.value(vtype, keep=key in arrays)
        if key == ALIGNMENT_KEY and vtype == UINT32:
            if value == 0 or value & (value - 1):
                raise r.fail(f"{ALIGNMENT_KEY} {value} is not a power of two")
            alignment = value
        if value is not None:
            values[key] = value
    tensors = [_tensor_info(r) for _ in range(n_tensors)]
    data_start = start + -(-(r.pos - start) // alignment) * alignment
    data_end = _check_extents(r, tensors, data_start, alignment)
    return Header(version, n_kv, values, tensors, alignment, data_start, data_end)


def _tensor_info(r: _Reader) -> TensorInfo:
    name = r.string("a tensor name")
    n_dims = r.unpack("<I", "a tensor's dimension count")
    if n_dims > MAX_DIMS:
        raise r.fail(f"tensor {name[:60]!r} has {n_dims} dimensions; GGUF allows {MAX_DIMS}")
    dims = tuple(r.unpack("<Q", "a tensor dimension") for _ in range(n_dims))
    ggml_type, offset = r.unpack("<I", "a tensor type"), r.unpack("<Q", "a tensor offset")
    if ggml_type not in GGML_TYPES:
        raise r.fail(f"tensor {name[:60]!r} has unknown tensor type {ggml_type}")
    block, block_bytes = GGML_TYPES[ggml_type]
    if dims and dims[0] % block:
        raise r.fail(f"tensor {name[:60]!r}: rows of {dims[0]} do not fill whole blocks of {block}")
    numel = 1
    for d in dims:
        numel *= d
    return TensorInfo(name, dims, ggml_type, offset, numel // block * block_bytes)


def _check_extents(r: _Reader, tensors: list[TensorInfo], data_start: int, alignment: int) -> int:
    """Each tensor's bytes: aligned, inside the file, not overlapping; returns where the last one ends."""
    cursor = 0
    for t in sorted(tensors, key=lambda t: t.offset):
        if t.offset % alignment:
            raise r.fail(f"tensor {t.name[:60]!r}: data at offset {t.offset} is misaligned (alignment {alignment})")
        if data_start + t.offset + t.nbytes > r.end:
            raise r.fail(f"tensor {t.name[:60]!r}: {t.nbytes} bytes at offset {t.offset} lie past the end of the file")
        if t.offset < cursor:
            raise r.fail(f"tensor {t.name[:60]!r} overlaps the tensor before it")
        cursor = t.offset + t.nbytes
    return data_start + cursor
