"""Pickle opcodes and their arguments, decoded from a buffer with every length checked first.

The opcode table is pickletools' (a literal copy: importing pickletools, and pickle, is a twentieth of
`modelkit scan`'s start-up; tests/test_parse.py checks that it matches exactly). Each argument reader
takes (buf, pos, end) and returns (value, next position); a length field is checked against what is
left before anything is read, and long byte or text arguments (tensor data in plain pickles) come
back as `Blob(size)`, never copied. modelkit.parse.pickle runs the stack machine over them.
Standard library only.
"""
from __future__ import annotations

import codecs
import struct

from modelkit.errors import ParseError

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

# Every opcode of pickle protocols 0-5 by argument kind: {kind: "code:NAME ..."}; kinds are pickletools'
# ArgumentDescriptor names (None: no argument). A literal table, not `pickletools.opcodes`: that import
# (and pickle's) is a twentieth of `modelkit scan`'s start-up. tests/test_scan_opcodes.py checks that
# it matches pickletools exactly.
_OPCODES_BY_ARGUMENT: dict[str | None, str] = {
    None: ("\x97:NEXT_BUFFER \x98:READONLY_BUFFER N:NONE \x88:NEWTRUE \x89:NEWFALSE ]:EMPTY_LIST a:APPEND e:APPENDS "
           "l:LIST ):EMPTY_TUPLE t:TUPLE \x85:TUPLE1 \x86:TUPLE2 \x87:TUPLE3 }:EMPTY_DICT d:DICT s:SETITEM u:SETITEMS "
           "\x8f:EMPTY_SET \x90:ADDITEMS \x91:FROZENSET 0:POP 2:DUP (:MARK 1:POP_MARK \x94:MEMOIZE \x93:STACK_GLOBAL "
           "R:REDUCE b:BUILD o:OBJ \x81:NEWOBJ \x92:NEWOBJ_EX .:STOP Q:BINPERSID"),
    "decimalnl_short": "I:INT g:GET p:PUT",
    "decimalnl_long": "L:LONG",
    "int4": "J:BININT \x84:EXT4",
    "uint1": "K:BININT1 h:BINGET q:BINPUT \x82:EXT1 \x80:PROTO",
    "uint2": "M:BININT2 \x83:EXT2",
    "uint4": "j:LONG_BINGET r:LONG_BINPUT",
    "uint8": "\x95:FRAME",
    "long1": "\x8a:LONG1",
    "long4": "\x8b:LONG4",
    "stringnl": "S:STRING",
    "string1": "U:SHORT_BINSTRING",
    "string4": "T:BINSTRING",
    "bytes1": "C:SHORT_BINBYTES",
    "bytes4": "B:BINBYTES",
    "bytes8": "\x8e:BINBYTES8",
    "bytearray8": "\x96:BYTEARRAY8",
    "unicodestringnl": "V:UNICODE",
    "unicodestring1": "\x8c:SHORT_BINUNICODE",
    "unicodestring4": "X:BINUNICODE",
    "unicodestring8": "\x8d:BINUNICODE8",
    "floatnl": "F:FLOAT",
    "float8": "G:BINFLOAT",
    "stringnl_noescape": "P:PERSID",
    "stringnl_noescape_pair": "c:GLOBAL i:INST",
}
# byte -> (opcode name, argument kind or None)
_OPS: dict[int, tuple[str, str | None]] = {
    ord(entry[0]): (entry[2:], kind) for kind, entries in _OPCODES_BY_ARGUMENT.items() for entry in entries.split(" ")
}
MAX_PROTOCOL = 5
_SMALL = 4096          # byte/str arguments larger than this are not copied (no module name is that long)
_MAX_LINE = 1 << 16    # text-mode arguments (protocol 0) end within this many bytes
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C   # torch/serialization.py MAGIC_NUMBER: legacy torch.save's first pickle


class PickleError(ParseError):
    """The opcode stream is malformed: an unpickler would run every opcode before this one."""


class Blob:
    """A byte or text argument too long to copy (tensor data in plain pickles): its size, and where
    it lies in the buffer and how it decodes ("str", "latin1", "bytes", "long"), for a reader that
    needs the value after all (modelkit.parse.torch_format: long metadata strings)."""

    __slots__ = ("size", "offset", "kind")

    def __init__(self, size: int, offset: int | None = None, kind: str = "bytes") -> None:
        self.size, self.offset, self.kind = size, offset, kind

    def __eq__(self, other: object) -> bool:
        return type(other) is Blob and other.size == self.size

    def __hash__(self) -> int:
        return hash(("Blob", self.size))

    def __repr__(self) -> str:
        return f"Blob({self.size})"


# ---------------------------------------------------------------------------------------------
# Argument decoding: each reader takes (buf, pos, end) and returns (value, new_pos).

def _need(pos: int, n: int, end: int) -> None:
    if n < 0 or pos + n > end:
        raise PickleError(f"argument of {n} bytes runs past the end of the data", offset=pos)


def _fixed(fmt: str):
    unpack_from, size = struct.Struct(fmt).unpack_from, struct.calcsize(fmt)

    def read(buf, pos, end):
        if pos + size > end:                    # _need, inlined: this runs for most opcodes
            raise PickleError(f"argument of {size} bytes runs past the end of the data", offset=pos)
        return unpack_from(buf, pos)[0], pos + size
    return read


def _line(buf, pos, end) -> tuple[bytes, int]:
    nl = buf.find(b"\n", pos, min(end, pos + _MAX_LINE))
    if nl < 0:
        raise PickleError("text argument without a newline", offset=pos)
    return bytes(buf[pos:nl]), nl + 1


def _counted(size_fmt: str, kind: str):
    size_reader = _fixed(size_fmt)

    def read(buf, pos, end):
        n, pos = size_reader(buf, pos, end)
        _need(pos, n, end)
        if n > _SMALL:
            return Blob(n, pos, kind), pos + n
        raw = bytes(buf[pos:pos + n])
        if kind == "str":
            try:
                return raw.decode("utf-8", "surrogatepass"), pos + n
            except UnicodeDecodeError as e:
                raise PickleError("invalid UTF-8 in a string argument", offset=pos) from e
        if kind == "latin1":   # py2 str: the unpickler decodes it to str (encoding='ASCII'/'latin1')
            return raw.decode("latin-1"), pos + n
        if kind == "long":
            return int.from_bytes(raw, "little", signed=True), pos + n
        return raw, pos + n
    return read


def _stringnl(buf, pos, end):
    raw, pos = _line(buf, pos, end)
    if len(raw) < 2 or raw[:1] != raw[-1:] or raw[:1] not in (b"'", b'"'):
        raise PickleError("STRING argument is not quoted", offset=pos)
    try:
        return codecs.escape_decode(raw[1:-1])[0].decode("latin-1"), pos
    except ValueError as e:
        raise PickleError("bad escape in STRING argument", offset=pos) from e


def _noescape(buf, pos, end):
    raw, pos = _line(buf, pos, end)
    try:
        return raw.decode("utf-8"), pos
    except UnicodeDecodeError as e:
        raise PickleError("invalid UTF-8 in a GLOBAL/INST line", offset=pos) from e


def _noescape_pair(buf, pos, end):
    first, pos = _noescape(buf, pos, end)
    second, pos = _noescape(buf, pos, end)
    return (first, second), pos


def _unicodenl(buf, pos, end):
    raw, pos = _line(buf, pos, end)
    try:
        return raw.decode("raw-unicode-escape"), pos
    except UnicodeDecodeError as e:
        raise PickleError("bad escape in UNICODE argument", offset=pos) from e


def _decimal(buf, pos, end):
    raw, pos = _line(buf, pos, end)
    text = raw.rstrip(b"L")
    if raw in (b"00", b"01"):
        return raw == b"01", pos
    try:
        return (int(text) if len(text) < 4300 else Blob(len(text))), pos
    except ValueError as e:
        raise PickleError(f"bad integer literal {raw[:20]!r}", offset=pos) from e


def _floatnl(buf, pos, end):
    raw, pos = _line(buf, pos, end)
    try:
        return float(raw), pos
    except ValueError as e:
        raise PickleError(f"bad float literal {raw[:20]!r}", offset=pos) from e


def _long4(buf, pos, end):
    n, pos = _fixed("<i")(buf, pos, end)
    _need(pos, n, end)
    if n > _SMALL:
        return Blob(n), pos + n
    return int.from_bytes(bytes(buf[pos:pos + n]), "little", signed=True), pos + n


_READERS = {
    "uint1": _fixed("<B"), "uint2": _fixed("<H"), "uint4": _fixed("<I"), "uint8": _fixed("<Q"),
    "int4": _fixed("<i"), "float8": _fixed(">d"),
    "long1": _counted("<B", "long"), "long4": _long4,
    "string1": _counted("<B", "latin1"), "string4": _counted("<i", "latin1"),
    "bytes1": _counted("<B", "bytes"), "bytes4": _counted("<I", "bytes"), "bytes8": _counted("<Q", "bytes"),
    "bytearray8": _counted("<Q", "bytes"),
    "unicodestring1": _counted("<B", "str"), "unicodestring4": _counted("<I", "str"),
    "unicodestring8": _counted("<Q", "str"),
    "stringnl": _stringnl, "stringnl_noescape": _noescape, "stringnl_noescape_pair": _noescape_pair,
    "unicodestringnl": _unicodenl, "decimalnl_short": _decimal, "decimalnl_long": _decimal, "floatnl": _floatnl,
}


# byte -> (opcode name, argument reader or None); None for bytes that are not opcodes
_TABLE: list[tuple[str, Any] | None] = [
    None if code not in _OPS else (_OPS[code][0], None if _OPS[code][1] is None else _READERS[_OPS[code][1]])
    for code in range(256)
]



def looks_like_pickle(head: bytes) -> bool:
    """A protocol 2-5 header (PROTO n); protocols 0 and 1 have no header and are tried by walking."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= MAX_PROTOCOL
