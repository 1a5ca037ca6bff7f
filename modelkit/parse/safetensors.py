"""The safetensors header: an 8-byte little-endian length, then that many bytes of UTF-8 JSON.

    u64 n | JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}} | data

Offsets count from the start of the data section (8 + n). The scanner (integrity findings) and the
safetensors converter (its tensor table) read headers here; the length is checked against the file
and the reference implementation's cap before anything is read. Standard library only.
Spec: https://github.com/huggingface/safetensors (README "Format").
"""
from __future__ import annotations

import json
import struct

from modelkit.errors import ParseError

MAX_HEADER = 100_000_000     # the safetensors library refuses larger headers
MAX_INDEX = 50_000_000       # an index (model.safetensors.index.json) is names and file names: far below this
# dtype -> bits per element (safetensors/src/tensor.rs Dtype::bitsize)
BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
        "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
        "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


class Header:
    """A parsed header: its JSON object, its length, and whether the JSON named a key twice."""

    __slots__ = ("entries", "length", "duplicate_keys")

    def __init__(self, entries: dict, length: int, duplicate_keys: bool) -> None:
        self.entries, self.length, self.duplicate_keys = entries, length, duplicate_keys

    @property
    def data_start(self) -> int:
        """Where the data section starts, from the start of the file."""
        return 8 + self.length


def plausible(head: bytes, size: int) -> bool:
    """The first 9 bytes of a `size`-byte file look like safetensors: a length that fits, then '{'."""
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (length,) = struct.unpack_from("<Q", head)
    return 2 <= length <= min(MAX_HEADER, size - 8)


def header_length(buf, start: int = 0, end: int | None = None) -> int:
    """The declared header length, checked against the file and MAX_HEADER.

    Raises:
        ParseError: fewer than 8 bytes, or a length that does not fit.
    """
    end = len(buf) if end is None else end
    size = end - start
    if size < 8:
        raise ParseError(f"a safetensors file starts with an 8-byte header length; this one has {size} bytes")
    (n,) = struct.unpack_from("<Q", buf, start)
    if n > MAX_HEADER or n > size - 8:
        raise ParseError(f"header length {n} does not fit a {size}-byte file", offset=0)
    return n


def read_header(buf, start: int = 0, end: int | None = None) -> Header:
    """The header of the safetensors file in buf[start:end].

    Raises:
        ParseError: the length does not fit, or the header is not a UTF-8 JSON object.
    """
    n = header_length(buf, start, end)
    outermost: list[list] = [[]]

    def keep(items):      # the last object closed is the outermost one
        outermost[0] = items
        return dict(items)
    try:
        entries = json.loads(bytes(buf[start + 8:start + 8 + n]).decode("utf-8"), object_pairs_hook=keep)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ParseError(f"header is not valid UTF-8 JSON ({e})", offset=8) from None
    if not isinstance(entries, dict):
        raise ParseError("header is not a JSON object", offset=8)
    return Header(entries, n, len(entries) != len(outermost[0]))


def tensor_problem(info: object, data_len: int) -> str | None:
    """What is wrong with one tensor entry given `data_len` bytes of data, or None."""
    if not isinstance(info, dict):
        return "entry is not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in BITS:
        return f"unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        return f"shape {shape!r} is not a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        return f"data_offsets {offsets!r} is not [begin, end]"
    begin, stop = offsets
    if not 0 <= begin <= stop <= data_len:
        return f"data_offsets {offsets} fall outside the {data_len} data bytes"
    bits = BITS[dtype]
    for d in shape:
        bits *= d
    if bits % 8 or bits // 8 != stop - begin:
        return f"{dtype} x {shape} needs {bits / 8:g} bytes, the offsets span {stop - begin}"
    return None


def read_index(data: bytes) -> dict[str, str]:
    """The weight_map of a sharded checkpoint's index (tensor name -> shard file name).

    Shard names are returned as written; `modelkit.parse.paths.plain_name_problem` says whether one
    may be opened.

    Raises:
        ParseError: too large, not a JSON object with a weight_map of strings to strings.
    """
    if len(data) > MAX_INDEX:
        raise ParseError(f"index is {len(data)} bytes; refusing anything over {MAX_INDEX}")
    try:
        weight_map = json.loads(data.decode("utf-8"))["weight_map"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as e:
        raise ParseError(f"not a safetensors index (needs a JSON object with weight_map: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ParseError("weight_map must map tensor names to shard file names")
    return weight_map
