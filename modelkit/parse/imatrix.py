"""llama.cpp importance-matrix files (what `llama-imatrix` writes, `llama-quantize --imatrix` reads), both forms.

GGUF form (llama-imatrix's default since 2025; tools/imatrix/imatrix.cpp, common/imatrix-loader.cpp):

    metadata   general.type = "imatrix" | imatrix.datasets [string] | imatrix.chunk_count u32
               | imatrix.chunk_size u32 (tokens per chunk)
    tensors    per weight W (its GGUF name, e.g. blk.0.attn_q.weight), both F32:
               W.in_sum2  dims (n, n_mat): sum over the tokens seen of each input column's squared activation
               W.counts   dims (1, n_mat): how many tokens (rows of activations) each matrix saw

Legacy .dat form (all little-endian, int32 counts):

    i32 n_entries | n_entries x (i32 name length | name | i32 ncall | i32 nval | f32 values[nval])
    | optional: i32 chunk count | i32 dataset length | dataset name
    values are mean squared activations times ncall (the number of chunks)

`read_imatrix` checks every length against the bytes it was given (the GGUF header through
modelkit.parse.gguf) and raises only ParseError. `Entry.importance` is what llama-quantize hands
ggml_quantize_chunk: sums divided by counts per matrix (1 where a matrix saw nothing), or for the
legacy form the values divided by ncall. Standard library and numpy.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from modelkit.errors import ParseError
from modelkit.parse import gguf

DATASETS_KEY, CHUNK_COUNT_KEY, CHUNK_SIZE_KEY = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"
TYPE_KEY = "general.type"
SUMS_SUFFIX, COUNTS_SUFFIX = ".in_sum2", ".counts"
_F32 = 0
MAX_ENTRIES = 1 << 20           # a model has a few thousand weights


@dataclass(frozen=True)
class Entry:
    """One weight's statistics: `sums` float32 (n_mat, n); `counts` (n_mat,), tokens per matrix (GGUF) or the
    call count (legacy, one value)."""

    sums: np.ndarray
    counts: np.ndarray
    legacy: bool = False

    @property
    def importance(self) -> np.ndarray:
        """One float32 weight per column (n_mat * n values), as llama-quantize normalizes the file."""
        if self.legacy:
            ncall = int(self.counts[0]) if self.counts.size else 0
            flat = self.sums.reshape(-1)
            return flat / np.float32(ncall) if ncall > 0 else flat.copy()
        out = np.ones_like(self.sums, dtype=np.float32)
        for j, count in enumerate(self.counts):
            c = np.float32(round(float(count)))           # std::lround, then float
            if c > 0:
                out[j] = self.sums[j] / c
        return out.reshape(-1)


@dataclass(frozen=True)
class Imatrix:
    """A parsed importance-matrix file."""

    entries: dict[str, Entry]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = False
    has_metadata: bool = False


def read_imatrix(buf, *, source: str | None = None) -> Imatrix:
    """Parse an importance-matrix file's bytes (GGUF form when it starts with b"GGUF", else legacy).

    Raises:
        ParseError: the bytes do not hold a well-formed file of either form (with `source` named).
    """
    try:
        if bytes(buf[:4]) == gguf.MAGIC:
            return _read_gguf(buf)
        return _read_legacy(buf)
    except ParseError as e:
        if source and e.source is None:
            raise ParseError(e.reason, offset=e.offset, source=source) from None
        raise


def _read_gguf(buf) -> Imatrix:
    header = gguf.read_header(buf, arrays=frozenset({DATASETS_KEY}))
    if not header.tensors:
        raise ParseError("the importance matrix holds no tensors")
    values = header.values
    datasets = values.get(DATASETS_KEY)
    datasets = [d for d in datasets if isinstance(d, str)] if isinstance(datasets, list) else []
    pairs: dict[str, dict[str, gguf.TensorInfo]] = {}
    for t in header.tensors:
        for suffix in (SUMS_SUFFIX, COUNTS_SUFFIX):
            if t.name.endswith(suffix) and len(t.name) > len(suffix):
                pairs.setdefault(t.name[:-len(suffix)], {})[suffix] = t
    entries: dict[str, Entry] = {}
    for name, pair in sorted(pairs.items()):
        sums, counts = pair.get(SUMS_SUFFIX), pair.get(COUNTS_SUFFIX)
        if sums is None or counts is None:
            raise ParseError(f"{name!r} has {'no ' + SUMS_SUFFIX if sums is None else 'no ' + COUNTS_SUFFIX} "
                             f"tensor beside its other one")
        if sums.ggml_type != _F32 or counts.ggml_type != _F32:
            raise ParseError(f"the sums and counts of {name!r} must be F32")
        sum_values, count_values = _f32(buf, header, sums), _f32(buf, header, counts)
        n_mat = count_values.size
        if n_mat == 0 or sum_values.size % n_mat:
            raise ParseError(f"{name!r}: {sum_values.size} sums do not split into {n_mat} matrices")
        if not np.isfinite(count_values).all():
            raise ParseError(f"{name!r}: its counts are not finite")
        entries[name] = Entry(sum_values.reshape(n_mat, -1), count_values.astype(np.float64))
    has_metadata = all(k in values for k in (DATASETS_KEY, CHUNK_COUNT_KEY, CHUNK_SIZE_KEY))
    return Imatrix(entries, datasets, _u32(values.get(CHUNK_COUNT_KEY)), _u32(values.get(CHUNK_SIZE_KEY)),
                   legacy=False, has_metadata=has_metadata)


def _u32(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _f32(buf, header: gguf.Header, t: gguf.TensorInfo) -> np.ndarray:
    """A tensor's float32 values (its extent was checked against the file by read_header)."""
    start = header.data_start + t.offset
    return np.frombuffer(bytes(buf[start:start + t.nbytes]), dtype="<f4").astype(np.float32)


def _read_legacy(buf) -> Imatrix:
    pos, end = 0, len(buf)

    def take(n: int, what: str) -> int:
        nonlocal pos
        if n < 0 or n > end - pos:
            raise ParseError(f"{what} needs {n} bytes but only {end - pos} remain; the file is truncated or not an "
                             f"importance matrix", offset=pos)
        at, pos = pos, pos + n
        return at

    def i32(what: str) -> int:
        return struct.unpack_from("<i", buf, take(4, what))[0]

    n_entries = i32("the entry count")
    if not 1 <= n_entries <= MAX_ENTRIES or n_entries * 13 > end - pos:
        raise ParseError(f"not an importance matrix: {n_entries} entries claimed in {end} bytes", offset=0)
    entries: dict[str, Entry] = {}
    for _ in range(n_entries):
        length = i32("a name length")
        at = take(length, "a name")
        try:
            name = bytes(buf[at:at + length]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ParseError(f"an entry's name is not UTF-8 ({e.reason})", offset=at) from None
        ncall, nval = i32("a call count"), i32("a value count")
        if nval < 1:
            raise ParseError(f"entry {name[:60]!r} claims {nval} values", offset=pos)
        at = take(4 * nval, f"the {nval} values of {name[:60]!r}")
        sums = np.frombuffer(bytes(buf[at:at + 4 * nval]), dtype="<f4").astype(np.float32)
        entries[name] = Entry(sums.reshape(1, -1), np.array([ncall], dtype=np.float64), legacy=True)
    chunk_count, datasets = 0, []
    if end - pos >= 4:                      # the optional trailer: chunk count, then the dataset's name
        chunk_count = i32("the chunk count")
        if end - pos >= 4:
            length = i32("the dataset name length")
            if length > 0:
                at = take(length, "the dataset name")
                datasets.append(bytes(buf[at:at + length]).split(b"\0")[0].decode("utf-8", "replace"))
    return Imatrix(entries, datasets, max(chunk_count, 0), 0, legacy=True, has_metadata=False)
