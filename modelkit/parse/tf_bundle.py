"""TensorFlow's tensor bundle (checkpoints, a SavedModel's variables/): the `.index` table and its entries.

A checkpoint `PREFIX` is `PREFIX.index` plus `PREFIX.data-NNNNN-of-MMMMM` shards of raw tensor bytes.
Spec: tensorflow/core/util/tensor_bundle/tensor_bundle.{h,cc} and tensor_bundle.proto; the table is
LevelDB's sorted string table (tensorflow/core/lib/io/table_format.txt, TF's copy of leveldb's):

    data blocks | metaindex block | index block | footer (48 bytes)
    footer:  metaindex handle | index handle (each: varint offset, varint size) | zero padding to 40 bytes |
             u64 magic 0xdb4775248b80fb57
    block:   entries | u32 restart offsets... | u32 restart count; then a 5-byte trailer:
             u8 compression (0: none) | u32 masked crc32c of the block and that byte
    entry:   varint shared key bytes | varint unshared | varint value length | unshared key bytes | value
    index block: key -> handle of the data block holding keys up to it

In the data blocks, key "" holds a BundleHeaderProto {1: num_shards, 2: endianness (0 little), 3: version}
and every other key (a tensor's checkpoint key) a BundleEntryProto {1: dtype, 2: TensorShapeProto
{2: dim {1: size}}, 3: shard_id, 4: offset, 5: size, 6: fixed32 masked crc32c of the bytes, 7: slices}.
A numeric tensor is `size` raw little-endian bytes at `offset` of its shard; a string tensor (the
checkpoint's object graph) is varint lengths, a u32 masked crc32c of them, then the strings.

The object graph (key `_CHECKPOINTABLE_OBJECT_GRAPH`, a TrackableObjectGraph, trackable_object_graph.proto)
names every variable: nodes {1: children {1: node_id, 2: local_name}, 2: attributes {1: name,
2: full_name, 3: checkpoint_key}}. Every count, length and offset is checked before it is used.
Standard library only.
"""
from __future__ import annotations

import struct
from collections import namedtuple

from modelkit.errors import ParseError
from modelkit.parse.protobuf import I32, LEN, VARINT, fields, int64s, text, varint

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_BYTES = 48
TRAILER_BYTES = 5
HEADER_KEY = ""
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
MAX_INDEX_BYTES = 1 << 30
MAX_ENTRIES = 1_000_000
MAX_DIMS = 64
MAX_SHARDS = 100_000
MAX_KEY_BYTES = 1 << 16
MAX_OBJECT_GRAPH_NODES = 1_000_000

# DataType (tensorflow/core/framework/types.proto) -> modelkit dtype name; 7 is DT_STRING.
DTYPES = {1: "float32", 2: "float64", 3: "int32", 4: "uint8", 5: "int16", 6: "int8", 7: "string", 8: "complex64",
          9: "int64", 10: "bool", 14: "bfloat16", 17: "uint16", 18: "complex128", 19: "float16", 22: "uint32",
          23: "uint64"}
DTYPE_NAMES = {1: "DT_FLOAT", 2: "DT_DOUBLE", 3: "DT_INT32", 4: "DT_UINT8", 5: "DT_INT16", 6: "DT_INT8",
               7: "DT_STRING", 8: "DT_COMPLEX64", 9: "DT_INT64", 10: "DT_BOOL", 14: "DT_BFLOAT16",
               17: "DT_UINT16", 18: "DT_COMPLEX128", 19: "DT_HALF", 20: "DT_RESOURCE", 21: "DT_VARIANT",
               22: "DT_UINT32", 23: "DT_UINT64"}
ITEMSIZE = {"float32": 4, "float64": 8, "int32": 4, "uint8": 1, "int16": 2, "int8": 1, "int64": 8, "bool": 1,
            "bfloat16": 2, "uint16": 2, "float16": 2, "uint32": 4, "uint64": 8, "complex64": 8, "complex128": 16}


# ---------------------------------------------------------------------------------------------
# crc32c (Castagnoli), and LevelDB's mask of a stored crc.

def _table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


CRC32C_TABLE = _table()


def crc32c(data, crc: int = 0) -> int:
    """crc32c of `data`, continuing from `crc` (pure Python: for index blocks; tensor data uses
    modelkit.storage.checksums, vectorized)."""
    table = CRC32C_TABLE
    crc ^= 0xFFFFFFFF
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def unmask(masked: int) -> int:
    """The crc32c LevelDB stored masked (rotated right 15 bits after subtracting a constant)."""
    rot = (masked - 0xA282EAD8) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# The sorted table.

def _handle(buf, pos: int, end: int) -> tuple[int, int, int]:
    offset, pos = varint(buf, pos, end)
    size, pos = varint(buf, pos, end)
    return offset, size, pos


def _block(buf, offset: int, size: int, end: int, what: str):
    """The contents of a block (trailer checked: no compression, crc32c of contents + type byte)."""
    if offset > end or size > end - offset or TRAILER_BYTES > end - offset - size:
        raise ParseError(f"the {what} block at {offset} (+{size}) runs past the table's end {end}", offset=offset)
    kind = buf[offset + size]
    if kind != 0:
        raise ParseError(f"the {what} block is compressed (type {kind}); TensorFlow writes bundles uncompressed",
                         offset=offset + size)
    stored = struct.unpack_from("<I", buf, offset + size + 1)[0]
    if crc32c(buf[offset:offset + size + 1]) != unmask(stored):
        raise ParseError(f"the {what} block's crc32c does not match its bytes (a damaged index)", offset=offset)
    return offset, offset + size


def _entries(buf, start: int, end: int, what: str):
    """(key bytes, (value start, value stop)) of a block's entries, keys rebuilt from their shared prefixes."""
    if end - start < 4:
        raise ParseError(f"the {what} block is shorter than its restart count", offset=start)
    restarts = struct.unpack_from("<I", buf, end - 4)[0]
    if restarts > (end - start - 4) // 4:
        raise ParseError(f"the {what} block claims {restarts} restart points, more than fit", offset=end - 4)
    limit = end - 4 - 4 * restarts
    key = b""
    pos = start
    while pos < limit:
        shared, pos = varint(buf, pos, limit)
        unshared, pos = varint(buf, pos, limit)
        length, pos = varint(buf, pos, limit)
        if shared > len(key) or unshared > limit - pos or length > limit - pos - unshared:
            raise ParseError(f"an entry of the {what} block runs past it or shares more key than there is", offset=pos)
        key = key[:shared] + bytes(buf[pos:pos + unshared])
        if len(key) > MAX_KEY_BYTES:
            raise ParseError(f"a key longer than {MAX_KEY_BYTES} bytes", offset=pos)
        pos += unshared
        yield key, (pos, pos + length)
        pos += length


def table_items(buf, end: int | None = None):
    """(key, value span) of every data entry of the sorted table in buf[:end], in key order."""
    end = len(buf) if end is None else end
    if end < FOOTER_BYTES:
        raise ParseError(f"{end} bytes: shorter than a table footer ({FOOTER_BYTES})")
    if end > MAX_INDEX_BYTES:
        raise ParseError(f"an index of {end} bytes; more than {MAX_INDEX_BYTES} is not read")
    footer = end - FOOTER_BYTES
    if struct.unpack_from("<Q", buf, end - 8)[0] != TABLE_MAGIC:
        raise ParseError("no sorted-table magic at the end: not a TensorFlow checkpoint index", offset=end - 8)
    _, _, pos = _handle(buf, footer, end - 8)
    index_offset, index_size, _ = _handle(buf, pos, end - 8)
    start, stop = _block(buf, index_offset, index_size, footer, "index")
    previous = -1
    count = 0
    for _, span in _entries(buf, start, stop, "index"):
        offset, size, after = _handle(buf, span[0], span[1])
        if offset <= previous:
            raise ParseError("the index's data blocks are not in file order", offset=span[0])
        previous = offset
        block_start, block_stop = _block(buf, offset, size, index_offset, "data")
        for key, value in _entries(buf, block_start, block_stop, "data"):
            count += 1
            if count > MAX_ENTRIES:
                raise ParseError(f"more than {MAX_ENTRIES} entries")
            yield key, value


# ---------------------------------------------------------------------------------------------
# The bundle.

# Records are named tuples, not dataclasses: the scanner imports this module, and dataclasses' import is slow.
class Entry(namedtuple("Entry", "key dtype_code shape shard offset size crc32c sliced")):
    """One tensor of a bundle, as its BundleEntryProto says: crc32c unmasked (None when the entry has none);
    sliced for a partitioned variable's slices (not read by modelkit)."""

    __slots__ = ()

    @property
    def dtype(self) -> str | None:
        """modelkit's dtype name, or None for types modelkit does not hold (resource, variant, complex)."""
        return DTYPES.get(self.dtype_code)

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES.get(self.dtype_code, f"DataType {self.dtype_code}")

    @property
    def numel(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count


class Bundle(namedtuple("Bundle", "num_shards entries")):
    """The shard count and the entries by key."""

    __slots__ = ()


def _shape(buf, span) -> tuple[int, ...]:
    dims: list[int] = []
    for number, wire, value in fields(buf, *span):
        if number == 3 and wire == VARINT and value:
            raise ParseError("a tensor shape marked unknown_rank")
        if number != 2 or wire != LEN:
            continue
        size = 0
        for n, w, v in fields(buf, *value):
            if n == 1:
                size = int64s(buf, w, v)[0]
        if size < 0:
            raise ParseError(f"a tensor dimension of {size}")
        dims.append(size)
        if len(dims) > MAX_DIMS:
            raise ParseError(f"a tensor with more than {MAX_DIMS} dimensions")
    return tuple(dims)


def _entry(buf, key: str, span) -> Entry:
    values: dict[str, object] = {"dtype": 0, "shape": (), "shard": 0, "offset": 0, "size": 0, "crc": None,
                                 "sliced": False}
    names = {1: "dtype", 3: "shard", 4: "offset", 5: "size"}
    for number, wire, value in fields(buf, *span):
        if number in names and wire == VARINT:
            values[names[number]] = value
        elif number == 2 and wire == LEN:
            values["shape"] = _shape(buf, value)
        elif number == 6 and wire == I32:
            values["crc"] = unmask(struct.unpack_from("<I", buf, value)[0])
        elif number == 7:
            values["sliced"] = True
    return Entry(key, int(values["dtype"]), values["shape"], int(values["shard"]), int(values["offset"]),
                 int(values["size"]), values["crc"], bool(values["sliced"]))


def read_index(buf) -> Bundle:
    """The bundle a `.index` file describes (its header and every entry), checked for consistency:
    shard ids below the header's count, numeric sizes equal to shape x item size.

    Raises:
        ParseError: the table or an entry is malformed, or the bundle is big-endian.
    """
    num_shards = None
    entries: dict[str, Entry] = {}
    for raw_key, span in table_items(buf):
        key = raw_key.decode("utf-8", "replace")
        if raw_key == b"":
            header = {n: v for n, w, v in fields(buf, *span) if w == VARINT}
            num_shards = header.get(1, 1)
            if header.get(2, 0) != 0:
                raise ParseError("a big-endian bundle; modelkit reads little-endian ones")
            if not 0 < num_shards <= MAX_SHARDS:
                raise ParseError(f"the bundle header claims {num_shards} shards")
            continue
        entry = _entry(buf, key, span)
        if num_shards is not None and not entry.sliced and entry.shard >= num_shards:
            raise ParseError(f"tensor {key!r} is in shard {entry.shard}, the bundle has {num_shards}")
        itemsize = ITEMSIZE.get(entry.dtype or "")
        if itemsize is not None and not entry.sliced and entry.numel * itemsize != entry.size:
            raise ParseError(f"tensor {key!r}: {entry.dtype} {list(entry.shape)} needs {entry.numel * itemsize} "
                             f"bytes, its entry says {entry.size}")
        entries[key] = entry
    if num_shards is None:
        raise ParseError("no bundle header (the table's first key \"\" is missing): not a TensorFlow checkpoint")
    return Bundle(num_shards, entries)


def shard_name(prefix: str, shard: int, num_shards: int) -> str:
    """The data file of `shard`: PREFIX.data-00000-of-00001 (tensor_bundle.cc DataFilename)."""
    return f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"


def strings(data: bytes, count: int) -> list[bytes]:
    """A string tensor's `count` elements from its bytes: varint lengths, a u32 crc of them, the strings."""
    pos, lengths = 0, []
    for _ in range(count):
        length, pos = varint(data, pos, len(data))
        lengths.append(length)
    pos += 4
    if pos > len(data) or sum(lengths) > len(data) - pos:
        raise ParseError(f"a string tensor's lengths claim {sum(lengths)} bytes, {max(len(data) - pos, 0)} remain")
    out = []
    for length in lengths:
        out.append(data[pos:pos + length])
        pos += length
    return out


class Variable(namedtuple("Variable", "checkpoint_key full_name path")):
    """A variable the object graph names: its checkpoint key, TF's name for it, and its object path (local
    names from the root: "model/layer_with_weights-0/kernel")."""

    __slots__ = ()


def object_graph(blob: bytes) -> list[Variable]:
    """The variables of a TrackableObjectGraph, each with the first path from the root that reaches it."""
    nodes: list[tuple[list[tuple[int, str]], list[tuple[str, str, str]]]] = []
    for number, wire, value in fields(blob, 0, len(blob)):
        if number != 1 or wire != LEN:
            continue
        if len(nodes) >= MAX_OBJECT_GRAPH_NODES:
            raise ParseError(f"an object graph of more than {MAX_OBJECT_GRAPH_NODES} nodes")
        children, attributes = [], []
        for n, w, v in fields(blob, *value):
            if w != LEN:
                continue
            if n == 1:
                ref = {k: val for k, ww, val in fields(blob, *v)}
                name = text(blob, ref[2], strict=False) if isinstance(ref.get(2), tuple) else ""
                children.append((int(ref.get(1, 0)) if isinstance(ref.get(1), int) else 0, name))
            elif n == 2:
                parts = {k: text(blob, val, strict=False) for k, ww, val in fields(blob, *v) if ww == LEN}
                attributes.append((parts.get(1, ""), parts.get(2, ""), parts.get(3, "")))
        nodes.append((children, attributes))
    paths: dict[int, str] = {0: ""} if nodes else {}
    queue = [0] if nodes else []
    for node in queue:                                # breadth first: the shortest path names each node
        for child, name in nodes[node][0]:
            if 0 <= child < len(nodes) and child not in paths:
                paths[child] = f"{paths[node]}/{name}" if paths[node] else name
                queue.append(child)
    found = []
    for index, (_, attributes) in enumerate(nodes):
        for _name, full_name, key in attributes:
            if key:
                found.append(Variable(key, full_name, paths.get(index, key)))
    return found
