"""Large output buffers backed by transparent huge pages.

A new buffer costs one page fault per 4 KiB page on first touch; in a virtual machine each fault
is expensive (measured here: 68 MiB of fresh pages take about 60 ms to touch, more than our whole
q8_0 quantization of the 256 MB that produce them). Linux backs a 2 MiB-aligned range that is
madvise(MADV_HUGEPAGE)'d with 2 MiB pages when /sys/kernel/mm/transparent_hugepage/enabled says
"madvise" or "always" (the same 68 MiB: about 8 ms). PyTorch's own allocator does this only
when THP_MEM_ALLOC_ENABLE=1 is set before it starts, which a library cannot rely on.

The buffer is also populated up front, in one madvise(MADV_POPULATE_WRITE) call (Linux 5.14+):
two threads first-touching fresh huge pages at once were measured here at 94-138 ms for 68 MiB
(page faults serialized in the VM), against 3-10 ms for populating it in one call.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np

HUGE_PAGE = 2 * 2**20
_MIN_BYTES = 4 * HUGE_PAGE          # below this the saving is too small to be worth an mmap
# Not in Python 3.11's mmap module; 23 in Linux's uapi headers
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)


def empty_bytes(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 array of `nbytes`, on huge pages where the system allows it, populated.

    The array owns its memory (an anonymous mmap kept alive as the array's base; torch.from_numpy
    shares it); falls back to np.empty for small sizes and where madvise or MADV_HUGEPAGE is not available.
    """
    if nbytes < _MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(nbytes, dtype=np.uint8)
    # MAP_PRIVATE: an anonymous shared mapping is shmem, whose huge pages follow other settings
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -address % HUGE_PAGE                                  # first 2 MiB boundary
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % HUGE_PAGE)
    except OSError:                                                 # THP disabled: ordinary pages
        pass
    if _POPULATE_WRITE is not None:
        try:
            region.madvise(_POPULATE_WRITE, offset, nbytes)
        except OSError:                                             # before Linux 5.14: faults on first touch
            pass
    return np.frombuffer(region, dtype=np.uint8, offset=offset, count=nbytes)
