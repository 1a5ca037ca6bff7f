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
(modelkit.storage.atomic) that nothing else writes. A span that compared unequal, or one the thread had no
time for, is compared again after the writer finished, where the usual error is raised.

`checking_copies(folder)` registers a folder's check for the duration of a write and its verification.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:                     # mapped imports this module (copy_span reports its copies here)
    from modelkit.storage.mapped import FileSpan

_BUFFER = 1 << 20        # bytes read from each side per comparison: two buffers that stay in the CPU's cache


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
        left, right = bytearray(_BUFFER), bytearray(_BUFFER)
        while (job := self._jobs.get()) is not None:
            source, output, offset = job
            if self._abandoned:
                continue
            try:
                same = _same_bytes(source, output, offset, left, right)
            except OSError:
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


def _same_bytes(source: FileSpan, output: Path, offset: int, left: bytearray, right: bytearray) -> bool:
    with open(source.path, "rb", buffering=0) as a, open(output, "rb", buffering=0) as b:
        done = 0
        while done < source.nbytes:
            n = min(_BUFFER, source.nbytes - done)
            x, y = (left, right) if n == _BUFFER else (bytearray(n), bytearray(n))
            if os.preadv(a.fileno(), [x], source.offset + done) != n or os.preadv(b.fileno(), [y], offset + done) != n:
                return False
            if x != y:                           # memcmp: no allocation
                return False
            done += n
    return True


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


def span_copied(source: FileSpan, output: str | Path, offset: int) -> None:
    """copy_span copied `source` to `offset` in the file `output`: compare it now if its folder is checked."""
    if _checks:
        check = _checks.get(os.path.dirname(_key(output)))
        if check is not None:
            check.submit(source, Path(output), offset)


def copied_equal(written: FileSpan, source: FileSpan) -> bool:
    """Whether `written` (a span of an output being checked) holds bytes that compared equal with `source`
    right after copy_span copied them there."""
    check = _checks.get(os.path.dirname(_key(written.path)))
    return check is not None and check.equal(written, source)
