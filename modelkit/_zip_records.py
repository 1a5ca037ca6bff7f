"""Filling in the data records of a torch zip checkpoint written with `torch.serialization.skip_data`.

torch.save under skip_data writes the whole archive (pickle, metadata records, every storage's
local header and reserved space) but not the storage bytes, and leaves their CRC-32s 0. The pt
writer then copies each storage's bytes into its record file to file (modelkit._mapped.copy_span)
and patches the CRC-32 where torch's archives keep it: the data descriptor after the record
(torch writes every record with general-purpose flag bit 3) and the central directory entry.
The local header's CRC field stays 0, as torch.save leaves it in every archive.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from modelkit.errors import FormatError
from modelkit.scan import zipdir

_DESCRIPTOR = b"PK\x07\x08"


@dataclass(frozen=True)
class Record:
    """One stored zip member: where its data starts and where its two CRC-32 fields are."""

    name: str
    data_offset: int
    nbytes: int
    descriptor_crc: int          # file offset of the CRC-32 in the data descriptor
    directory_crc: int           # file offset of the CRC-32 in the central directory entry


def records(path: Path) -> dict[int, Record]:
    """Every stored member laid out as torch.save lays them out (flag bit 3, a data descriptor), by data offset."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            entries = zipdir.read_directory(buf)
        except ValueError as e:
            raise FormatError(path, f"torch.save wrote an archive modelkit cannot read back ({e})") from e
        found: dict[int, Record] = {}
        for entry in entries:
            at = entry.header_offset
            if entry.compress_type != zipdir.STORED or not entry.flag_bits & 0x8 or buf[at:at + 4] != b"PK\x03\x04":
                continue                     # not a record we could fill (the caller checks it has them all)
            name_len, extra_len = struct.unpack_from("<HH", buf, at + 26)
            data = at + 30 + name_len + extra_len
            end = data + entry.compress_size
            if buf[end:end + 4] == _DESCRIPTOR:
                found[data] = Record(entry.filename, data, entry.file_size, end + 4, entry.directory_offset + 16)
    return found


def patch_crcs(path: Path, crcs: dict[Record, int]) -> None:
    """Write each record's CRC-32 into its data descriptor and central directory entry."""
    with path.open("r+b") as f:
        for record, crc in crcs.items():
            value = struct.pack("<I", crc & 0xFFFFFFFF)
            f.seek(record.descriptor_crc)
            f.write(value)
            f.seek(record.directory_crc)
            f.write(value)
