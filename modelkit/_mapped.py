"""Tensors as views of a file's pages: one copy-on-write memory map per file, opened on first use.

The views are backed by the page cache, not by process memory, so converting a file larger than
RAM holds about nothing beyond the page cache, and nothing is copied until a tensor is changed.
Copy-on-write (ACCESS_COPY): writing into a returned tensor never touches the file.
"""
from __future__ import annotations

import mmap
from pathlib import Path

import torch

from modelkit.errors import FormatError


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

    def view(self, offset: int, nbytes: int, what: str = "a tensor") -> torch.Tensor:
        """`nbytes` bytes at `offset` as a uint8 tensor (no copy); FormatError if past the end."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        mapping = self._mapping()
        if offset < 0 or offset + nbytes > len(mapping):
            raise FormatError(self.path, f"{what} ends past the end of the file (was it truncated?)")
        return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
