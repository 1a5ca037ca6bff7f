"""modelkit.storage.transpose: the C kernels and the numpy path give the same transposes and verdicts, bit
for bit, on every item size, strided bands, odd shapes, NaN payloads and signed zeros; RowBlocks makes,
streams and compares a matrix stored across pieces (rows cut between them) without joining it."""
from __future__ import annotations

import time

import numpy as np
import pytest

from modelkit.storage import transpose

KERNEL = transpose._kernel
# the C kernels' paths for 4-byte items: each instruction set this CPU has (the others' items go one way)
ISAS = [] if KERNEL is None else [isa for isa in ("sse2", "avx2", "avx512") if KERNEL.use_isa(isa) == isa]
if KERNEL is not None:
    KERNEL.use_isa(KERNEL.ISA)
PATHS = ["numpy"] + (["c"] if KERNEL is not None and not ISAS else []) + [f"c-{isa}" for isa in ISAS]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Each test once through the numpy path and once through the C kernels (where they were built), for
    4-byte items once through each instruction set the CPU has."""
    if request.param == "numpy":
        monkeypatch.setattr(transpose, "_kernel", None)
    if request.param.startswith("c-"):
        KERNEL.use_isa(request.param[2:])
        yield request.param
        KERNEL.use_isa(KERNEL.ISA)
        return
    yield request.param


def _matrix(shape, dtype, seed=0):
    """Random bits (NaNs among them): compare with .tobytes(), not np.array_equal."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(*shape, np.dtype(dtype).itemsize), dtype=np.uint8).view(dtype)[..., 0]


@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 130), (67, 5), (129, 257), (0, 5), (4, 0), (17, 23)])
def test_transpose_and_compare_every_item_size(path, dtype, shape):
    w = _matrix(shape, dtype)
    out = np.empty(shape[::-1], dtype=dtype)
    transpose.transpose_into(out, w)
    assert out.tobytes() == np.ascontiguousarray(w.T).tobytes()
    assert transpose.transposed_equal(w, out)
    if out.size:
        out.view(np.uint8)[-1, -1] ^= 1                    # one bit of the last item
        assert not transpose.transposed_equal(w, out)


def test_bands_of_a_larger_matrix_and_threads(path, monkeypatch):
    """A band of columns (a strided view) transposes into a band of rows; a matrix over the threshold is
    shared out between threads, and a difference in any thread's band is found."""
    monkeypatch.setattr(transpose, "_PARALLEL", 1 << 12)
    monkeypatch.setattr(transpose, "WORKERS", 3)
    w = _matrix((300, 500), np.float32, seed=1)
    out = np.zeros((600, 300), dtype=np.float32)
    transpose.transpose_into(out[100:400], w[:, 100:400], threads=None)
    assert out[100:400].tobytes() == np.ascontiguousarray(w[:, 100:400].T).tobytes()
    assert not out[:100].any() and not out[400:].any()
    whole = np.ascontiguousarray(w.T)
    assert transpose.transposed_equal(w, whole)
    for row in (0, 150, 299):                              # a difference in the first, middle and last band
        changed = whole.copy()
        changed.view(np.uint32)[7, row] ^= 1 << 31              # the sign bit
        assert not transpose.transposed_equal(w, changed)


def test_compared_as_bits_not_as_floats(path):
    """NaN equals its own bits (a float comparison would fail it); -0.0 differs from 0.0 (a float comparison
    would pass it)."""
    w = np.array([[np.nan, 0.0], [1.0, -0.0]], dtype=np.float32)
    assert transpose.transposed_equal(w, w.T.copy())
    other = w.T.copy()
    other[1, 1] = 0.0                                      # w[1, 1] is -0.0
    assert not transpose.transposed_equal(w, other)
    payload = w.T.copy()
    payload.view(np.uint32)[0, 0] ^= 1                     # another NaN
    assert not transpose.transposed_equal(w, payload)


def test_shapes_and_dtypes_that_do_not_match():
    w = np.zeros((3, 4), np.float32)
    assert not transpose.transposed_equal(w, np.zeros((3, 4), np.float32))
    assert not transpose.transposed_equal(w, np.zeros((4, 3), np.int32))
    with pytest.raises(ValueError, match="cannot transpose"):
        transpose.transpose_into(np.empty((3, 4), np.float32), w)


@pytest.mark.parametrize("cuts", [[0, 4096], [1000, 1001, 5000], list(range(0, 4 * 30 * 52, 97))])
def test_row_blocks_from_pieces_cut_anywhere(path, cuts):
    """A (30, 52) float32 matrix as uint8 pieces cut at arbitrary bytes (rows split between two or more
    pieces): made whole, streamed in bands and compared, all equal to the transpose."""
    w = _matrix((30, 52), np.float32, seed=2)
    data = np.frombuffer(w.tobytes(), dtype=np.uint8)
    bounds = sorted({0, *[c for c in cuts if c < data.size], data.size})
    pieces = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    blocks = transpose.RowBlocks.of_bytes(pieces, (30, 52), np.float32)
    assert blocks.transposed().tobytes() == w.T.tobytes()
    assert b"".join(band.tobytes() for band in blocks.transposed_chunks(7 * 30 * 4)) == w.T.tobytes()
    assert blocks.equals_transposed(np.ascontiguousarray(w.T))
    changed = np.ascontiguousarray(w.T)
    changed.view(np.uint32)[51, 29] ^= 1 << 31
    assert not blocks.equals_transposed(changed)
    with pytest.raises(ValueError, match="not a float32 matrix"):
        transpose.RowBlocks.of_bytes(pieces[:-1] if len(pieces) > 1 else [data[:-4]], (30, 52), np.float32)


def test_row_blocks_of_empty_matrices(path):
    for shape in ((0, 4), (4, 0)):
        blocks = transpose.RowBlocks.of_bytes([], shape, np.float32)
        assert blocks.transposed().shape == shape[::-1] and blocks.equals_transposed(np.empty(shape[::-1], np.float32))
        assert b"".join(band.tobytes() for band in blocks.transposed_chunks(64)) == b""


def test_a_band_stays_valid_until_the_one_after_next_is_asked_for(path):
    """A writer still writing band n when it asks for band n + 1 (the TF.js shard writer) must find band n
    unchanged, however soon the band after is made (band buffers are reused, so the rule is easy to break)."""
    w = _matrix((40, 64), np.float32, seed=3)
    blocks = transpose.RowBlocks.of_bytes([np.frombuffer(w.tobytes(), np.uint8)], (40, 64), np.float32)
    bands = blocks.transposed_chunks(5 * 40 * 4)                # 13 bands of 5 rows (the last of 4)
    held, seen = [], []
    for band in bands:
        if held:
            time.sleep(0.01)                                    # anything made meanwhile is made
            seen.append(held[-1].tobytes())                     # band n - 1, read after band n was yielded
        held = [*held[-1:], band]
    seen.append(held[-1].tobytes())
    assert len(seen) == 13 and b"".join(seen) == w.T.tobytes()


def test_shared_bands_take_turns_across_matrices_and_are_allocated_once(path):
    """Matrices streamed one after another through one Bands (a writer's kernels) go on taking the two
    buffers in turn: the last band of one matrix stays valid while the first of the next is made, and no
    buffer is allocated after the first two (a 1 GiB TF.js model: 2 buffers, not 32)."""
    first, second = _matrix((40, 64), np.float32, seed=4), _matrix((40, 24), np.float32, seed=5)
    bands = transpose.Bands()
    seen, held, memory = [], None, set()
    for w in (first, second):                                    # 13 bands, then 5 (an odd count first)
        blocks = transpose.RowBlocks.of_bytes([np.frombuffer(w.tobytes(), np.uint8)], w.shape, np.float32)
        for band in blocks.transposed_chunks(5 * 40 * 4, bands):
            if held is not None:
                seen.append(held.tobytes())                      # band n - 1, read after band n was made
            held = band
            memory.add(band.__array_interface__["data"][0])
    seen.append(held.tobytes())
    assert b"".join(seen) == first.T.tobytes() + second.T.tobytes()
    assert len(memory) == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(16, 16), (8, 24), (31, 33), (48, 272), (257, 15), (15, 513)])
def test_whole_tiles_edges_and_strides_and_any_flipped_item_found(path, dtype, shape):
    """Around the register tiles (8 and 16 items) and the 256-column strip of the direct paths, on views of
    a larger matrix (row strides not the width): the transpose is exact, and one flipped bit anywhere (whole
    tiles, the last rows, the last columns, the corner) is found."""
    rows, cols = shape
    big = _matrix((rows + 3, cols + 40), dtype, seed=rows * cols)
    w = big[2:2 + rows, 7:7 + cols]                                  # strided rows, an unaligned start
    room = np.zeros((cols + 1, rows + 9), dtype=dtype)
    out = room[1:, 5:5 + rows]                                       # a strided, unaligned target
    transpose.transpose_into(out, w)
    assert out.tobytes() == np.ascontiguousarray(w.T).tobytes()
    assert not room[0].any() and not room[1:, :5].any() and not room[1:, 5 + rows:].any()
    assert transpose.transposed_equal(w, out)
    rng = np.random.default_rng(cols)
    spots = {(0, 0), (rows - 1, cols - 1), (rows - 1, 0), (0, cols - 1), (rows // 2, cols // 2)}
    spots |= {(int(rng.integers(rows)), int(rng.integers(cols))) for _ in range(6)}
    for i, j in spots:
        changed = out.copy()
        changed.view(np.uint8).reshape(cols, rows, -1)[j, i, -1] ^= 0x80     # the top bit of item (j, i)
        assert not transpose.transposed_equal(w, changed), (i, j)


def test_every_instruction_set_gives_the_same_bits():
    """The C paths for 4-byte items agree with numpy on a 4096-wide band like the TF.js writer's."""
    if KERNEL is None:
        pytest.skip("the C kernels were not built")
    w = _matrix((300, 4096), np.float32, seed=9)[:, 1000:1300]
    want = np.ascontiguousarray(w.T).tobytes()
    try:
        for isa in ISAS:
            KERNEL.use_isa(isa)
            out = np.empty((300, 300), np.float32)
            transpose.transpose_into(out, w)
            assert out.tobytes() == want, isa
            assert transpose.transposed_equal(w, out), isa
    finally:
        KERNEL.use_isa(KERNEL.ISA)
    with pytest.raises(ValueError, match="use_isa takes"):
        KERNEL.use_isa("neon")


def test_row_blocks_shared_out_between_threads_in_runs_of_blocks(path, monkeypatch):
    """A matrix in many blocks over the threshold is shared out in runs of consecutive blocks of about the
    same rows; made whole, streamed and compared, it is the transpose, and a difference is found in any run."""
    monkeypatch.setattr(transpose, "_PARALLEL", 1 << 10)
    monkeypatch.setattr(transpose, "WORKERS", 3)
    w = _matrix((70, 36), np.float32, seed=6)
    data = np.frombuffer(w.tobytes(), dtype=np.uint8)
    cuts = [0, 144, 1000, 1001, 4000, 6000, 9000, data.size]           # rows cut between pieces, uneven blocks
    blocks = transpose.RowBlocks.of_bytes([data[a:b] for a, b in zip(cuts, cuts[1:], strict=False)], (70, 36), np.float32)
    runs = transpose._runs(blocks.blocks, 3)
    assert len(runs) == 3 and [item for run in runs for item in run] == blocks.blocks
    assert blocks.transposed().tobytes() == w.T.tobytes()
    assert b"".join(band.tobytes() for band in blocks.transposed_chunks(5 * 70 * 4)) == w.T.tobytes()
    whole = np.ascontiguousarray(w.T)
    assert blocks.equals_transposed(whole)
    for row in (0, 35, 69):
        changed = whole.copy()
        changed.view(np.uint32)[20, row] ^= 1
        assert not blocks.equals_transposed(changed), row


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_the_worker_threads_are_started_again_in_a_forked_child(monkeypatch):
    """The module keeps one pool of threads; a child forked after it was started (multiprocessing's default
    on Linux) has none of them, and must start its own rather than wait forever on the parent's."""
    import os

    monkeypatch.setattr(transpose, "_PARALLEL", 1 << 10)
    w = _matrix((64, 48), np.float32, seed=7)
    assert transpose.transposed_equal(w, np.ascontiguousarray(w.T), threads=2)     # the pool is started
    pid = os.fork()
    if pid == 0:                                       # the child: exit 0 only if the threads work here too
        try:
            out = np.empty((48, 64), np.float32)
            transpose.transpose_into(out, w, threads=2)
            os._exit(0 if out.tobytes() == w.T.tobytes() and transpose.transposed_equal(w, out, threads=2) else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on the parent's threads")
