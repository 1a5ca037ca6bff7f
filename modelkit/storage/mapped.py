"""Tensors as views of a file's pages, and file-to-file copies of their bytes.

`MappedFile`: one copy-on-write memory map per file, opened on first use. The views are backed by
the page cache, not by process memory, so converting a file larger than RAM holds about nothing
beyond the page cache, and nothing is copied until a tensor is changed. Copy-on-write
(ACCESS_COPY): writing into a returned tensor never touches the file.

`copy_span`: a tensor whose bytes go to the output unchanged (safetensors -> GGUF F32, safetensors
-> safetensors, GGUF -> safetensors, ...) is copied inside the kernel, never through a user-space
buffer: splice(2) through a 1 MiB pipe, else copy_file_range, else reads and writes.
"""
from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from modelkit.errors import FormatError
from modelkit.storage.copy_check import span_copied

_CHUNK = 1 << 20            # bytes per read and write on the fallback path (storage.write_behind)
_PIPE = 1 << 20             # splice pipe size: the default pipe-max-size, and what makes unaligned copies fast
_F_SETPIPE_SZ = 1031        # fcntl.F_SETPIPE_SZ (Linux; the constant is missing from some Pythons)
# errno values that mean "this way of copying is not available here" (try the next); any other
# error (a full disk, a file size limit, an I/O error) is the copy's failure and propagates.
_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.ESPIPE, errno.EBADF})


@dataclass(frozen=True)
class FileSpan:
    """`nbytes` bytes at `offset` in the file at `path`; `copied`, if set, is called once copy_span
    has copied them (how progress reporting sees bytes that never pass through load())."""

    path: Path
    offset: int
    nbytes: int
    copied: Callable[[], None] | None = field(default=None, compare=False, repr=False)


def copy_span(span: FileSpan, out: BinaryIO, *, at: int | None = None) -> None:
    """Copy the span's bytes into `out`, an open file (buffered or raw): appended at its current
    position, or written at byte `at` (the file's position then stays where it was).

    splice through a 1 MiB pipe first, then copy_file_range (neither copies through user space);
    where the kernel or filesystem refuses both (another filesystem on old kernels, special
    files), ordinary reads and writes. The copy is then reported to storage.copy_check, which compares
    it with the source on another thread when the output is being checked.

    Raises:
        FormatError: the source file ends before the span does (truncated since it was opened).
    """
    out.flush()
    fd = out.fileno()
    start = os.lseek(fd, 0, os.SEEK_CUR) if at is None else at
    with open(span.path, "rb") as src:
        done = _splice(src.fileno(), fd, span, at)
        if done < span.nbytes and hasattr(os, "copy_file_range"):
            try:
                while done < span.nbytes:
                    target = None if at is None else at + done
                    n = os.copy_file_range(src.fileno(), fd, span.nbytes - done, span.offset + done, target)
                    if n <= 0:
                        break
                    done += n
            except OSError as e:
                if e.errno not in _UNSUPPORTED:
                    raise                               # a full disk, a file size limit, an I/O error
                # not supported here: the rest goes through user space
        src.seek(span.offset + done)
        while done < span.nbytes:
            chunk = src.read(min(span.nbytes - done, _CHUNK))
            if not chunk:
                raise FormatError(span.path, "the file ends before a tensor's last byte (was it truncated?)")
            view = memoryview(chunk)
            while view:
                n = os.write(fd, view) if at is None else os.pwrite(fd, view, at + done + len(chunk) - len(view))
                view = view[n:]
            done += len(chunk)
    if at is None:
        out.seek(os.lseek(fd, 0, os.SEEK_CUR))          # the file object's position follows the descriptor's
    if isinstance(getattr(out, "name", None), str):
        span_copied(span, out.name, start)              # compared with the source now if the output is checked
    if span.copied is not None:
        span.copied()


def _splice(src: int, dst: int, span: FileSpan, at: int | None) -> int:
    """Copy through a pipe of _PIPE bytes with splice(2); returns the bytes copied (0 where unsupported).

    Measured on Linux 6.18 / ext4 (1 GiB, warm cache): copy_file_range, and sendfile, which go
    through a 64 KiB pipe inside the kernel, run 0.55 s for a whole file but 0.75-0.8 s when the
    source offset is not page-aligned or the target offset is not 32 KiB-aligned, which is every
    tensor of a safetensors, GGUF or torch file; the same copy through a 1 MiB pipe runs 0.52 s at
    any alignment.
    """
    if not hasattr(os, "splice") or span.nbytes < _PIPE:
        return 0                                   # not Linux, or too small to matter
    import fcntl
    done = 0
    read_end, write_end = os.pipe()
    try:
        try:
            if fcntl.fcntl(write_end, _F_SETPIPE_SZ, _PIPE) < _PIPE:
                return 0
        except OSError:
            return 0                               # not Linux, or pipe-max-size is smaller
        while done < span.nbytes:
            try:
                moved = os.splice(src, write_end, min(_PIPE, span.nbytes - done), offset_src=span.offset + done)
            except OSError as e:
                if e.errno not in _UNSUPPORTED:
                    raise
                return done                        # the caller goes on from `done` another way
            if moved <= 0:
                return done                        # the source ended early: the caller's read finds out
            written = 0
            while written < moved:
                target = None if at is None else at + done + written
                try:
                    n = os.splice(read_end, dst, moved - written, offset_dst=target)
                except OSError as e:
                    if e.errno not in _UNSUPPORTED or written:
                        raise
                    return done
                written += n
            done += moved
    finally:
        os.close(read_end)
        os.close(write_end)
    return done


class MappedFile:
    """One file's bytes, mapped once; `view(offset, nbytes)` gives uint8 arrays into it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._map: mmap.mmap | None = None

    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            try:
                with self.path.open("rb") as f:
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as e:
                raise FormatError(self.path, f"cannot map the file for reading ({e})") from e
        return self._map

    def span(self, offset: int, nbytes: int) -> FileSpan:
        return FileSpan(self.path, offset, nbytes)

    def view(self, offset: int, nbytes: int, what: str = "a tensor") -> np.ndarray:
        """`nbytes` bytes at `offset` as a uint8 array (no copy, writable: copy-on-write pages);
        FormatError if past the end."""
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        mapping = self._mapping()
        if offset < 0 or offset + nbytes > len(mapping):
            raise FormatError(self.path, f"{what} ends past the end of the file (was it truncated?)")
        return np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset)
