"""The scanner's own zip directory reader reads archives as Python's zipfile does, and fails only with its own errors."""
from __future__ import annotations

import io
import zipfile

import pytest

from modelkit.parse import zipdir


def _archive(*, compression=zipfile.ZIP_STORED, comment=b"", force_zip64=False, names=("a/data.pkl", "a/data/0")):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compression) as archive:
        for i, name in enumerate(names):
            with archive.open(name, "w", force_zip64=force_zip64) as member:
                member.write(bytes(range(i, i + 100)) * 3)
        archive.comment = comment
    return buffer.getvalue()


def _zip64_end_record() -> bytes:
    """An archive with a zip64 end record and locator (zipfile writes them past 65,535 entries; lowered here)."""
    limit = zipfile.ZIP_FILECOUNT_LIMIT
    zipfile.ZIP_FILECOUNT_LIMIT = 1
    try:
        data = _archive()
    finally:
        zipfile.ZIP_FILECOUNT_LIMIT = limit
    assert b"PK\x06\x06" in data and b"PK\x06\x07" in data
    return data


ARCHIVES = {
    "stored": _archive(),
    "deflated": _archive(compression=zipfile.ZIP_DEFLATED),
    "comment": _archive(comment=b"x" * 1000 + b"PK"),
    "zip64 entries": _archive(force_zip64=True),
    "zip64 end record": _zip64_end_record(),
    "utf-8 names": _archive(names=("modèle/data.pkl", "данные/0")),
    "prepended data": b"#!/bin/sh\necho self-extractor\n" + _archive(),
}


def _entries_of(data: bytes) -> list[tuple]:
    return [(i.filename, i.flag_bits, i.compress_type, i.compress_size, i.file_size, i.header_offset, i.external_attr)
            for i in zipdir.read_directory(data)]


@pytest.mark.parametrize("name", sorted(ARCHIVES))
def test_reads_what_zipfile_reads(name):
    data = ARCHIVES[name]
    expected = [(i.filename, i.flag_bits, i.compress_type, i.compress_size, i.file_size, i.header_offset,
                 i.external_attr) for i in zipfile.ZipFile(io.BytesIO(data)).infolist()]
    assert _entries_of(data) == expected
    assert zipdir.has_directory(data) and zipfile.is_zipfile(io.BytesIO(data))


def test_max_entries_stops_early():
    data = _archive(names=[f"m{i}" for i in range(10)])
    assert len(zipdir.read_directory(data, max_entries=3)) == 4       # one past the limit: the caller reports it


@pytest.mark.parametrize("data", [b"", b"PK\x05\x06", b"not a zip at all" * 10, ARCHIVES["stored"][:-30]])
def test_not_an_archive(data):
    with pytest.raises(zipdir.ZipDirectoryError):
        zipdir.read_directory(data)
