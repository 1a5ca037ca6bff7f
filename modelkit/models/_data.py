"""The reference models' data: generated 2-D points, the 8x8 digits, standard-library source text.

Nothing here downloads: the 2-D data is generated from a seed, the digits ship in `fixtures/`,
and the text is the running Python's own standard library.
"""
from __future__ import annotations

import csv
import functools
import gzip
import io
import math
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

from modelkit.errors import ConfigError, FormatError

SPLITS = ("train", "val", "test")
DIGITS_FILE = "digits.csv.gz"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")


# --- mlp: two interleaved spirals -------------------------------------------------------------

def spirals(n_points: int, *, seed: int, noise: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaved spiral arms in 2-D (the classic MLP toy problem): (N, 2) float32, (N,) int64."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n_points) % 2
    t = torch.rand(n_points, generator=g) * 2.5 * math.pi + 0.5              # angle along the arm
    r = t / (3.0 * math.pi)                                                   # radius grows with angle
    angle = t + math.pi * labels                                              # arm 1 is arm 0 turned by pi
    points = torch.stack((r * torch.cos(angle), r * torch.sin(angle)), dim=1)
    points = points + noise * r.unsqueeze(1) * torch.randn(n_points, 2, generator=g) * 0.5
    return points.float() * 2.0, labels


@functools.lru_cache(maxsize=4)
def _spiral_splits(seed: int) -> dict[str, TensorDataset]:
    x, y = spirals(6000, seed=seed)
    bounds = {"train": (0, 4000), "val": (4000, 5000), "test": (5000, 6000)}
    return {name: TensorDataset(x[a:b], y[a:b]) for name, (a, b) in bounds.items()}


def spiral_split(split: str, *, data_seed: int = 1234) -> TensorDataset:
    """6,000 points from a fixed data seed, split 4,000 / 1,000 / 1,000."""
    check_split(split)
    return _spiral_splits(data_seed)[split]


# --- cnn: UCI optical recognition of handwritten digits (8x8) ---------------------------------

def _digits_candidates() -> list[Path]:
    here = Path(__file__).resolve()
    candidates = []
    if os.environ.get("MODELKIT_DATA_DIR"):
        candidates.append(Path(os.environ["MODELKIT_DATA_DIR"]) / DIGITS_FILE)
    candidates.append(here.parents[2] / "fixtures" / DIGITS_FILE)            # source checkout / editable
    candidates.append(Path(sys.prefix) / "share" / "modelkit" / DIGITS_FILE)  # wheel install (data-files)
    return candidates


@functools.lru_cache(maxsize=1)
def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits: (N, 1, 8, 8) float32 in [0, 1] and (N,) int64 labels."""
    for path in _digits_candidates():
        if path.is_file():
            break
    else:
        searched = ", ".join(str(p) for p in _digits_candidates())
        raise FormatError(DIGITS_FILE, f"digits data not found (looked in {searched}); "
                                       "set MODELKIT_DATA_DIR to the folder holding it")
    rows = list(csv.reader(io.TextIOWrapper(gzip.open(path, "rb"), encoding="ascii")))
    if len(rows) != 1797 or any(len(r) != 65 for r in rows):
        raise FormatError(path, "expected 1,797 rows of 64 pixels and a label; the file is damaged")
    table = torch.tensor([[int(v) for v in r] for r in rows], dtype=torch.int64)
    images = (table[:, :64].float() / 16.0).reshape(-1, 1, 8, 8)              # pixels are counts 0..16
    return images, table[:, 64].clone()


def digits_split(split: str, *, data_seed: int = 1234) -> TensorDataset:
    """A fixed shuffle of the 1,797 digits, split 1,257 / 270 / 270 (70 / 15 / 15 percent)."""
    check_split(split)
    images, labels = load_digits()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(data_seed))
    bounds = {"train": (0, 1257), "val": (1257, 1527), "test": (1527, 1797)}
    a, b = bounds[split]
    return TensorDataset(images[order[a:b]], labels[order[a:b]])


# --- tinylm: the standard library's own .py files ---------------------------------------------

def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _split_of(relative: str) -> str:
    # Split by file, by a stable hash of its path: 90 / 5 / 5 percent, the same on every machine.
    bucket = zlib.crc32(relative.encode()) % 20
    return "val" if bucket == 0 else "test" if bucket == 1 else "train"


@functools.lru_cache(maxsize=8)
def stdlib_corpus(split: str, *, max_bytes: int = 4_000_000) -> bytes:
    """Concatenated source of the standard library's .py files in one split, capped at `max_bytes`.

    Third-party packages (site-packages) are left out so the text is the same for every
    installation of a Python version. Files are taken in a hash order, so the cap keeps a
    mix of the whole library rather than its first folders.
    """
    check_split(split)
    root = stdlib_dir()
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("site-packages/") or "/site-packages/" in relative:
            continue
        if _split_of(relative) == split:
            files.append((zlib.crc32(relative.encode(), 7), relative, path))
    files.sort()
    chunks, total = [], 0
    for _, _, path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FormatError(root, "no Python source files found for the tinylm corpus")
    return b"\n".join(chunks)[:max_bytes]


@dataclass(frozen=True)
class ByteBlocks(Dataset):
    """Non-overlapping windows of `block + 1` bytes: inputs are the first `block`, targets the last."""

    data: bytes
    block: int

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.block)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block
        window = torch.frombuffer(bytearray(self.data[start:start + self.block + 1]), dtype=torch.uint8).long()
        return window[:-1], window[1:]


def unigram_bits_per_byte(train: bytes, evaluate: bytes) -> float:
    """Cross-entropy in bits per byte of `evaluate` under add-one-smoothed byte frequencies of `train`."""
    counts = torch.bincount(torch.frombuffer(bytearray(train), dtype=torch.uint8).long(), minlength=256).double() + 1
    log_p = torch.log2(counts / counts.sum())
    seen = torch.bincount(torch.frombuffer(bytearray(evaluate), dtype=torch.uint8).long(), minlength=256).double()
    return float(-(seen * log_p).sum() / seen.sum())
