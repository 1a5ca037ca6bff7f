"""Bytes copied file to file (mapped.copy_span), compared with their source on another thread while the
writer goes on writing the rest.

The write path's check reads every tensor back from the finished output and compares it with the source
bit for bit (modelkit.pipeline.verify). For a tensor whose bytes the writer copied unchanged from a file,
that comparison can run as soon as the copy is done, while the writer copies the next tensor: writing is
mostly the kernel's copy and the disk's write-back, so a second core is free for it. The check after the
writer finished then asks `copied_equal(written, source)` for such a tensor: true when the reader found
its bytes exactly where the writer copied bytes that compared equal with exactly the source's span. The
reader's own view of the file (names, dtypes, shapes, offsets) is still checked after the writer finished;
only the comparison of the bytes moves earlier.

That is sound because a writer copies a span's bytes once and never writes over them again (every
copy_span caller: GGUF, HDF5, safetensors, .pth, npz), and the output is in a temporary folder of its own
(modelkit.storage.atomic) that nothing else writes. A span that compared unequal (or could not be compared)
is compared again after the writer finished, where the usual error is raised.

`checking_copies(folder)` registers a folder's check for the duration of a write and its verification.
"""
from __future__ import annotations

import contextlib
import functools
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

if TYPE_CHECKING:                     # mapped imports this module (copy_span reports its copies here)
    from modelkit.storage.mapped import FileSpan


class CopyCheck:
    """Compares, on one thread, each span copied into a file of `folder` with the bytes it came from."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._jobs: queue.Queue[tuple[FileSpan, Path, int] | None] = queue.Queue()
        self._equal: dict[tuple[str, int, int], tuple[str, int]] = {}    # (output, offset, n) -> source
        self._closed = False
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, name="modelkit-copy-check", daemon=True)
        self._thread.start()

    def submit(self, source: FileSpan, output: Path, offset: int) -> None:
        if not self._closed:
            self._jobs.put((source, output, offset))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            source, output, offset = job
            if self._abandoned:
                continue
            try:
                same = _same_bytes(source, output, offset)
            except (OSError, ValueError):
                same = False                     # compared again after the writer finished, which reports it
            if same:
                self._equal[(_key(output), offset, source.nbytes)] = (_key(source.path), source.offset)

    def close(self, *, abandon: bool = False) -> None:
        """Wait for every comparison submitted so far (`abandon`: for the one running only, when the write
        failed and nothing will ask); later copies are not compared here."""
        self._abandoned = self._abandoned or abandon
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._thread.join()

    def equal(self, written: FileSpan, source: FileSpan) -> bool:
        self.close()
        return self._equal.get((_key(written.path), written.offset, written.nbytes)) == (_key(source.path), source.offset) \
            and written.nbytes == source.nbytes


def _key(path: Path | str) -> str:
    return os.path.abspath(path)


def _same_bytes(source: FileSpan, output: Path, offset: int) -> bool:
    """Whether `source`'s bytes are at `offset` in `output`: both mapped read-only and compared by memcmp
    (numpy's comparison where the C library has none).

    Measured: 0.22 s of CPU for the 980 MiB of bench/slim.py's checkpoint (45 spans, 1 GiB
    on each side), against 0.27 s read 1 MiB at a time into two buffers and compared there, and 0.28 s for the
    check after the writer as it was (both files mapped whole, numpy's comparison in chunks); five interleaved
    rounds each, 2026-11-28, the 2-core VM."""
    if source.nbytes == 0:
        return True
    with open(source.path, "rb") as a, open(output, "rb") as b:
        x, y = _view(a, source.offset, source.nbytes), _view(b, offset, source.nbytes)
        if x is None or y is None:
            return False                     # a file shorter than the span: the check after the writer says so
        compare = _memcmp()
        if compare is not None:
            return compare(x.ctypes.data, y.ctypes.data, source.nbytes) == 0
        return all(np.array_equal(x[i:i + _CHUNK], y[i:i + _CHUNK]) for i in range(0, source.nbytes, _CHUNK))


_CHUNK = 1 << 20          # numpy's fallback compares this many bytes at a time (its boolean temporary stays small)


def _view(file: BinaryIO, offset: int, nbytes: int) -> np.ndarray | None:
    """`nbytes` bytes at `offset` of an open file, as a uint8 array over a read-only mapping of just them."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    if offset + nbytes > os.fstat(file.fileno()).st_size:
        return None
    mapping = mmap.mmap(file.fileno(), offset + nbytes - start, offset=start, access=mmap.ACCESS_READ)
    return np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset - start)


@functools.cache
def _memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's memcmp through ctypes (the call releases the GIL), or None where there is none."""
    import ctypes

    try:
        function = ctypes.CDLL(None).memcmp          # the process's own C library (POSIX)
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    function.restype = ctypes.c_int
    return function


_checks: dict[str, CopyCheck] = {}


@contextlib.contextmanager
def checking_copies(folder: Path) -> Iterator[CopyCheck]:
    """Compare the spans copied into files directly inside `folder` while the block runs."""
    check = _checks[_key(folder)] = CopyCheck(folder)
    try:
        yield check
    except BaseException:
        check.close(abandon=True)
        raise
    finally:
        _checks.pop(_key(folder), None)
        check.close()


# Spans smaller than this are left to the check after the writer: mapping both sides costs about 40 us a span
# here, against 3 us for a view of the whole files that check maps once (2000 spans of 4 KiB, 2026-11-28);
# from 1 MiB on that is a sixth of the comparison, and it runs while the writer writes.
_SMALLEST = 1 << 20


def span_copied(source: FileSpan, output: str | Path, offset: int) -> None:
    """copy_span copied `source` to `offset` in the file `output`: compare it now if its folder is checked
    and the span is not small."""
    if _checks and source.nbytes >= _SMALLEST:
        check = _checks.get(os.path.dirname(_key(output)))
        if check is not None:
            check.submit(source, Path(output), offset)


def copied_equal(written: FileSpan, source: FileSpan) -> bool:
    """Whether `written` (a span of an output being checked) holds bytes that compared equal with `source`
    right after copy_span copied them there."""
    check = _checks.get(os.path.dirname(_key(written.path)))
    return check is not None and check.equal(written, source)
