"""Where the stored records of a torch zip checkpoint lie, and filling in ones written with `skip_data`.

`records` is how the pt converter finds each record's bytes in the file (for file-to-file copies
out of a .pt, and for the records it fills in).

torch.save under skip_data writes the whole archive (pickle, metadata records, every storage's
local header and reserved space) but not the storage bytes, and leaves their CRC-32s 0. The pt
writer then copies each storage's bytes into its record file to file (modelkit.storage.mapped.copy_span)
and patches the CRC-32 where torch's archives keep it: the data descriptor after the record
(torch writes every record with general-purpose flag bit 3) and the central directory entry.
The local header's CRC field stays 0, as torch.save leaves it in every archive.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from modelkit.errors import FormatError, ParseError
from modelkit.parse import zipdir

_DESCRIPTOR = b"PK\x07\x08"


@dataclass(frozen=True)
class Record:
    """One stored zip member: where its data starts and where its CRC-32 fields are."""

    name: str
    data_offset: int
    nbytes: int
    descriptor_crc: int | None   # file offset of the CRC-32 in the data descriptor (None: no descriptor)
    directory_crc: int           # file offset of the CRC-32 in the central directory entry


def records(path: Path) -> dict[int, Record]:
    """Every stored (uncompressed) member with its local header where the directory says, by data offset.

    Raises:
        FormatError: the zip directory cannot be read.
        OSError, ValueError: the file cannot be opened or mapped (an empty file).
    """
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            entries = zipdir.read_directory(buf)
        except ParseError as e:
            raise FormatError(path, f"the zip directory cannot be read ({e})") from e
        found: dict[int, Record] = {}
        for entry in entries:
            if entry.compress_type != zipdir.STORED:
                continue                     # not a record whose bytes lie in the file as they are
            try:
                data = zipdir.member_data(buf, entry)    # its local header agrees with the directory
            except ParseError:
                continue
            end = data + entry.compress_size
            descriptor = end + 4 if entry.flag_bits & 0x8 and buf[end:end + 4] == _DESCRIPTOR else None
            found[data] = Record(entry.filename, data, entry.file_size, descriptor, entry.directory_offset + 16)
    return found


def patch_crcs(path: Path, crcs: dict[Record, int]) -> None:
    """Write each record's CRC-32 into its data descriptor and central directory entry."""
    with path.open("r+b") as f:
        for record, crc in crcs.items():
            value = struct.pack("<I", crc & 0xFFFFFFFF)
            if record.descriptor_crc is not None:
                f.seek(record.descriptor_crc)
                f.write(value)
            f.seek(record.directory_crc)
            f.write(value)
