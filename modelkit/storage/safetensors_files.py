"""safetensors files and Hugging Face sharded folders on disk: the reading and writing both the
`safetensors` and the `hf` (save_pretrained folder) converters use.

Layout: 8-byte little-endian header length N | N bytes of JSON (padded with spaces to a multiple of 8) |
tensor data. A sharded folder holds `model-00001-of-00003.safetensors`, ... and
`model.safetensors.index.json` ({"metadata": {"total_size": N}, "weight_map": {name: file}}); a folder
whose tensors fit one shard holds a single `model.safetensors`.

Here the tensors are plain LazyTensors and the metadata str -> str; what a converter makes of the
metadata (the ArchSpec, quantized parts) is the converter's. Reading is lazy (each tensor a view of a
copy-on-write memory map); writing streams one tensor at a time, copying unchanged bytes file to file.
"""
from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from modelkit.errors import FormatError, ParseError, UnsupportedConversionError
from modelkit.metadata import ALIASES_KEY, tied_names
from modelkit.parse import safetensors as safetensors_header
from modelkit.parse.paths import plain_name_problem, read_capped
from modelkit.storage.atomic import file_finished
from modelkit.storage.dtypes import SAFETENSORS_DTYPES, DType, tensor_bytes
from modelkit.storage.mapped import FileSpan, MappedFile, copy_span
from modelkit.storage.tensors import LazyTensor, QuantizedTensor
from modelkit.storage.write_behind import WriteBehind, write_all

_ALIGN = 8
_CHUNK = 4 << 20           # bytes at a time of a tensor made in bands as it is written (LazyTensor.chunks)
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class _File:
    """A file's tensors as views of one copy-on-write memory map (modelkit.storage.mapped)."""

    def __init__(self, path: Path, offsets: dict[str, tuple[int, int]], data_start: int) -> None:
        self.path = path
        self.offsets = offsets            # name -> (begin, end) within the data section, checked by safe_open
        self.data_start = data_start
        self._mapped = MappedFile(path)

    def get(self, name: str, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        """The stored bits (a view of the file's pages)."""
        begin, end = self.offsets[name]
        if end == begin:
            return np.empty(shape, dtype=dtype.numpy)
        flat = self._mapped.view(self.data_start + begin, end - begin, f"tensor {name!r}")
        return flat.view(dtype.numpy).reshape(shape)


def read_file(path: Path) -> tuple[dict[str, LazyTensor], dict[str, str]]:
    """One safetensors file: its tensors (tied names listed in the metadata included) and its metadata."""
    try:
        with safe_open(str(path), framework="numpy") as f:   # validates header, offsets and sizes
            metadata = dict(f.metadata() or {})
            headers = {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()}
        with path.open("rb") as raw, mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = safetensors_header.read_header(buf)   # the offsets safe_open just checked
    except (ParseError, SafetensorError, OSError, ValueError) as e:
        raise FormatError(path, f"not a readable safetensors file ({e})") from e
    offsets = {name: tuple(header.entries[name]["data_offsets"]) for name in headers}
    handle = _File(path, offsets, header.data_start)
    tensors: dict[str, LazyTensor] = {}
    for name, (code, shape) in headers.items():
        dtype = SAFETENSORS_DTYPES.get(code)
        if dtype is None:
            raise FormatError(path, f"tensor {name!r} has dtype {code!r}, which modelkit does not know")
        begin, end = offsets[name]
        tensors[name] = LazyTensor(dtype, shape, lambda name=name, dtype=dtype, shape=shape: handle.get(name, dtype, shape),
                                   f"{path}:{name}", span=FileSpan(path, 8 + header.length + begin, end - begin))
    tensors.update({alias: tensors[target] for alias, target in tied_names(path, metadata, tensors).items()})
    return tensors, metadata


def read_folder(folder: Path, index_path: Path | None = None) -> tuple[dict[str, LazyTensor], dict[str, str], Path]:
    """A Hugging Face folder (or its index): every shard's tensors in the index's order, the first shard's
    metadata, and the file errors should name (the index, or the single file)."""
    index_path = index_path or folder / INDEX_NAME
    if not index_path.is_file():
        tensors, metadata = read_file(folder / SINGLE_NAME)
        return tensors, metadata, folder / SINGLE_NAME
    try:
        weight_map = safetensors_header.read_index(read_capped(index_path, safetensors_header.MAX_INDEX,
                                                               "a sharded checkpoint's index"))
    except ParseError as e:
        raise FormatError(index_path, e.reason) from e
    shards: dict[str, tuple[dict[str, LazyTensor], dict[str, str]]] = {}
    for shard in sorted(set(weight_map.values())):
        # A shard name is a plain file name inside the folder: no folders, no '..', no links out.
        if plain_name_problem(shard, str(folder)) is not None:
            raise FormatError(index_path, f"shard {shard!r} is not a file name inside {folder}; refusing to follow it")
        if not (folder / shard).resolve().is_file():
            raise FormatError(index_path, f"shard {shard!r} is missing")
        shards[shard] = read_file(folder / shard)
    tensors: dict[str, LazyTensor] = {}
    for name, shard in weight_map.items():
        if name not in shards[shard][0]:
            raise FormatError(index_path, f"tensor {name!r} is not in shard {shard!r}")
        tensors[name] = shards[shard][0][name]
    for shard_tensors, _ in shards.values():          # tied names a shard lists that the index leaves out
        for name, entry in shard_tensors.items():
            tensors.setdefault(name, entry)
    metadata = dict(shards[min(shards)][1]) if shards else {}
    return tensors, metadata, index_path


def stored_tensors(tensors: Mapping[str, Any], metadata: Mapping[str, str], *,
                   target: str) -> tuple[dict[str, LazyTensor], dict[str, str]]:
    """The tensors a safetensors file (or folder) stores, and the tied names it leaves out (alias ->
    stored name, for ALIASES_KEY): a checkpoint's tensors and metadata as the `target` format writes them.

    Raises:
        UnsupportedConversionError: a quantized tensor (store its parts: quantized_layout.flatten) or a
            dtype safetensors lacks.
    """
    aliases = json.loads(metadata.get(ALIASES_KEY, "{}"))
    stored = {}
    for name, entry in tensors.items():
        if isinstance(entry, QuantizedTensor):
            raise UnsupportedConversionError(
                "quantized checkpoint", target, f"tensor {name!r} is quantized ({entry.scheme}); dequantize it first")
        if entry.dtype.code is None:
            raise UnsupportedConversionError(str(entry.dtype), target, f"tensor {name!r} has a dtype safetensors lacks")
        if not (name in aliases and aliases[name] in tensors):
            stored[name] = entry
    return stored, {a: t for a, t in aliases.items() if t in stored}


def write_file(path: Path, tensors: Mapping[str, LazyTensor], metadata: Mapping[str, str]) -> None:
    """One safetensors file: the header from the specs, then each tensor's bytes in turn."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, entry in tensors.items():
        header[name] = {"dtype": entry.dtype.code, "shape": list(entry.shape),
                        "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % _ALIGN)                       # data starts 8-byte aligned
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for entry in tensors.values():
            if entry.span is not None:          # unchanged bytes of a file: copied in the kernel
                copy_span(entry.span, out)
            elif entry.chunks is not None:      # made in bands (a transposed kernel), never whole
                with WriteBehind(partial(write_all, out)) as behind:     # each band written while the next is made
                    for chunk in entry.chunks(_CHUNK):
                        behind.write(tensor_bytes(chunk))
            else:
                write_all(out, tensor_bytes(entry.array()))


def write_folder(folder: Path, tensors: Mapping[str, LazyTensor], shard_size: int,
                 metadata_for: Callable[[Mapping[str, LazyTensor]], Mapping[str, str]],
                 aliases: Mapping[str, str] | None = None) -> None:
    """Tensors as Hugging Face shards of at most `shard_size` bytes (greedy, in order; an oversized
    tensor gets a shard of its own) plus the index, or one `model.safetensors` when they fit.
    `metadata_for(shard)` gives each file's metadata; `aliases` (tied name -> stored name) join the
    index's weight map."""
    folder.mkdir(exist_ok=True)
    shards: list[dict[str, LazyTensor]] = [{}]
    size = 0
    for name, entry in tensors.items():
        if shards[-1] and size + entry.nbytes > shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = entry
        size += entry.nbytes
    if len(shards) == 1:
        write_file(folder / SINGLE_NAME, shards[0], metadata_for(shards[0]))
        return
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_file(folder / file_name, shard, metadata_for(shard))
        file_finished(folder / file_name)
        weight_map.update({name: file_name for name in shard})
    weight_map.update({alias: weight_map[target] for alias, target in (aliases or {}).items()})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
