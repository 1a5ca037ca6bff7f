"""crc32c of tensor bytes (TensorFlow checkpoints): modelkit's vectorized crc against baselines, as ratios.

TensorFlow's bundle entries carry a crc32c of each tensor; modelkit checks it on every load
(modelkit/storage/checksums.py). Baselines, run in the same process on the same bytes: zlib.crc32 (C, another
polynomial: the speed a native crc reaches) and the byte-at-a-time pure-Python crc32c (modelkit.parse.tf_bundle,
what the index blocks use). Prints MB/s for each and modelkit's time as a ratio to each baseline.

    .venv/bin/python bench/crc32c.py [--mb 64]
"""
from __future__ import annotations

import argparse
import time
import zlib

import numpy as np

from modelkit.parse.tf_bundle import crc32c as crc32c_bytes
from modelkit.storage.checksums import crc32c


def _best(fn, data, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn(data)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64)
    args = parser.parse_args()
    data = np.random.default_rng(0).integers(0, 256, args.mb << 20, dtype=np.uint8).tobytes()
    small = data[:1 << 20]
    assert crc32c(small) == crc32c_bytes(small)
    ours = _best(crc32c, data)
    native = _best(zlib.crc32, data)
    python = _best(crc32c_bytes, small, repeat=1) * (len(data) / len(small))
    mb = len(data) / 1e6
    print(f"{args.mb} MiB: modelkit crc32c {mb / ours:.0f} MB/s | zlib.crc32 (C) {mb / native:.0f} MB/s | "
          f"pure-Python crc32c {mb / python:.1f} MB/s (extrapolated from 1 MiB)")
    print(f"modelkit / zlib: {ours / native:.1f}x the time; modelkit / pure Python: {ours / python:.3f}x the time")


if __name__ == "__main__":
    main()
