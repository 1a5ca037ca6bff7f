"""The members of an .npz archive (numpy.savez, numpy.savez_compressed), read without numpy.

Spec: numpy/lib/_npyio_impl.py (`savez`, `NpzFile`) and numpy/lib/format.py (the .npy format).
Layout: a zip archive (parse.zipdir) of members `<name>.npy`, stored (savez) or deflated
(savez_compressed), each a whole .npy file (parse.npy): magic, version, a header padded so the
elements start 64-byte aligned within the member, then the elements in C or Fortran order. numpy
writes every member with a zip64 extra field. `np.load` lists a member whose name does not end in
`.npy` under its full name and gives its raw bytes; modelkit writes one such member,
`modelkit.json` (modelkit.metadata.NPZ_MEMBER), beside the arrays.

Each member's local header is checked against the central directory, its .npy header is read (from
the first decompressed bytes of a deflated member, never the whole member) and its size is checked
against what the header describes before anything allocates or reads the elements. Standard
library only.
"""
from __future__ import annotations

import struct

from modelkit.errors import ParseError
from modelkit.metadata import NPZ_MEMBER
from modelkit.parse import npy, zipdir

SUFFIX = ".npy"
_HEAD = 4096                 # bytes first read of each member: numpy's headers are 128 or so


def is_npz(names: list[str]) -> bool:
    """Member names of an npz archive: at least one, each `<name>.npy` or modelkit's JSON member."""
    return bool(names) and all(n.endswith(SUFFIX) or n == NPZ_MEMBER for n in names)


class Member:
    """One array member: the tensor name (the member name less `.npy`), its directory entry, its checked
    .npy header, where its data starts in the archive (`start`), how long the .npy header is
    (`header_len`), and for a stored member the archive offset of its elements (`data_offset`)."""

    __slots__ = ("name", "entry", "header", "start", "header_len", "data_offset")

    def __init__(self, name: str, entry: zipdir.ZipEntry, header: npy.Header, start: int, header_len: int) -> None:
        self.name, self.entry, self.header, self.start, self.header_len = name, entry, header, start, header_len
        self.data_offset = start + header_len if entry.compress_type == zipdir.STORED else None

    @property
    def stored(self) -> bool:
        return self.data_offset is not None

    def __repr__(self) -> str:
        return f"Member({self.name!r}, {self.header.descr!r}, {self.header.shape})"


def read_members(buf, end: int | None = None) -> tuple[list[Member], zipdir.ZipEntry | None]:
    """The array members of the archive in buf[0:end], in archive order, and modelkit's JSON member
    (None when there is none).

    Raises:
        ParseError: the directory cannot be read; a name appears twice or holds a NUL byte; a member is
            not `<name>.npy`; a member is encrypted or compressed other than deflate; a local header
            disagrees with the directory; a .npy header cannot be read; or a member's size is not its
            header plus the elements its header describes (object arrays hold a pickle and are not
            sized here: the caller refuses them).
    """
    end = len(buf) if end is None else end
    entries = zipdir.read_directory(buf, end)
    seen: set[str] = set()
    members: list[Member] = []
    extra: zipdir.ZipEntry | None = None
    for entry in entries:
        name = entry.filename
        if name in seen:
            raise ParseError(f"the archive holds {name!r} twice; zip readers disagree about which copy counts")
        seen.add(name)
        if "\x00" in name:
            raise ParseError(f"member name {name!r} holds a NUL byte; Python's zipfile (and so np.load) cuts the "
                             "name there, so readers would disagree about it")
        if name == NPZ_MEMBER:
            extra = entry
            continue
        if not name.endswith(SUFFIX):
            raise ParseError(f"member {name!r} is not a .npy array; an npz archive holds only <name>.npy members")
        members.append(_member(buf, entry, end))
    return members, extra


def _member(buf, entry: zipdir.ZipEntry, end: int) -> Member:
    name = entry.filename
    try:
        start = zipdir.member_data(buf, entry, end)
        head = zipdir.read_start(buf, entry, _HEAD)
        if len(head) >= 12 and head[6] in (2, 3):         # a longer header than the first read holds
            needed = 12 + struct.unpack_from("<I", head, 8)[0]
            if len(head) < needed <= min(entry.file_size, 12 + npy.MAX_HEADER):
                head = zipdir.read_start(buf, entry, needed)
        elif len(head) >= 10 and head[6] == 1:
            needed = 10 + struct.unpack_from("<H", head, 8)[0]
            if len(head) < needed <= entry.file_size:
                head = zipdir.read_start(buf, entry, needed)
        header = npy.read_header(head)
    except ParseError as e:
        raise ParseError(f"member {name!r}: {e.reason}") from None
    if header.has_object or header.itemsize is None:
        return Member(name[:-len(SUFFIX)], entry, header, start, header.data_start)
    described = header.numel * header.itemsize
    if header.data_start + described != entry.file_size:
        raise ParseError(f"member {name!r}: its .npy header describes {described} bytes of elements "
                         f"({header.descr} {list(header.shape)}) but the member holds "
                         f"{entry.file_size - header.data_start}")
    return Member(name[:-len(SUFFIX)], entry, header, start, header.data_start)
