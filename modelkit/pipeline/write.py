"""The one write path: every file modelkit produces is written, checked and named here.

`write_output` is the mechanism: the writer writes a temporary file (or folder) beside the target
(modelkit.storage.atomic), write-back to disk runs on another thread while it writes and fsync while
the output is verified (the disk's work overlaps both), bytes the writer copies file to file are compared
with their source on a third thread as soon as they are copied (modelkit.storage.copy_check), and only a
verified, synced output is renamed into place. Any error, a
failed verification included, leaves no output and no temporary file. `write_checkpoint` is the
common case: a Checkpoint through its format's writer, read back and checked bit for bit, plus
the graph's outputs and the caller's own checks (`also`).
"""
from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelkit.checkpoint import Checkpoint, LazyTensor
from modelkit.formats import FORMATS, ReadOptions, WriteOptions, load_format, output_folder
from modelkit.pipeline.verify import verify_graph, verify_weights
from modelkit.storage.atomic import WriteBack, atomic_dir, atomic_path, sync_in_background
from modelkit.storage.copy_check import checking_copies

if TYPE_CHECKING:
    from torch import nn

PathLike = str | os.PathLike[str]
ProgressFn = Callable[[int, int], None]
Verify = Callable[[Path], dict[str, Any]]


def write_output(target: PathLike, write: Callable[[Path], None], *, verify: Verify | None, force: bool,
                 folder: bool = False, companions: tuple[str | tuple[str, str], ...] = ()) -> tuple[dict[str, Any] | None, int]:
    """Write through a temporary name, fsync and verify it, rename it to `target`.

    Args:
        target: The output's final path (a folder when `folder`).
        write: Writes the output at the temporary path it is given (which does not exist yet;
            for `folder`, an empty folder).
        verify: Checks the temporary output and returns the result for the report; raising
            leaves no output. None: nothing to check (a plot), the output is still atomic.
        force: Replace an existing `target`.
        folder: The output is a folder (sharded checkpoints), renamed as a whole.
        companions: Sidecar files the writer may add (ONNX external data, Keras's architecture JSON; atomic_path).

    Returns:
        (verification result or None, bytes written).
    """
    target = Path(target)
    opener = atomic_dir(target, force=force) if folder else atomic_path(target, force=force, companions=companions)
    with opener as tmp, checking_copies(tmp if folder else tmp.parent) if verify is not None else nullcontext():
        back = None if folder else WriteBack(tmp.parent)     # the disk writes while the writer still writes
        try:
            write(tmp)                               # a folder's shards are synced as they are finished
        except BaseException:
            if back is not None:
                back.abandon()                       # the writer's error is the one to report
            raise
        if back is not None:
            wait_synced = back.finish()              # disk writes while the CPU verifies
        elif verify is not None:
            wait_synced = sync_in_background(tmp)
        else:                                        # nothing to overlap: the commit fsyncs the folder's files
            def wait_synced(check: bool = True) -> None:
                return None
        result = None
        if verify is not None:
            try:
                result = verify(tmp)
            except BaseException:
                wait_synced(check=False)             # the verification's error is the one to report
                raise
        wait_synced()
        size = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) if tmp.is_dir() else tmp.stat().st_size
    return result, size


def write_checkpoint(ckpt: Checkpoint, target: PathLike, fmt: str, options: WriteOptions | None = None, *,
                     force: bool, verify: bool = True, module: nn.Module | None = None, sharded: bool = False,
                     progress: ProgressFn | None = None,
                     also: Callable[[Path, Checkpoint], dict[str, Any]] | None = None) -> tuple[dict[str, Any] | None, int]:
    """Write `ckpt` as `fmt` through `write_output`, verified. Returns (verify result, bytes).

    Verification reads the output back: every tensor bit-exact; for graph formats with a
    `module`, the file's runtime against `module` within GRAPH_ATOL; then `also(tmp, written)`,
    whose result joins the report (the quantizer's rebuilt-model check).
    """
    target = Path(target)
    options = options or WriteOptions(final_path=target)
    converter = load_format(fmt)
    if FORMATS[fmt].read_only:
        converter.write(ckpt, target, options)      # raises, saying why the format is not written, before any work

    def write(tmp: Path) -> None:
        converter.write(_with_progress(ckpt, progress), tmp, options)

    def check(tmp: Path) -> dict[str, Any]:
        written = converter.read(tmp, ReadOptions(trust=True))   # our own fresh output
        plan = getattr(converter, "verify_plan", None)           # a format's conventions that are not bit-exact
        dropped, rtol = plan(ckpt, options) if plan is not None else (set(), {})
        exceptions = {"dropped": dropped, "rtol": rtol} if dropped or rtol else {}
        result = verify_weights(ckpt, written, label=str(target), **exceptions)
        if FORMATS[fmt].has_graph and module is not None:
            runtime = converter.runnable(tmp, ReadOptions(trust=True))
            outputs = verify_graph(module, runtime, fmt, options, label=str(target))
            result = {**outputs, "tensors_checked": result["tensors_checked"], "weights": "bit-exact"}
        if also is not None:
            result = {**result, **also(tmp, written)}
        return result

    folder = sharded or FORMATS[fmt].folder
    if FORMATS[fmt].folder:
        target = output_folder(target, fmt)
    streamed = not (FORMATS[fmt].has_graph and module is not None) and also is None
    with collections_deferred() if streamed else nullcontext():
        return write_output(target, write, verify=check if verify else None, force=force, folder=folder,
                            companions=() if folder else FORMATS[fmt].companions)


@contextlib.contextmanager
def collections_deferred() -> Iterator[None]:
    """Python's cyclic garbage collector off while weights stream through (as `timeit` does while it
    times), back as it was after. Streaming makes almost no cyclic garbage, but the allocations of its
    hand-offs still trigger collections, and a full one walks every object of the process: with torch
    loaded, about 85 ms with the GIL held (2026-11-28), stalling every thread of the pipeline, once in
    most 1 GiB conversions. Not used where a graph is exported or a model rebuilt (torch makes cyclic
    garbage there). Reference counting still frees everything else at once."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _with_progress(ckpt: Checkpoint, progress: ProgressFn | None) -> Checkpoint:
    """Report bytes as the writer pulls tensors: writers need no progress code of their own."""
    if progress is None:
        return ckpt
    total = max(ckpt.nbytes, 1)
    done = [0]

    def wrap(t: LazyTensor) -> LazyTensor:
        def advance() -> None:
            done[0] += t.nbytes
            progress(min(done[0], total), total)

        def read() -> Any:
            data = t.reader()          # numpy or torch, as the source gives it: LazyTensor checks it
            advance()
            return data
        source_chunks = t.chunks

        def chunks(nbytes: int) -> Iterator[Any]:
            yield from source_chunks(nbytes)
            advance()
        span = None if t.span is None else replace(t.span, copied=advance)     # copied file to file: counted there
        return LazyTensor(t.dtype, t.shape, read, t.source, span=span, equals=t.equals,
                          chunks=None if source_chunks is None else chunks)

    tensors = {n: wrap(t) if isinstance(t, LazyTensor) else replace(t, parts={k: wrap(p) for k, p in t.parts.items()})
               for n, t in ckpt.tensors.items()}
    return Checkpoint(tensors, dict(ckpt.metadata), ckpt.arch, ckpt.assets)
