"""crc32c (Castagnoli) of tensor bytes, vectorized with numpy: TensorFlow's bundle entries carry one.

The pure-Python crc of modelkit.parse.tf_bundle walks a byte at a time (fine for index blocks, about
10 MB/s). Here the data is cut into `_CHUNK`-byte rows whose crc registers advance together, one numpy
step per byte column, and are then combined in order: a crc register is linear over GF(2), so the
register after a chunk is (the register before it, advanced over `_CHUNK` zero bytes) xor (the chunk's
register from zero). The advance over zeros is a fixed 32x32 bit matrix, applied as four byte tables.
"""
from __future__ import annotations

import numpy as np

from modelkit.parse.tf_bundle import CRC32C_TABLE
from modelkit.parse.tf_bundle import crc32c as crc32c_bytes

_TABLE = np.array(CRC32C_TABLE, dtype=np.uint32)
_CHUNK = 4096
_SMALL = 1 << 16            # below this, the byte loop is quicker than setting up the columns
_ADVANCE: list[list[int]] | None = None


def _advance_tables() -> list[list[int]]:
    """Four 256-entry tables: the register advanced over _CHUNK zero bytes, for each byte of its value."""
    global _ADVANCE
    if _ADVANCE is None:
        regs = np.array([1 << bit for bit in range(32)], dtype=np.uint32)
        for _ in range(_CHUNK):
            regs = _TABLE[regs & 0xFF] ^ (regs >> 8)
        columns = regs.tolist()
        tables = []
        for k in range(4):
            table = []
            for value in range(256):
                out = 0
                for i in range(8):
                    if value >> i & 1:
                        out ^= columns[8 * k + i]
                table.append(out)
            tables.append(table)
        _ADVANCE = tables
    return _ADVANCE


def crc32c(data) -> int:
    """crc32c of `data` (bytes, a memoryview or a uint8 array), as TensorFlow's crc32c::Value."""
    array = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    if array.size < _SMALL:
        return crc32c_bytes(array.tobytes())
    rows = array.size // _CHUNK
    columns = np.ascontiguousarray(array[:rows * _CHUNK].reshape(rows, _CHUNK).T)   # (chunk byte, row)
    regs = np.zeros(rows, dtype=np.uint32)
    for column in columns:
        regs = _TABLE[(regs ^ column) & 0xFF] ^ (regs >> 8)
    t0, t1, t2, t3 = _advance_tables()
    reg = 0xFFFFFFFF
    for chunk in regs.tolist():
        reg = t0[reg & 0xFF] ^ t1[reg >> 8 & 0xFF] ^ t2[reg >> 16 & 0xFF] ^ t3[reg >> 24] ^ chunk
    table = CRC32C_TABLE
    for byte in array[rows * _CHUNK:].tobytes():
        reg = table[(reg ^ byte) & 0xFF] ^ (reg >> 8)
    return reg ^ 0xFFFFFFFF
