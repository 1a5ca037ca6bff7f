"""The .npy header: magic, version, header length, then a Python dict literal (descr, fortran_order, shape).

    '\\x93NUMPY' | u8 major | u8 minor | header length (u16 for v1, u32 for v2/v3) | header text | data

Spec: numpy/lib/format.py (NEP 1). The dict is read with ast.literal_eval (never eval), its length
checked against the file and capped first. The scanner reads .npy files and npz members through here.
Standard library only.
"""
from __future__ import annotations

import re
import struct

from modelkit.errors import ParseError

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

MAGIC = b"\x93NUMPY"
MAX_HEADER = 1 << 20
_DESCR = re.compile(r"[<>|=]?([a-zA-Z?])(\d*)(\[\w+\])?")


class Header:
    """A checked header: dtype descr, shape, element count, where the data starts, bytes per element
    (None when the descr is structured or unknown), whether the data is a pickle (object dtype) and
    whether the elements are stored in Fortran (column-major) order."""

    __slots__ = ("descr", "shape", "numel", "data_start", "itemsize", "has_object", "fortran_order")

    def __init__(self, descr: Any, shape: tuple[int, ...], numel: int, data_start: int,
                 fortran_order: bool = False) -> None:
        self.descr, self.shape, self.numel, self.data_start = descr, shape, numel, data_start
        self.itemsize = itemsize(descr)
        self.has_object = has_object(descr)
        self.fortran_order = fortran_order


def itemsize(descr: Any) -> int | None:
    """Bytes per element of a simple descr such as '<f8', '|b1', '<U5'; None for anything else."""
    if not isinstance(descr, str):
        return None
    match = _DESCR.fullmatch(descr)
    if not match:
        return None
    kind, digits = match.group(1), match.group(2)
    if kind in "?b" and not digits:
        return 1
    n = int(digits or 0)
    return 4 * n if kind == "U" else n or None


def has_object(descr: Any) -> bool:
    """The descr holds Python objects anywhere (then the data is a pickle)."""
    if isinstance(descr, str):
        return descr.lstrip("<>|=").startswith("O")
    if isinstance(descr, (list, tuple)):
        return any(has_object(part) for part in descr)
    return False


def read_header(buf, start: int = 0, end: int | None = None) -> Header:
    """The header of the .npy data at buf[start:end].

    Raises:
        ParseError: truncated, no magic, an unknown version, a length that does not fit, or not a
            dict literal with a descr, a shape of non-negative integers and (if present) a boolean
            fortran_order.
    """
    end = len(buf) if end is None else end
    if end - start < 10:
        raise ParseError("truncated .npy header", offset=0)
    if bytes(buf[start:start + len(MAGIC)]) != MAGIC:
        raise ParseError("not a .npy array (no \\x93NUMPY magic)", offset=0)
    major = buf[start + 6]
    if major == 1:
        length, text_start = struct.unpack_from("<H", buf, start + 8)[0], start + 10
    elif major in (2, 3):
        if end - start < 12:
            raise ParseError("truncated .npy header", offset=0)
        length, text_start = struct.unpack_from("<I", buf, start + 8)[0], start + 12
    else:
        raise ParseError(f"unknown .npy version {major}", offset=6)
    if length > MAX_HEADER or length > end - text_start:
        raise ParseError(f"header length {length} does not fit the file", offset=8)
    import ast  # here: only .npy files need it (start-up time of `modelkit scan`)

    try:
        header = ast.literal_eval(bytes(buf[text_start:text_start + length]).decode("latin-1"))
        descr, shape = header["descr"], tuple(header["shape"])
        fortran_order = header.get("fortran_order", False)
        if not isinstance(fortran_order, bool):
            raise ValueError(f"fortran_order is {fortran_order!r}, not True or False")
        numel = 1
        for dim in shape:
            if not isinstance(dim, int) or dim < 0:
                raise ValueError(f"bad dimension {dim!r}")
            numel *= dim
    except (ValueError, SyntaxError, TypeError, KeyError, MemoryError, RecursionError) as e:
        raise ParseError(f"header is not a valid dict literal ({e})", offset=text_start - start) from None
    return Header(descr, shape, numel, text_start + length, fortran_order)
