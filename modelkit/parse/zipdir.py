"""A zip archive's central directory, read from a buffer (bytes or an mmap) without the zipfile module.

The scanner needs only the directory (names, sizes, flags, where each local header is) and reads
members itself, so it parses the directory here, every offset checked against the buffer first.
It reads archives as Python's zipfile does (the last end-of-central-directory record within the final
64 KiB, the zip64 record just before its locator, an offset shift when data was prepended), so a
name the scanner sees is the name a loader sees. Importing zipfile would cost a tenth of
`modelkit scan`'s start-up (it pulls in shutil, threading, bz2 and lzma).

Layouts: APPNOTE.TXT sections 4.3.12 (central directory header), 4.3.14-4.3.16 (zip64 and end records).
"""
from __future__ import annotations

import os
import struct

from modelkit.errors import ParseError

STORED, DEFLATED, BZIP2, LZMA = 0, 8, 12, 14     # compression methods (APPNOTE 4.4.5)

_END = b"PK\x05\x06"
_END64 = b"PK\x06\x06"
_LOCATOR64 = b"PK\x06\x07"
_CENTRAL = b"PK\x01\x02"
_LOCAL, _LOCAL_SIZE = b"PK\x03\x04", 30
_END_SIZE, _END64_SIZE, _LOCATOR64_SIZE, _CENTRAL_SIZE = 22, 56, 20, 46
_MAX_COMMENT = 0xFFFF
_ZIP64_EXTRA = 0x0001


class ZipDirectoryError(ParseError):
    """The archive's directory cannot be read: no end record, or a record or entry that does not fit."""


class ZipEntry:
    """One central directory entry, with zipfile.ZipInfo's attribute names for what the scanner uses."""

    __slots__ = ("filename", "flag_bits", "compress_type", "compress_size", "file_size", "header_offset",
                 "external_attr", "raw_name", "directory_offset", "CRC")

    def __init__(self, raw_name: bytes, flag_bits: int, compress_type: int, compress_size: int, file_size: int,
                 header_offset: int, external_attr: int, directory_offset: int = -1, crc: int = 0) -> None:
        self.raw_name = raw_name                       # the name's bytes, as the local header must repeat them
        self.filename = raw_name.decode("utf-8" if flag_bits & 0x800 else "cp437")
        self.flag_bits = flag_bits
        self.compress_type = compress_type
        self.compress_size = compress_size
        self.file_size = file_size
        self.header_offset = header_offset
        self.external_attr = external_attr
        self.directory_offset = directory_offset       # where this entry's central directory header is
        self.CRC = crc                                 # CRC-32 of the uncompressed data (zipfile's name)

    def __repr__(self) -> str:
        return f"ZipEntry({self.filename!r}, method={self.compress_type}, size={self.file_size})"


def _end_record(buf, end: int) -> int | None:
    """Offset of the end-of-central-directory record: right at the end, else the last one in the final 64 KiB."""
    if end >= _END_SIZE and buf[end - _END_SIZE:end - _END_SIZE + 4] == _END:
        return end - _END_SIZE
    low = max(0, end - _END_SIZE - _MAX_COMMENT)
    found = bytes(buf[low:end]).rfind(_END)
    if found < 0 or low + found + _END_SIZE > end:
        return None
    return low + found


def has_directory(buf, end: int | None = None) -> bool:
    """True when the buffer ends like a zip archive (what zipfile.is_zipfile checks)."""
    return _end_record(buf, len(buf) if end is None else end) is not None


def read_directory(buf, end: int | None = None, *, max_entries: int = 1 << 20) -> list[ZipEntry]:
    """The central directory of the archive in buf[0:end], at most `max_entries + 1` entries.

    Header offsets are returned relative to buf[0] (shifted like zipfile's when bytes were prepended).

    Raises:
        ZipDirectoryError: anything that does not fit or is not where the records say, or a name
            flagged UTF-8 that is not.
    """
    end = len(buf) if end is None else end
    at = _end_record(buf, end)
    if at is None:
        raise ZipDirectoryError("no end-of-central-directory record: not a zip archive, or truncated")
    disk, cd_disk, _, count, cd_size, cd_offset = struct.unpack_from("<HHHHII", buf, at + 4)
    location = at
    locator = at - _LOCATOR64_SIZE
    if locator >= 0 and buf[locator:locator + 4] == _LOCATOR64:
        disk64, _, disks = struct.unpack_from("<IQI", buf, locator + 4)
        if disk64 != 0 or disks > 1:
            raise ZipDirectoryError("archives that span several disks are not supported")
        record = locator - _END64_SIZE
        if record < 0 or buf[record:record + 4] != _END64:
            raise ZipDirectoryError("zip64 locator without a zip64 end record before it")
        disk, cd_disk, _, count, cd_size, cd_offset = struct.unpack_from("<IIQQQQ", buf, record + 16)
        location = record
    if disk != 0 or cd_disk != 0:
        raise ZipDirectoryError("archives that span several disks are not supported")
    shift = location - cd_size - cd_offset           # bytes prepended to the archive (self-extractors)
    start = cd_offset + shift
    if shift < 0 or start < 0 or start + cd_size > end:
        raise ZipDirectoryError(f"the central directory ({cd_size} bytes at {cd_offset}) is not inside the file")
    entries: list[ZipEntry] = []
    pos, stop = start, start + cd_size
    while pos < stop:
        if len(entries) > max_entries:
            break
        if pos + _CENTRAL_SIZE > stop or buf[pos:pos + 4] != _CENTRAL:
            raise ZipDirectoryError("no central directory entry where the directory says", offset=pos)
        (flags, method, crc, csize, usize, name_len, extra_len, comment_len, attr,
         offset) = struct.unpack_from("<8xHH4xIIIHHH4xII", buf, pos)
        names_end = pos + _CENTRAL_SIZE + name_len
        if names_end + extra_len + comment_len > stop:
            raise ZipDirectoryError("a central directory entry runs past the directory", offset=pos)
        extra = bytes(buf[names_end:names_end + extra_len])
        usize, csize, offset = _zip64_sizes(extra, usize, csize, offset)
        try:
            entries.append(ZipEntry(bytes(buf[pos + _CENTRAL_SIZE:names_end]), flags, method, csize, usize,
                                    offset + shift, attr, pos, crc))
        except UnicodeDecodeError as e:
            raise ZipDirectoryError(f"a member name flagged UTF-8 is not ({e.reason})", offset=pos) from None
        pos = names_end + extra_len + comment_len
    return entries


def member_data(buf, entry: ZipEntry, end: int | None = None) -> int:
    """Where a member's data starts in buf, after checking its local header against the directory.

    The local header must be where the directory points and repeat the member's name, and the
    member's compressed bytes must fit before `end`: otherwise a loader reading local headers (as
    torch does) would see other content than a reader of the directory.

    Raises:
        ZipDirectoryError: what does not match, in words.
    """
    end = len(buf) if end is None else end
    off = entry.header_offset
    if off < 0 or off + _LOCAL_SIZE > end or bytes(buf[off:off + 4]) != _LOCAL:
        raise ZipDirectoryError("no local header where the central directory points", offset=off)
    nlen, xlen = struct.unpack_from("<HH", buf, off + 26)
    local_name = bytes(buf[off + _LOCAL_SIZE:off + _LOCAL_SIZE + nlen])
    if local_name != entry.raw_name:
        raise ZipDirectoryError(f"local header names {local_name[:60]!r}, the central directory "
                                f"{entry.filename[:60]!r}", offset=off)
    data = off + _LOCAL_SIZE + nlen + xlen
    if entry.compress_size > end - data:
        raise ZipDirectoryError("member data runs past the end of the archive", offset=data)
    return data


_IN_CHUNK = 1 << 20          # compressed bytes handed to zlib at a time
_OUT_CHUNK = 16 << 20        # decompressed bytes asked of zlib at a time (the most held beyond `out`)
MAX_DEFLATE_RATIO = 1032     # deflate's largest possible expansion (258-byte matches in 2-bit codes), rounded up


def _readable(entry: ZipEntry) -> None:
    if entry.flag_bits & 0x1:
        raise ZipDirectoryError(f"{entry.filename} is encrypted")
    if entry.compress_type not in (STORED, DEFLATED):
        raise ZipDirectoryError(f"{entry.filename} uses compression method {entry.compress_type}; only stored and "
                                "deflated members are read")
    if entry.compress_type == STORED and entry.compress_size != entry.file_size:
        raise ZipDirectoryError(f"{entry.filename} is stored uncompressed but the directory gives it two sizes "
                                f"({entry.compress_size} and {entry.file_size})")
    if entry.compress_type == DEFLATED and entry.file_size > MAX_DEFLATE_RATIO * entry.compress_size + 1024:
        raise ZipDirectoryError(f"{entry.filename} claims to expand {entry.compress_size} compressed bytes to "
                                f"{entry.file_size}, more than deflate can (a decompression bomb or a lying directory)")


def _inflate(buf, entry: ZipEntry, start: int, size: int, sink) -> int:
    """Decompress the first `size` bytes of a deflated member, handing each piece to `sink`; returns how
    many bytes came out. Never more than `entry.file_size` in all: one byte past it is an error, so a
    member that expands beyond its declared size is found without decompressing the rest."""
    import zlib

    limit = size + 1 if size >= entry.file_size else size      # the byte after the member's size tells
    d = zlib.decompressobj(-15)
    done = 0

    def take(piece: bytes) -> None:
        nonlocal done
        if done + len(piece) > entry.file_size:
            raise ZipDirectoryError(f"{entry.filename} expands past its declared size {entry.file_size} "
                                    "(a decompression bomb or a lying directory)")
        sink(piece)
        done += len(piece)

    try:
        with memoryview(buf) as whole:
            for at in range(start, start + entry.compress_size, _IN_CHUNK):
                with whole[at:min(at + _IN_CHUNK, start + entry.compress_size)] as chunk:
                    pending: bytes | memoryview = chunk
                    while pending and done < limit and not d.eof:
                        take(d.decompress(pending, min(_OUT_CHUNK, limit - done)))
                        pending = d.unconsumed_tail
                if done >= limit or d.eof:
                    return done
        while not d.eof and done < limit:        # output zlib held back when a piece filled up
            piece = d.decompress(b"", min(_OUT_CHUNK, limit - done))
            if not piece:
                break
            take(piece)
    except zlib.error as e:
        raise ZipDirectoryError(f"{entry.filename} has corrupt deflate data ({e})") from None
    return done


def read_start(buf, entry: ZipEntry, size: int) -> bytes:
    """The first `size` bytes of a stored or deflated member (fewer if the member is shorter), without
    decompressing the rest: how a header at the start of a member is read. Not checked against the CRC-32.

    Raises:
        ZipDirectoryError: encrypted, an unsupported method, a local header that disagrees, corrupt data.
    """
    _readable(entry)
    start = member_data(buf, entry)
    size = min(size, entry.file_size)
    if entry.compress_type == STORED:
        return bytes(buf[start:start + size])
    pieces: list[bytes] = []
    _inflate(buf, entry, start, size, pieces.append)
    return b"".join(pieces)


def read_into(buf, entry: ZipEntry, out) -> None:
    """Read a whole stored or deflated member into `out`, a writable buffer of exactly its size, and check
    its CRC-32. A deflated member is decompressed a piece at a time straight into `out`, so nothing
    beyond `out` and one piece is held, and never more than the directory's size is produced.

    Raises:
        ZipDirectoryError: as read_start, plus data that expands past or ends before the size the
            directory gives, or a CRC-32 that does not match.
        ValueError: `out` is not the member's size.
    """
    import zlib

    _readable(entry)
    start = member_data(buf, entry)
    crc = 0
    with memoryview(out) as raw, raw.cast("B") as view:
        if len(view) != entry.file_size:
            raise ValueError(f"a buffer of {len(view)} bytes for a member of {entry.file_size}")
        if entry.compress_type == STORED:
            with memoryview(buf) as whole, whole[start:start + entry.file_size] as data:
                view[:] = data
            done, crc = entry.file_size, zlib.crc32(view)
        else:
            pos = 0

            def sink(piece: bytes) -> None:
                nonlocal crc, pos
                view[pos:pos + len(piece)] = piece
                crc = zlib.crc32(piece, crc)
                pos += len(piece)

            done = _inflate(buf, entry, start, entry.file_size, sink)
    if done != entry.file_size:
        raise ZipDirectoryError(f"{entry.filename} ends after {done} of the {entry.file_size} bytes the directory "
                                "gives it (truncated or corrupt)")
    if crc != entry.CRC:
        raise ZipDirectoryError(f"{entry.filename} does not match its CRC-32 in the directory (the file is corrupt)")


def _zip64_sizes(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    """Sizes and offset from the zip64 extra field, for those the entry marks 0xFFFFFFFF (APPNOTE 4.5.3)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + size > len(extra):
            raise ZipDirectoryError("extra field runs past its entry")
        if tag == _ZIP64_EXTRA:
            values = extra[pos + 4:pos + 4 + size]
            fields = [usize, csize, offset]
            at = 0
            for i, value in enumerate(fields):
                if value == 0xFFFFFFFF:
                    if at + 8 > len(values):
                        raise ZipDirectoryError("zip64 extra field is too short for the sizes it replaces")
                    fields[i] = struct.unpack_from("<Q", values, at)[0]
                    at += 8
            return fields[0], fields[1], fields[2]
        pos += 4 + size
    return usize, csize, offset


def member_names(path) -> list[str]:
    """The member names of the zip archive at `path` (str or os.PathLike), read from its directory only.

    Raises:
        ZipDirectoryError: not a readable zip archive (OSError for a file that cannot be opened).
    """
    import mmap  # here: only converters' detect needs it

    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            raise ZipDirectoryError("empty file: not a zip archive")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return [entry.filename for entry in read_directory(buf)]


class Archive:
    """A zip archive's members by name, read through its central directory (of duplicate names, the last,
    as zipfile picks). Members are read on demand, decompressed with a bound and checked against their
    CRC-32; only stored and deflated members are read (what torch and Keras write).

    Args:
        path: The archive (str or os.PathLike).

    Raises:
        ZipDirectoryError: the directory cannot be read (OSError: the file cannot be opened).
    """

    def __init__(self, path) -> None:
        import mmap  # here: the scanner maps files itself and never builds an Archive

        self.path = path
        with open(path, "rb") as f:
            if not os.fstat(f.fileno()).st_size:
                raise ZipDirectoryError("empty file: not a zip archive")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                self.entries = {entry.filename: entry for entry in read_directory(buf)}

    def read(self, name: str, limit: int | None = None) -> bytes:
        """The member's bytes.

        Raises:
            KeyError: no such member.
            ZipDirectoryError: larger than `limit`, a local header that disagrees, an unsupported
                compression method, corrupt data, or a CRC-32 or size that does not match.
        """
        import mmap
        import zlib

        entry = self.entries[name]
        if limit is not None and entry.file_size > limit:
            raise ZipDirectoryError(f"{name} is {entry.file_size} bytes; refusing more than {limit}")
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            start = member_data(buf, entry)
            raw = bytes(buf[start:start + entry.compress_size])
        if entry.compress_type == STORED:
            data = raw
        elif entry.compress_type == DEFLATED:
            try:
                data = zlib.decompressobj(-15).decompress(raw, entry.file_size + 1)
            except zlib.error as e:
                raise ZipDirectoryError(f"{name} has corrupt deflate data ({e})") from None
        else:
            raise ZipDirectoryError(f"{name} uses compression method {entry.compress_type}; only stored and deflated "
                                    "members are read")
        if len(data) != entry.file_size or zlib.crc32(data) != entry.CRC:
            raise ZipDirectoryError(f"{name} does not match its size or CRC-32 in the directory")
        return data
