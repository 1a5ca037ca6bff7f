"""modelkit.storage.memory.empty_bytes: big output buffers (huge pages, populated up front) behave as arrays and tensors."""
from __future__ import annotations

import platform
import re
import sys

import numpy as np
import pytest
import torch

from modelkit.storage.memory import HUGE_PAGE, empty_bytes


@pytest.mark.parametrize("nbytes", [0, 1, 4096, 4 * HUGE_PAGE - 1, 4 * HUGE_PAGE, 9 * HUGE_PAGE + 12345])
def test_sizes_and_writes(nbytes):
    buffer = empty_bytes(nbytes)
    assert buffer.shape == (nbytes,) and buffer.dtype == np.uint8 and buffer.flags.c_contiguous
    buffer.fill(7)
    assert int(buffer.sum(dtype=np.int64)) == 7 * nbytes
    shared = torch.from_numpy(buffer)                          # gguf_blocks' output: a tensor on the same memory
    shared.fill_(3)
    assert int(buffer.sum(dtype=np.int64)) == 3 * nbytes


def _linux_at_least(major: int, minor: int) -> bool:
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return sys.platform.startswith("linux") and bool(found) and tuple(map(int, found.groups())) >= (major, minor)


@pytest.mark.skipif(not _linux_at_least(5, 14), reason="MADV_POPULATE_WRITE is Linux 5.14+")
def test_large_buffers_start_resident_and_aligned():
    """Populated up front: the process's resident memory grows by the buffer before any write."""
    def resident_bytes() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    before = resident_bytes()
    buffer = empty_bytes(32 * HUGE_PAGE)
    grown = resident_bytes() - before
    assert buffer.ctypes.data % HUGE_PAGE == 0                 # 2 MiB-aligned: eligible for huge pages
    assert grown >= 0.9 * 32 * HUGE_PAGE, f"only {grown} bytes resident"
