"""Writes one step behind the code making the data, in calls the page cache takes quickly (storage.write_behind)."""
from __future__ import annotations

import io
import threading

import pytest

from modelkit.storage.write_behind import WRITE_SIZE, WriteBehind, write_all


class _Calls(io.BytesIO):
    """A file that remembers the size of each write call."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def write(self, data) -> int:
        self.sizes.append(len(data))
        return super().write(data)


def test_write_all_writes_everything_in_calls_of_at_most_write_size():
    data = bytes(range(256)) * (WRITE_SIZE // 256 * 2 + 3)          # two whole calls and 768 bytes
    out = _Calls()
    write_all(out, data)
    assert out.getvalue() == data and out.sizes == [WRITE_SIZE, WRITE_SIZE, 768]
    write_all(out, b"")
    assert out.sizes == [WRITE_SIZE, WRITE_SIZE, 768]


def test_each_write_returns_once_the_one_before_is_done_and_errors_surface():
    started, release, done = threading.Event(), threading.Event(), []

    def sink(item):
        if item == 0:
            started.set()
            release.wait(5)
        done.append(item)

    with WriteBehind(sink) as behind:
        behind.write(0)                      # in flight, held by the sink
        started.wait(5)
        threading.Timer(0.05, release.set).start()
        behind.write(1)                      # returns only once 0 is written
        assert done[:1] == [0]
    assert done == [0, 1]

    def fail(item):
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left"), WriteBehind(fail) as behind:
        behind.write(b"x")
