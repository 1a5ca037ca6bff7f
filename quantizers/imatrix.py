"""Importance matrices for GGUF quantization: llama.cpp's imatrix files, read for quantizing and written.

An importance matrix holds, for each weight matrix W that llama.cpp multiplies activations by (its
GGUF name, e.g. blk.0.ffn_down.weight), the sum over calibration tokens of each input column's squared
activation and the number of tokens. Quantizing W's rows then weighs each column's error by that mean
(ggml_quantize_chunk's `imatrix`), which keeps the columns that carry signal more exact. The file
layouts and the normalization llama-quantize applies are in modelkit.parse.imatrix (the one reader of
these bytes); this module adds the file handling, llama.cpp's rules for looking an entry up, and
the writer (GGUF form, as current llama-imatrix writes it). Torch-free.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modelkit.errors import ConfigError, FormatError
from modelkit.parse import imatrix as parse_imatrix
from modelkit.parse.imatrix import CHUNK_COUNT_KEY, CHUNK_SIZE_KEY, COUNTS_SUFFIX, DATASETS_KEY, SUMS_SUFFIX, TYPE_KEY
from modelkit.parse.paths import read_capped
from modelkit.storage.atomic import atomic_path

logger = logging.getLogger(__name__)
MAX_BYTES = 4 << 30             # the largest models' imatrix files are a few hundred MB
TOKEN_EMBD = "token_embd.weight"


@dataclass(frozen=True)
class Importance:
    """The importance vectors of one file, by GGUF weight name, normalized as llama-quantize does."""

    path: str
    vectors: dict[str, np.ndarray]
    datasets: tuple[str, ...]
    chunk_count: int
    legacy: bool

    def for_weight(self, gguf_name: str, row: int) -> np.ndarray | None:
        """The vector for the weight stored as `gguf_name` with rows of `row` weights, or None when the file has
        no entry for it (logged; llama.cpp quantizes it without one).

        Raises:
            ConfigError: the entry has another length than the rows (an imatrix of another model), except for
                the token embeddings, which llama.cpp then quantizes without one too.
        """
        vector = self.vectors.get(gguf_name)
        if vector is None:
            logger.info("%s: no importance matrix entry in %s; quantized without one, as llama.cpp does",
                        gguf_name, self.path)
            return None
        if vector.size != row:
            if gguf_name == TOKEN_EMBD:
                return None
            raise ConfigError(f"{self.path}: the importance matrix entry for {gguf_name} has {vector.size} values but "
                              f"its rows have {row} weights; it was computed for another model")
        return vector


def read_importance(path: str | os.PathLike[str]) -> Importance:
    """Read a llama.cpp importance-matrix file (GGUF or legacy .dat form).

    Raises:
        FormatError: no such file, or the file is not a well-formed importance matrix (ParseError).
        ConfigError: a GGUF-form file without llama-imatrix's metadata (llama-quantize refuses those too),
            or values that are not finite.
    """
    path = Path(path)
    if not path.is_file():
        raise FormatError(path, "no such importance-matrix file")
    data = read_capped(path, MAX_BYTES, "an importance matrix")                 # ParseError is a FormatError
    parsed = parse_imatrix.read_imatrix(data, source=str(path))
    if not parsed.legacy and not parsed.has_metadata:
        raise ConfigError(f"{path}: a GGUF importance matrix without {DATASETS_KEY}, {CHUNK_COUNT_KEY} and "
                          f"{CHUNK_SIZE_KEY} (llama-quantize refuses it too); write it with llama-imatrix or "
                          f"modelkit imatrix")
    vectors = {name: entry.importance for name, entry in parsed.entries.items()}
    for name, vector in vectors.items():
        if not np.isfinite(vector).all():
            raise ConfigError(f"{path}: the importance matrix entry for {name} holds NaN or infinity")
    return Importance(str(path), vectors, tuple(parsed.datasets), parsed.chunk_count, parsed.legacy)


def write_imatrix(path: str | os.PathLike[str], entries: Mapping[str, tuple[np.ndarray, np.ndarray]], *,
                  datasets: Sequence[str], chunk_count: int, chunk_size: int, force: bool = False) -> int:
    """Write an importance matrix in llama-imatrix's GGUF form; returns the bytes written.

    Args:
        entries: GGUF weight name -> (sums of squared activations, float (n_mat, n) or (n,); tokens seen per
            matrix, (n_mat,) or a number).
        datasets: the calibration files' names (imatrix.datasets).
        chunk_count, chunk_size: chunks of `chunk_size` tokens the model ran on.
        force: overwrite `path`.
    """
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    with atomic_path(path, force=force) as tmp:
        writer = GGUFWriter(None, "imatrix")
        for kv in writer.kv_data:           # llama-imatrix writes no architecture: neither do we
            kv.pop("general.architecture", None)
        writer.add_key_value(TYPE_KEY, "imatrix", GGUFValueType.STRING)
        writer.add_key_value(DATASETS_KEY, list(datasets), GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
        writer.add_key_value(CHUNK_COUNT_KEY, int(chunk_count), GGUFValueType.UINT32)
        writer.add_key_value(CHUNK_SIZE_KEY, int(chunk_size), GGUFValueType.UINT32)
        for name in sorted(entries):        # llama-imatrix's order: by name
            sums, counts = entries[name]
            counts = np.atleast_1d(np.asarray(counts, dtype=np.float32))
            sums = np.asarray(sums, dtype=np.float32).reshape(counts.size, -1)
            # ggml dims (n, n_mat) and (1, n_mat): numpy shapes (n_mat, n) and (n_mat, 1)
            writer.add_tensor(name + SUMS_SUFFIX, np.ascontiguousarray(sums), raw_dtype=GGMLQuantizationType.F32)
            writer.add_tensor(name + COUNTS_SUFFIX, np.ascontiguousarray(counts.reshape(-1, 1)),
                              raw_dtype=GGMLQuantizationType.F32)
        try:
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        return tmp.stat().st_size
