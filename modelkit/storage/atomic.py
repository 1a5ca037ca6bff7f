"""Write outputs so that a crash, an interrupt or a full disk never leaves a half-written file.

The data goes to a temporary file beside the target (inside a temporary folder of its own), is
flushed and fsynced, and is renamed over the target only when the writer finished without error.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from modelkit.errors import ModelkitError, OutputExistsError


def check_output(path: Path, *, force: bool) -> None:
    """Refuse an existing output unless `force`; refuse a missing parent folder."""
    if path.exists() and not force:
        raise OutputExistsError(path)
    if not path.parent.is_dir():
        raise ModelkitError(f"{path.parent} is not a folder; create it first or choose another output path")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, force: bool = False,
                companions: tuple[str | tuple[str, str], ...] = ()) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync it and rename it to `path`.

    The yielded path has the output's own name inside a new temporary folder beside the target
    (mode 0700, so the name is ours alone), and does not exist yet: the writer creates it. (Handing
    writers an existing empty file would have them open it with O_TRUNC, and ext4 then flushes the
    whole file synchronously at close, its `auto_da_alloc` safeguard for truncate-and-rewrite, so
    nothing else could overlap the write-back; see `WriteBack`.)

    `companions` are suffixes of sidecar files the writer may create next to the output (ONNX
    external data: ".data", giving "m.onnx.data"; "{stem}" names the output without its suffix: OpenVINO's
    "{stem}.bin" gives "m.bin" beside "m.xml"), named as they will be called (`companion_name`); on success each sidecar is renamed into
    place first and the output last, and a sidecar of an earlier output that this one does not have
    is removed. A companion (ending, replacement) names a sidecar that replaces the end of the
    output's name (Keras's architecture beside its weights: (".weights.h5", ".json") makes
    "m.weights.h5" -> "m.json"), for outputs whose name has that ending; an existing one needs `force`
    like the output, and one this output does not write is left alone. On error the temporary folder
    goes, sidecars and all.

    Example:
        >>> with atomic_path("model.safetensors", force=True) as tmp:   # doctest: +SKIP
        ...     tmp.write_bytes(data)
    """
    target = Path(path)
    check_output(target, force=force)
    named = [(name, isinstance(companion, str)) for companion in companions
             if (name := companion_name(target, companion)) is not None]
    for name, appended in named:
        if not appended and not force and target.with_name(name).exists():
            raise OutputExistsError(target.with_name(name))
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    tmp = folder / target.name
    try:
        yield tmp
        if not tmp.is_file():
            raise ModelkitError(f"internal error: the writer left no file at {tmp}")
        for name, appended in named:
            sidecar, final = folder / name, target.with_name(name)
            if sidecar.is_file():
                _commit(sidecar, final)
            elif appended and final.is_file():     # the earlier output's sidecar: not this one's
                final.unlink()
        os.chmod(tmp, 0o666 & ~_umask())
        _commit(tmp, target)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def companion_name(target: Path, companion: str | tuple[str, str]) -> str | None:
    """The name of `target`'s sidecar: "<name><suffix>", or the suffix with "{stem}" filled in; for a
    companion (ending, replacement), the name with that ending replaced, None when it lacks the ending."""
    if isinstance(companion, str):
        return companion.format(stem=target.stem) if "{stem}" in companion else f"{target.name}{companion}"
    ending, replacement = companion
    name = target.name
    return f"{name.removesuffix(ending)}{replacement}" if name.endswith(ending) and name != ending else None


def sync_in_background(path: Path) -> Callable[..., None]:
    """Start fsyncing a written file (or a folder's files) on another thread; returns `wait`.

    Write-back of a large output is mostly waiting on the disk; verification meanwhile reads the
    same pages from the page cache and compares them on the CPU, so the two overlap. `wait()` joins
    the thread and raises what fsync raised (a full disk can surface only here); `wait(check=False)`
    only joins (when another error is already on its way). The commit's own fsync then has nothing
    left to write.
    """
    failure: list[BaseException] = []

    def sync() -> None:
        try:
            fsync_files([path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()))
        except OSError as e:
            failure.append(e)

    thread = threading.Thread(target=sync, name="modelkit-fsync", daemon=True)
    thread.start()

    def wait(check: bool = True) -> None:
        thread.join()
        if failure and check:
            raise failure[0]

    return wait


_WRITE_BACK_EVERY = 0.025    # seconds between write-back starts of a file still being written


class WriteBack:
    """Writes a single-file output's dirty pages to disk on another thread from the moment its writer
    starts (`folder` is the output's temporary folder), then, once `finish` is called, fsyncs it while the
    caller verifies it.

    Without this, write-back of a large output starts only at the fsync after the writer finished
    (the kernel's own flusher waits for 10% of memory to be dirty, or 30 s), so the output is written
    twice in a row: into the page cache, then to disk. `cp` followed by `sync` does the same; folder
    outputs already overlap the two (finished shards are fsynced while the next is written:
    `file_finished`), and a single file does too, from its start.

    While the writer writes, write-back is only started (`_write_back`: sync_file_range(2) with
    SYNC_FILE_RANGE_WRITE on Linux) every _WRITE_BACK_EVERY seconds: the thread never waits for the disk,
    so the disk's queue is refilled while it still works, and no cache flush or inode write is issued per
    round (an fdatasync every 50 ms, as before, made each round wait for its pages and flush the disk's
    cache, and left the disk idle while it slept). `finish()` then fsyncs every file in the folder through
    the descriptors held since the file appeared, so an error of any earlier write-back is reported there
    (a later fsync on a new descriptor may not see it), and returns `wait`: `wait()` joins the thread and
    raises the first error (a full disk can surface only here), `wait(check=False)` only joins (when another
    error is already on its way). What is in the file, and when it is renamed, stays the writer's and the
    commit's business (the commit fsyncs every file again: nothing is left to write by then).
    """

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._finished = threading.Event()
        self._abandoned = False
        self._failure: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="modelkit-write-back", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        opened: dict[Path, int] = {}
        try:
            while True:
                last = self._finished.is_set()          # the writer is done: every file is complete
                if self._abandoned:
                    return
                for file in sorted(self._folder.iterdir()):
                    if file not in opened and file.is_file():
                        try:
                            opened[file] = os.open(file, os.O_RDONLY)
                        except FileNotFoundError:
                            continue                   # gone again (the writer's own temporary file)
                for fd in opened.values():
                    if not last:
                        _write_back(fd)
                    elif os.fstat(fd).st_nlink:         # not a temporary file the writer removed
                        os.fsync(fd)
                if last:
                    return
                self._finished.wait(_WRITE_BACK_EVERY)
        except OSError as e:
            self._failure = e
        finally:
            for fd in opened.values():
                os.close(fd)

    def finish(self) -> Callable[..., None]:
        """The writer is done: fsync every file now; returns `wait`."""
        self._finished.set()
        return self.wait

    def abandon(self) -> None:
        """The writer failed: stop, syncing nothing more (the output is about to be removed)."""
        self._abandoned = True
        self.wait(check=False)

    def wait(self, check: bool = True) -> None:
        self._finished.set()
        self._thread.join()
        if self._failure is not None and check:
            raise self._failure


_SYNC_FILE_RANGE_WRITE = 2        # <linux/fs.h>; Python's os module has no sync_file_range


@functools.cache
def _write_back_call() -> Callable[[int], None]:
    """sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE) from the C library where there is one (Linux),
    else fdatasync (fsync on macOS, which has no fdatasync): there the round waits for its pages."""
    fallback = getattr(os, "fdatasync", os.fsync)
    if not sys.platform.startswith("linux"):
        return fallback
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return fallback
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int

    def start(fd: int) -> None:
        if call(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    return start


def _write_back(fd: int) -> None:
    """Start writing a file's dirty pages to disk."""
    _write_back_call()(fd)


_SYNC_THREADS = 8


def fsync_files(files: list[Path]) -> None:
    """fsync every file, several at a time: a journaling filesystem (ext4's jbd2) commits the fsyncs that
    arrive together in one transaction, where one after another each waits for a commit of its own (256
    4 MiB shards: about 3x faster with 8 threads, measured 2026-11-25 on the 2-core VM). Raises the first
    error."""
    def sync(file: Path) -> None:
        with open(file, "rb") as f:
            os.fsync(f.fileno())

    if len(files) <= 1:
        for file in files:
            sync(file)
        return
    with ThreadPoolExecutor(max_workers=min(_SYNC_THREADS, len(files)), thread_name_prefix="modelkit-fsync") as pool:
        for _ in pool.map(sync, files):
            pass


def _commit(tmp: Path, target: Path) -> None:
    """fsync `tmp`, rename it over `target`, persist the rename."""
    if tmp.is_dir():
        raise ModelkitError(f"internal error: {tmp} became a folder")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    if target.is_dir():
        raise ModelkitError(f"{target} is a folder; choose a file name for the output")
    os.replace(tmp, target)
    _fsync_dir(target.parent)


class _ShardSync:
    """fsyncs the finished files of a folder output on threads of their own while the writer writes the next.

    A sharded output is many files; each is complete long before the last one is, so its write-back
    to disk can overlap the writing of the rest instead of all of it waiting for the end. Up to
    _SYNC_THREADS files are synced at a time, for fsync_files' reason (fsyncs that arrive together share
    a journal commit): one at a time, each waited for a commit of its own and the syncs fell behind the
    writer (a 1 GiB TF.js model, 257 shards: up to 1 s after its last shard was written, 2026-11-28).
    """

    def __init__(self) -> None:
        self.failure: OSError | None = None
        self._pool = ThreadPoolExecutor(max_workers=_SYNC_THREADS, thread_name_prefix="modelkit-shard-fsync")

    def _sync(self, file: Path) -> None:
        if self.failure is not None:
            return
        try:
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        except OSError as e:                     # reported at the commit: a later fsync may not see it
            self.failure = self.failure or e

    def submit(self, file: Path) -> None:
        self._pool.submit(self._sync, file)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_folder_syncs: dict[Path, _ShardSync] = {}


def file_finished(file: Path) -> None:
    """A writer closed `file` for good: if it belongs to a folder output being written, start its
    write-back now (shards of safetensors folders, TF.js weight groups). Elsewhere nothing happens."""
    sync = _folder_syncs.get(Path(file).parent)
    if sync is not None:
        sync.submit(Path(file))


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str], *, force: bool = False) -> Iterator[Path]:
    """Like atomic_path, for outputs that are a folder (sharded checkpoints). Files the writer
    reports through `file_finished` are fsynced while it writes the rest."""
    target = Path(path)
    check_output(target, force=force)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    _folder_syncs[tmp] = early = _ShardSync()
    try:
        try:
            yield tmp
        finally:
            _folder_syncs.pop(tmp, None)
            early.close()
        if early.failure is not None:
            raise early.failure
        fsync_files(sorted(tmp.iterdir()))
        if target.exists():
            backup = target.with_name(f".{target.name}.old")
            os.replace(target, backup)
            os.replace(tmp, target)
            shutil.rmtree(backup) if backup.is_dir() else backup.unlink()
        else:
            os.replace(tmp, target)
        _fsync_dir(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    # Persist the rename itself; not every platform lets a folder be opened for this.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
