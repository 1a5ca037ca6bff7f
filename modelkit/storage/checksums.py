"""crc32c (Castagnoli) of tensor bytes, vectorized with numpy: TensorFlow's bundle entries carry one.

The pure-Python crc of modelkit.parse.tf_bundle walks a byte at a time (about 5 MB/s: fine for index
blocks). Here the data is cut into `_CHUNK`-byte rows whose registers advance together, four bytes per
numpy step (slicing-by-4 tables), and the rows' registers are then combined pairwise, level by level, also
in numpy: a crc register is linear over GF(2), so

    register(A || B) = advance(register(A), len(B) zero bytes) xor register(B)      (both from 0)

and "advance over n zero bytes" is a fixed 32x32 bit matrix, applied as four byte tables; the matrix for
2n bytes is the one for n applied twice. The initial register (all ones) is folded into the first four
bytes, which a reflected crc allows. Spec: RFC 3720 appendix B.4 (polynomial 0x1EDC6F41, reflected).
"""
from __future__ import annotations

import numpy as np

from modelkit.parse.tf_bundle import CRC32C_TABLE
from modelkit.parse.tf_bundle import crc32c as crc32c_bytes

_T0 = np.array(CRC32C_TABLE, dtype=np.uint32)
_T1 = (_T0 >> 8) ^ _T0[_T0 & 0xFF]           # the table of a byte one position further back
_T2 = (_T1 >> 8) ^ _T0[_T1 & 0xFF]
_T3 = (_T2 >> 8) ^ _T0[_T2 & 0xFF]
_CHUNK = 1024               # bytes per row; a multiple of 4
_SMALL = 1 << 15            # below this, the byte loop is as quick
_BITS = ((np.arange(256)[:, None] >> np.arange(8)) & 1).astype(bool)      # (byte value, bit)


def _apply(tables: tuple[np.ndarray, ...], regs: np.ndarray) -> np.ndarray:
    """A linear map on registers, given as four byte tables."""
    return (tables[0][regs & 0xFF] ^ tables[1][(regs >> 8) & 0xFF] ^ tables[2][(regs >> 16) & 0xFF]
            ^ tables[3][regs >> 24])


def _tables(columns: np.ndarray) -> tuple[np.ndarray, ...]:
    """The byte tables of the map whose images of the 32 unit registers are `columns`."""
    out = []
    for k in range(4):
        picked = np.where(_BITS, columns[8 * k:8 * k + 8][None, :], np.uint32(0))
        out.append(np.bitwise_xor.reduce(picked, axis=1).astype(np.uint32))
    return tuple(out)


def _advance_chunk() -> np.ndarray:
    """The images of the unit registers after _CHUNK zero bytes."""
    regs = np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32))
    for _ in range(_CHUNK // 4):
        regs = _apply((_T3, _T2, _T1, _T0), regs)
    return regs


_ADVANCE: list[np.ndarray] = []


def crc32c(data) -> int:
    """crc32c of `data` (bytes, a bytearray, a memoryview or a uint8 array), as TensorFlow's crc32c::Value."""
    array = data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if array.size < _SMALL:
        return crc32c_bytes(array.tobytes())
    rows = array.size // _CHUNK
    words = array[:rows * _CHUNK].view("<u4").reshape(rows, _CHUNK // 4)
    columns = np.ascontiguousarray(words.T)                      # (word in row, row)
    columns[0, 0] ^= np.uint32(0xFFFFFFFF)                       # the initial register, folded into the data
    regs = np.zeros(rows, dtype=np.uint32)
    for column in columns:                                       # slicing-by-4: every row, four bytes a step
        regs = _apply((_T3, _T2, _T1, _T0), regs ^ column)
    if not _ADVANCE:
        _ADVANCE.append(_advance_chunk())
    size = 1 << max(rows - 1, 0).bit_length()                    # zero rows in front change nothing (from 0)
    regs = np.concatenate((np.zeros(size - rows, dtype=np.uint32), regs))
    level = 0
    while regs.size > 1:                                         # pairwise: (A, B) -> advance(A) ^ B
        while len(_ADVANCE) <= level:
            last = _ADVANCE[-1]
            _ADVANCE.append(_apply(_tables(last), last))         # twice as many zero bytes
        regs = _apply(_tables(_ADVANCE[level]), regs[0::2]) ^ regs[1::2]
        level += 1
    reg = int(regs[0])
    table = CRC32C_TABLE
    for byte in array[rows * _CHUNK:].tobytes():
        reg = table[(reg ^ byte) & 0xFF] ^ (reg >> 8)
    return reg ^ 0xFFFFFFFF
