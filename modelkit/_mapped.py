"""Tensors as views of a file's pages, and file-to-file copies of their bytes.

`MappedFile`: one copy-on-write memory map per file, opened on first use. The views are backed by
the page cache, not by process memory, so converting a file larger than RAM holds about nothing
beyond the page cache, and nothing is copied until a tensor is changed. Copy-on-write
(ACCESS_COPY): writing into a returned tensor never touches the file.

`copy_span`: a tensor whose bytes go to the output unchanged (safetensors -> GGUF F32, safetensors
-> safetensors, GGUF -> safetensors, ...) is copied with copy_file_range, inside the kernel, as
`cp` does, instead of through a user-space buffer.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from modelkit.errors import FormatError

_CHUNK = 64 << 20           # bytes per read on the fallback path


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

    copy_file_range first (no user-space copy); where the kernel or filesystem refuses it
    (another filesystem on old kernels, special files), ordinary reads and writes.

    Raises:
        FormatError: the source file ends before the span does (truncated since it was opened).
    """
    out.flush()
    fd = out.fileno()
    done = 0
    with open(span.path, "rb") as src:
        if hasattr(os, "copy_file_range"):
            try:
                while done < span.nbytes:
                    target = None if at is None else at + done
                    n = os.copy_file_range(src.fileno(), fd, span.nbytes - done, span.offset + done, target)
                    if n <= 0:
                        break
                    done += n
            except OSError:
                pass                                    # the rest goes through user space
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
    if span.copied is not None:
        span.copied()


class MappedFile:
    """One file's bytes, mapped once; `view(offset, nbytes)` gives uint8 tensors into it."""

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

    def view(self, offset: int, nbytes: int, what: str = "a tensor") -> torch.Tensor:
        """`nbytes` bytes at `offset` as a uint8 tensor (no copy); FormatError if past the end."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        mapping = self._mapping()
        if offset < 0 or offset + nbytes > len(mapping):
            raise FormatError(self.path, f"{what} ends past the end of the file (was it truncated?)")
        return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
