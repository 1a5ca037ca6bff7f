"""Transposes of 2-D arrays (the Keras layouts store a Dense kernel (in, out), torch (out, in)), and the
comparison of an array with the transpose of another without making that transpose.

`transpose_into(out, w)` and `transposed_equal(a, b)` run in the C kernels of _transpose.c where the
extension was built (`ACCELERATED`), for arrays whose rows are contiguous (any row stride: a band of
columns of a larger matrix qualifies), on up to `WORKERS` threads for a large matrix; else in numpy, tile
by tile. Items are moved and compared as raw bits: a NaN equals its own bits, -0.0 differs from 0.0.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

try:
    from modelkit.storage import _transpose as _kernel
except ImportError:              # no C compiler at install time: the numpy path below (same results, slower)
    _kernel = None

ACCELERATED = _kernel is not None
WORKERS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
_PARALLEL = 16 << 20             # bytes from which a matrix is shared out between threads
_TILE = (16, 1024)               # numpy path: rows x columns at a time (the rows read stay in cache)


def _kernel_takes(*arrays: np.ndarray) -> bool:
    """The C kernels take 2-D arrays of 1/2/4/8-byte items whose items within a row are contiguous."""
    return _kernel is not None and all(
        a.ndim == 2 and a.itemsize in (1, 2, 4, 8) and (a.shape[1] <= 1 or a.strides[1] == a.itemsize)
        and a.strides[0] >= 0 for a in arrays)


def _bands(rows: int, nbytes: int, threads: int | None) -> list[slice]:
    """`rows` cut into one band per thread (one band for a small matrix)."""
    n = max(1, min(threads or WORKERS, rows)) if nbytes >= _PARALLEL else 1
    step = max(1, -(-rows // n))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)] or [slice(0, 0)]


def transpose_into(out: np.ndarray, w: np.ndarray, *, threads: int | None = 1) -> None:
    """out[...] = w.T for a 2-D `w` (`out` may be a strided view). `threads`: how many to share a large
    matrix between (None: up to WORKERS)."""
    if out.shape != w.shape[::-1] or out.dtype != w.dtype:
        raise ValueError(f"cannot transpose {w.dtype} {list(w.shape)} into {out.dtype} {list(out.shape)}")
    if _kernel_takes(w, out):
        bands = _bands(w.shape[0], w.nbytes, threads)
        if len(bands) == 1:
            _kernel.transpose(w, out)
        else:
            _on_threads(lambda b: _kernel.transpose(w[b], out[:, b]), bands)
        return
    # numpy's copy of w.T strides across the whole source for every output row; 16-row tiles keep the
    # rows read in cache (about 8x faster on a 4096 x 4096 float32)
    rows, cols = _TILE
    for i in range(0, w.shape[0], rows):
        for j in range(0, w.shape[1], cols):
            out[j:j + cols, i:i + rows] = w[i:i + rows, j:j + cols].T


def transposed_equal(a: np.ndarray, b: np.ndarray, *, threads: int | None = None) -> bool:
    """True when `b` is `a` transposed bit for bit (same dtype, b.shape == a.shape[::-1], b[j, i] == a[i, j]),
    compared without making a transpose. `threads`: how many to share a large matrix between (None: up to
    WORKERS)."""
    if a.ndim != 2 or a.dtype != b.dtype or b.shape != a.shape[::-1]:
        return False
    if _kernel_takes(a, b):
        bands = _bands(a.shape[0], a.nbytes, threads)
        if len(bands) == 1:
            return bool(_kernel.transposed_equal(a, b))
        return all(_on_threads(lambda r: _kernel.transposed_equal(a[r], b[:, r]), bands))
    rows, cols = _TILE
    for i in range(0, a.shape[0], rows):
        for j in range(0, a.shape[1], cols):
            x, y = a[i:i + rows, j:j + cols], b[j:j + cols, i:i + rows].T      # tiles of 64 KiB or less
            if not np.array_equal(_raw(x), _raw(y)):
                return False
    return True


def _raw(tile: np.ndarray) -> np.ndarray:
    """A tile's bytes in C order (compared as bits, not as floats: NaN, -0.0)."""
    return np.ascontiguousarray(tile).reshape(-1).view(np.uint8)


class RowBlocks:
    """A matrix (rows, cols) stored as blocks of whole rows (views of the files that hold them: a TF.js
    Dense kernel across its shards) and wanted transposed, (cols, rows), without a joined copy of the
    stored matrix: made whole, streamed in bands, or compared with an array in the stored layout."""

    def __init__(self, blocks: list[tuple[int, np.ndarray]], shape: tuple[int, int], dtype: np.dtype) -> None:
        self.blocks, self.shape, self.dtype = blocks, shape, np.dtype(dtype)     # (first row, 2-D block)

    @classmethod
    def of_bytes(cls, pieces: list[np.ndarray], shape: tuple[int, int], dtype: np.dtype) -> RowBlocks:
        """The matrix from `pieces`, uint8 arrays whose bytes end to end are the matrix in C order: each
        piece's whole rows as one block (a view), a row cut between pieces joined on its own."""
        dtype = np.dtype(dtype)
        rows, cols = shape
        row_bytes = cols * dtype.itemsize
        if row_bytes == 0 and not any(len(p) for p in pieces):        # rows of no items
            return cls([(0, np.empty((rows, 0), dtype=dtype))], shape, dtype)
        blocks: list[tuple[int, np.ndarray]] = []
        row, carry, held = 0, [], 0
        for data in pieces:
            if carry:                                  # the rest of a row an earlier piece began
                take = data[:row_bytes - held]
                carry.append(take)
                held += len(take)
                data = data[len(take):]
                if held < row_bytes:
                    continue
                blocks.append((row, np.concatenate(carry).view(dtype).reshape(1, cols)))
                row, carry, held = row + 1, [], 0
            whole = len(data) // row_bytes if row_bytes else 0       # (bytes with rows of none: refused below)
            if whole:
                blocks.append((row, data[:whole * row_bytes].view(dtype).reshape(whole, cols)))
                row += whole
            if len(data) > whole * row_bytes:
                carry, held = [data[whole * row_bytes:]], len(data) - whole * row_bytes
        if row != rows or carry:
            raise ValueError(f"{sum(len(p) for p in pieces)} bytes are not a {dtype} matrix of shape {list(shape)}")
        return cls(blocks, shape, dtype)

    def transposed(self) -> np.ndarray:
        """The transpose, (cols, rows), as one new array."""
        out = np.empty(self.shape[::-1], dtype=self.dtype)
        self._each_group(lambda group: [transpose_into(out[:, first:first + len(block)], block, threads=None
                                                       if len(self.blocks) == 1 else 1) for first, block in group])
        return out

    def transposed_chunks(self, nbytes: int, bands: Bands | None = None) -> Iterator[np.ndarray]:
        """The transpose in bands of whole rows of about `nbytes`, made in two buffers in turn: each band
        is valid until the one after next is asked for. `bands`: buffers shared with the matrices streamed
        before and after this one (by one consumer), else two of its own. A matrix in one block (a torch
        kernel) is transposed on the calling thread alone (the consumer's writer has the other core); one
        in many (a TF.js kernel across its shards) on the worker threads, in runs of whole blocks."""
        rows, cols = self.shape
        step = max(1, nbytes // max(1, rows * self.dtype.itemsize))
        bands = bands or Bands()
        for start in range(0, cols, step):
            band = bands.next((min(step, cols - start), rows), self.dtype)
            self._each_group(lambda group, b=band, s=start: [transpose_into(b[:, first:first + len(block)],
                                                                            block[:, s:s + len(b)])
                                                             for first, block in group])
            yield band

    def equals_transposed(self, array: np.ndarray) -> bool:
        """True when `array` (cols, rows) is the stored matrix transposed, bit for bit; compared block by
        block in the stored layout, nothing made."""
        if array.dtype != self.dtype or array.shape != self.shape[::-1]:
            return False
        threads = None if len(self.blocks) == 1 else 1        # one block: shared out by rows instead
        return all(self._each_group(lambda group: all(
            transposed_equal(block, array[:, first:first + len(block)], threads=threads) for first, block in group)))

    def _each_group(self, work: Any) -> list[Any]:
        """`work(group)` for runs of consecutive blocks (about the same rows each), on the worker threads when
        the matrix is large: twice as many runs as threads, taken as threads come free, so one hand-off per
        run, not one per block (a TF.js kernel in 4 MiB shards is 16 blocks; per block, a 1 GiB model's bands
        made 4096 hand-offs), and a thread that is descheduled leaves its next run to the other (with one
        fixed share each, the other waited: 30-70% more wall time at load 5-6, 2026-11-28)."""
        large = self.shape[0] * self.shape[1] * self.dtype.itemsize >= _PARALLEL and WORKERS > 1
        groups = _runs(self.blocks, 2 * WORKERS if large else 1)
        return [work(groups[0])] if len(groups) == 1 else _on_threads(work, groups)


def _runs(blocks: list[tuple[int, np.ndarray]], n: int) -> list[list[tuple[int, np.ndarray]]]:
    """`blocks` cut into at most `n` runs of consecutive blocks holding about the same number of rows."""
    total = sum(len(block) for _, block in blocks)
    runs: list[list[tuple[int, np.ndarray]]] = [[]]
    held = 0
    for item in blocks:
        if runs[-1] and held >= total * len(runs) / n:
            runs.append([])
        runs[-1].append(item)
        held += len(item[1])
    return runs


class Bands:
    """Two band buffers that RowBlocks.transposed_chunks calls take in turn, for one consumer streaming
    matrix after matrix (a writer; the tensors of one TF.js model read): the turn carries on from one
    matrix to the next, so a band stays valid until the one after next is asked for whichever matrix it
    comes from, and the buffers are allocated once, not per matrix. Fresh per matrix, a 1 GiB TF.js model's
    16 kernels took 16 pairs of 4 MiB buffers: about 9000 page faults and the zeroing of 128 MiB of new
    memory, which this VM hands out slowly. A buffer grows when a band needs more than it holds."""

    def __init__(self) -> None:
        self._memory: list[np.ndarray | None] = [None, None]
        self._turn = 0

    def next(self, shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
        """The next buffer in turn, as an uninitialised array of `shape` and `dtype`."""
        turn, self._turn = self._turn, 1 - self._turn
        need = shape[0] * shape[1] * np.dtype(dtype).itemsize
        memory = self._memory[turn]
        if memory is None or memory.nbytes < need:
            memory = self._memory[turn] = np.empty(max(need, 1), dtype=np.uint8)
        return memory[:need].view(dtype).reshape(shape)


_T = TypeVar("_T")
_R = TypeVar("_R")
_threads: ThreadPoolExecutor | None = None
_threads_lock = threading.Lock()


def _on_threads(work: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
    """`work(item)` for every item on the module's worker threads, in order: one pool of WORKERS threads,
    started on first use and kept, where a pool per call started 2 threads per band of a TF.js kernel (512
    per 1 GiB model). Work run there never hands work back to the pool (no nesting, no deadlock)."""
    global _threads
    with _threads_lock:
        if _threads is None:
            _threads = ThreadPoolExecutor(max(2, WORKERS), thread_name_prefix="modelkit-transpose")
        pool = _threads
    return list(pool.map(work, items))


def _forget_threads() -> None:
    """In a forked child the parent's threads do not exist: start a pool of its own when one is needed."""
    global _threads, _threads_lock
    _threads, _threads_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads)
