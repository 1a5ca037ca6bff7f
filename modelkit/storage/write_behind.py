"""Writes that run one step behind the code making the data: while a band goes into the page cache on a
thread of its own, the caller already makes the next one.

A writer that streams a tensor made in bands (a transposed Dense kernel: storage.transpose.RowBlocks's
`transposed_chunks`, whose bands live in two buffers in turn) spends its time in two things that need no
GIL: the transpose and the kernel's copy of each band into the page cache. Done one after the other, each
waits for the other; with the write one step behind, the two overlap on two cores. At most one write is
in flight, so `write(data)` returns once the write before it is done: a buffer handed over two writes ago
is free again, which is what `transposed_chunks` needs of its caller.

`write_all(file, data)`: what each such write does, in calls of at most WRITE_SIZE bytes. On this VM
(Linux 6.18, ext4, 2026-11-28, fresh processes) 1 GiB written to a new file in write() calls of 4 MiB took
0.33-4.1 s of system time (median 1.0 s, 10 runs), in calls of 2 MiB 0.31-1.1 s (3 runs), against
0.23-0.38 s in calls of 512 KiB or 1 MiB (10 runs; 64 KiB: 0.28-0.35 s) and 0.32-0.36 s for shutil's
copy_file_range of the same size: nearly all of it in the kernel's copy into the page cache
(copy_folio_from_iter_atomic). A write of 2 MiB or more lets ext4 take 2 MiB page-cache
folios, and those come, it seems, from memory the host has to back afresh; smaller writes get small folios
from pages freed a moment before. A 1 GiB TF.js conversion wrote its 4 MiB bands whole.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

WRITE_SIZE = 1 << 20          # bytes per write() call (see above)


def write_all(file: BinaryIO, data: Any) -> None:
    """Write `data` (bytes-like) to `file` in calls of at most WRITE_SIZE bytes."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), WRITE_SIZE):
        file.write(view[start:start + WRITE_SIZE])


class WriteBehind:
    """`write(data)` calls `sink(data)` on a thread of its own, one call in flight; leaving the block waits
    for the last one, and a sink's error is raised by the `write` after it or at the end of the block."""

    def __init__(self, sink: Callable[[Any], None]) -> None:
        self.sink = sink
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="modelkit-write-behind")
        self.pending: Future[None] | None = None

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        try:
            if self.pending is not None:
                if kind is None:
                    self.pending.result()          # the last write's own error surfaces here
                else:
                    self.pending.exception()       # the caller's error is the one to report
        finally:
            self.thread.shutdown(wait=True)

    def write(self, data: Any) -> None:
        """Hand `data` to the sink's thread; returns once the write before it is done."""
        before, self.pending = self.pending, self.thread.submit(self.sink, data)
        if before is not None:
            before.result()
