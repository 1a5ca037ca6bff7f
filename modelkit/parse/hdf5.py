"""HDF5 facts read from a file's first bytes: the signature and the superblock's size fields.

modelkit reads HDF5 contents through h5py (the format's own library); what it needs before that is
whether a file is HDF5 at all, for the scanner's dispatch and the converter's `detect`.
Spec: https://docs.hdfgroup.org/hdf5/develop/_f_m_t3.html (superblock, "Format Signature"). Standard library only.

    superblock v0/v1: signature | version | 4 version bytes | sizeof(offsets) @13 | sizeof(lengths) @14 | ...
    superblock v2/v3: signature | version | sizeof(offsets) @9 | sizeof(lengths) @10 | flags | addresses | checksum
"""
from __future__ import annotations

SIGNATURE = b"\x89HDF\r\n\x1a\n"     # at offset 0 in files h5py and Keras write (or after a user block)
SUPERBLOCK_HEAD = 16
_SIZES = (2, 4, 8, 16)                # sizeof(offsets), sizeof(lengths): what the spec allows


def is_signature(head: bytes) -> bool:
    """The bytes start with the HDF5 format signature."""
    return head[:len(SIGNATURE)] == SIGNATURE


def plausible_superblock(head: bytes) -> bool:
    """The first 16 bytes hold the signature and a superblock with a known version and allowed size fields."""
    if len(head) < SUPERBLOCK_HEAD or not is_signature(head):
        return False
    version = head[8]
    sizes = (head[13], head[14]) if version in (0, 1) else (head[9], head[10]) if version in (2, 3) else (0, 0)
    return all(size in _SIZES for size in sizes)
