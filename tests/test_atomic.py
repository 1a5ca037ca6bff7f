"""The atomic write layer: folder outputs fsync finished shards early, and a failed fsync is never lost."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from modelkit.storage import atomic


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch, fail_for: str | None = None) -> list[str]:
    """Replace os.fsync with one that records the file name of each regular file it syncs."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        if fail_for is not None and name == fail_for:
            raise OSError(5, "Input/output error")
        synced.append(name)
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    return synced


def test_finished_shards_are_synced_while_the_folder_is_still_being_written(tmp_path, monkeypatch):
    synced = _record_fsyncs(monkeypatch)
    target = tmp_path / "out"
    with atomic.atomic_dir(target) as tmp:
        (tmp / "shard-1").write_bytes(b"a" * 4096)
        atomic.file_finished(tmp / "shard-1")
        for _ in range(200):                        # the background thread picks it up
            if "shard-1" in synced:
                break
            threading.Event().wait(0.01)
        assert "shard-1" in synced and "shard-2" not in synced
        (tmp / "shard-2").write_bytes(b"b" * 4096)
    assert sorted(p.name for p in target.iterdir()) == ["shard-1", "shard-2"]
    assert "shard-2" in synced                      # the commit still syncs every file


def test_a_failed_early_fsync_fails_the_write_and_leaves_no_output(tmp_path, monkeypatch):
    _record_fsyncs(monkeypatch, fail_for="shard-1")
    target = tmp_path / "out"
    with pytest.raises(OSError, match="Input/output error"), atomic.atomic_dir(target) as tmp:
        (tmp / "shard-1").write_bytes(b"a")
        atomic.file_finished(tmp / "shard-1")
        (tmp / "shard-2").write_bytes(b"b")
    assert not target.exists()
    assert not [p for p in tmp_path.iterdir()]     # the temporary folder is gone too


def test_file_finished_outside_a_folder_output_does_nothing(tmp_path, monkeypatch):
    synced = _record_fsyncs(monkeypatch)
    (tmp_path / "loose").write_bytes(b"x")
    atomic.file_finished(tmp_path / "loose")
    assert synced == []


def _record_write_backs(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> list[int]:
    """Replace the write-back start (sync_file_range on Linux) with one that records the size of the file it
    starts writing back (or fails with EIO)."""
    sizes: list[int] = []
    real = atomic._write_back

    def write_back(fd: int) -> None:
        sizes.append(os.fstat(fd).st_size)
        if fail:
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(atomic, "_write_back", write_back)
    monkeypatch.setattr(atomic, "_WRITE_BACK_EVERY", 0.001)
    return sizes


def _two_halves(sizes: list[int], *, synced: int = 4096):
    """A writer that writes half its file, waits until the write-back thread started writing back `synced`
    bytes of it (0: tried to at all), writes the rest."""
    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            f.write(b"a" * 4096)
            f.flush()
            for _ in range(500):
                if sizes and max(sizes) >= synced:
                    break
                threading.Event().wait(0.01)
            f.write(b"b" * 4096)
    return write


def test_a_single_file_is_written_back_while_it_is_still_being_written(tmp_path, monkeypatch):
    from modelkit.pipeline.write import write_output

    sizes = _record_write_backs(monkeypatch)
    synced = _record_fsyncs(monkeypatch)
    write_output(tmp_path / "out.bin", _two_halves(sizes), verify=None, force=False)
    assert 4096 in sizes                             # the first half went to disk before the writer finished
    assert synced.count("out.bin") == 2              # then fsynced by the write-back thread, and by the commit
    assert (tmp_path / "out.bin").read_bytes() == b"a" * 4096 + b"b" * 4096


def test_the_kernel_write_back_start_runs_on_a_real_file(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 8192)
    fd = os.open(tmp_path / "f", os.O_RDWR)
    try:
        os.pwrite(fd, b"y" * 4096, 0)                # a dirty page to start writing back
        atomic._write_back(fd)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"y" * 4096 + b"x" * 4096


def test_a_failed_write_back_fails_the_write_and_leaves_no_output(tmp_path, monkeypatch):
    from modelkit.pipeline.write import write_output

    tried = _record_write_backs(monkeypatch, fail=True)
    with pytest.raises(OSError, match="Input/output error"):
        write_output(tmp_path / "out.bin", _two_halves(tried, synced=0), verify=None, force=False)
    assert tried
    assert not list(tmp_path.iterdir())              # neither the output nor the temporary folder


def test_a_failed_final_fsync_fails_a_verified_write_after_the_check(tmp_path, monkeypatch):
    from modelkit.pipeline.write import write_output

    real = os.fsync

    def fsync(fd: int) -> None:          # fails on the write-back thread only: the commit's own fsync would pass
        if threading.current_thread().name == "modelkit-write-back":
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    checked: list[bytes] = []
    with pytest.raises(OSError, match="Input/output error"):
        write_output(tmp_path / "out.bin", lambda tmp: tmp.write_bytes(b"z" * 4096),
                     verify=lambda tmp: checked.append(tmp.read_bytes()) or {}, force=False)
    assert checked == [b"z" * 4096]                  # the check ran while the fsync was on its way
    assert not list(tmp_path.iterdir())


def test_a_failed_writer_leaves_no_output_and_its_error_is_the_one_raised(tmp_path, monkeypatch):
    from modelkit.pipeline.write import write_output

    synced = _record_fsyncs(monkeypatch)

    def write(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise ValueError("the writer broke")

    with pytest.raises(ValueError, match="the writer broke"):
        write_output(tmp_path / "out.bin", write, verify=None, force=False)
    assert "out.bin" not in synced                   # abandoned: nothing synced for an output that goes
    assert not list(tmp_path.iterdir())


def test_weights_stream_with_the_cyclic_collector_off_and_it_comes_back_as_it_was(tmp_path, monkeypatch):
    """write_checkpoint defers collections while a weight format is written and verified, and leaves the
    collector as it found it: on, off, or on after a failed write."""
    import gc

    import torch

    from modelkit.checkpoint import Checkpoint
    from modelkit.formats import load_format
    from modelkit.pipeline.write import write_checkpoint

    converter = load_format("safetensors")
    seen = []
    real_write = converter.write

    def write(ckpt, path, options):
        seen.append(gc.isenabled())
        real_write(ckpt, path, options)
    monkeypatch.setattr(converter, "write", write)
    ckpt = Checkpoint.from_state_dict({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    assert gc.isenabled()
    write_checkpoint(ckpt, tmp_path / "a.safetensors", "safetensors", force=False)
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        write_checkpoint(ckpt, tmp_path / "b.safetensors", "safetensors", force=False)
        assert not gc.isenabled()
    finally:
        gc.enable()

    def fail(ckpt, path, options):
        raise OSError("disk full")
    monkeypatch.setattr(converter, "write", fail)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(ckpt, tmp_path / "c.safetensors", "safetensors", force=False)
    assert gc.isenabled() and not (tmp_path / "c.safetensors").exists()
