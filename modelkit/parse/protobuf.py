"""The protobuf wire format, walked over a buffer (bytes or an mmap) without the protobuf library.

ONNX files are one serialized ModelProto with no magic number. The scanner (operator domains,
external data) and the ONNX converter (initializers, metadata) both walk them through `fields`;
every length is checked against the bytes left in its message before anything is sliced, so a
declared length can never make a reader allocate or read past the file.

Encoding: https://protobuf.dev/programming-guides/encoding/ ; a field is `varint key` (number << 3 |
wire type) then: 0 varint | 1 eight bytes | 2 varint length, bytes | 5 four bytes (3, 4: groups).
Standard library only.
"""
from __future__ import annotations

from modelkit.errors import ParseError

VARINT, I64, LEN, I32 = 0, 1, 2, 5          # wire types
_FIXED = {I64: 8, I32: 4}
MAX_VARINT_BYTES = 10


def varint(buf, pos: int, end: int) -> tuple[int, int]:
    """(value, next position) of the varint at buf[pos:end].

    Raises:
        ParseError: the varint is truncated or longer than 10 bytes.
    """
    value = shift = 0
    for _ in range(MAX_VARINT_BYTES):
        if pos >= end:
            raise ParseError("truncated varint", offset=pos)
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ParseError("varint longer than 10 bytes", offset=pos)


def fields(buf, pos: int, end: int):
    """Yield (field number, wire type, value) for each field of the message in buf[pos:end].

    The value is the integer for varints, the data's position for fixed-width fields, and
    (start, stop) for length-delimited ones; nothing is copied.

    Raises:
        ParseError: a field number 0, a group or unknown wire type, or a field that runs past `end`.
    """
    while pos < end:
        key, pos = varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ParseError("field number 0", offset=pos)
        if wire == VARINT:
            value, pos = varint(buf, pos, end)
            yield number, wire, value
        elif wire in _FIXED:
            size = _FIXED[wire]
            if size > end - pos:
                raise ParseError(f"a fixed-width field needs {size} bytes, {end - pos} remain", offset=pos)
            yield number, wire, pos
            pos += size
        elif wire == LEN:
            length, pos = varint(buf, pos, end)
            if length > end - pos:
                raise ParseError(f"a field claims {length} bytes, {end - pos} remain", offset=pos)
            yield number, wire, (pos, pos + length)
            pos += length
        else:
            raise ParseError(f"wire type {wire} (groups or invalid)", offset=pos)


def text(buf, span: tuple[int, int], *, strict: bool = True) -> str:
    """A length-delimited field as UTF-8 text; `strict=False` replaces bad bytes instead of raising."""
    raw = bytes(buf[span[0]:span[1]])
    if not strict:
        return raw.decode("utf-8", "replace")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ParseError(f"a string field is not UTF-8 ({e.reason})", offset=span[0] + e.start) from None


def int64s(buf, wire: int, value) -> list[int]:
    """A repeated int64 field's values from one occurrence: one varint, or a packed run of them."""
    if wire == VARINT:
        values = [value]
    elif wire == LEN:
        values, pos = [], value[0]
        while pos < value[1]:
            v, pos = varint(buf, pos, value[1])
            values.append(v)
    else:
        raise ParseError(f"an int64 field with wire type {wire}")
    return [v - (1 << 64) if v >= 1 << 63 else v for v in values]


def string_pairs(buf, span: tuple[int, int]) -> tuple[str, str]:
    """A {1: key, 2: value} message (ONNX StringStringEntryProto) as (key, value); missing ones are ''."""
    entry = {n: text(buf, v) for n, w, v in fields(buf, *span) if w == LEN and n in (1, 2)}
    return entry.get(1, ""), entry.get(2, "")
