"""safetensors: named tensors plus a str->str header; loading runs no code.

Spec: https://github.com/huggingface/safetensors#format
Layout: 8-byte little-endian header length N | N bytes of JSON (padded with spaces to a multiple
of 8) | tensor data. The JSON maps each name to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the end of the header) and "__metadata__" to str->str pairs. modelkit
stores "format": "pt" (as transformers does) and the ArchSpec under "modelkit.arch".

Sharded checkpoints follow Hugging Face: a folder with `model-00001-of-00003.safetensors`, ...
and `model.safetensors.index.json` ({"metadata": {"total_size": N}, "weight_map": {name: file}});
a folder whose tensors fit one shard holds a single `model.safetensors`. Every shard carries the
metadata and ArchSpec, so each is self-describing.

Tied tensors (two names, one storage) are stored once, as Hugging Face does; the other names
are listed under "modelkit.aliases" and come back as the same tensor on reading.

Quantized tensors (QuantizedTensor) are stored as their parts. Affine 4- and 8-bit weights are in
compressed-tensors' "pack-quantized" layout (modelkit/storage/compressed_tensors.py): for a weight
`N`, `N_packed` (int32, 32 / bits values each), `N_scale`, `N_zero_point` (asymmetric), `N_shape`
(int8-dynamic: "int-quantized", `N` int8 and `N_scale`); GGUF blocks are `N_packed` (uint8 block
bytes). The metadata entry
"modelkit.quantized" (JSON: N -> scheme, layout, shape, dtype, params, format and part -> stored
name) is what reading uses to put them back together (modelkit/storage/quantized_layout.py, shared
with pth); "quantization_config" is compressed-tensors' config for the same weights (what
config.json of a Hugging Face folder carries). Files in the layout modelkit wrote before
(two 4-bit values per uint8, int8 under `N`) are still read. See docs/quantizers/safetensors.md.

Reading is lazy: the header gives names, dtypes and shapes; each tensor's bytes are read when
asked for. Writing streams: the header is computed from the specs, then each tensor is read
and written in turn, so peak memory is one tensor, not the model.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from modelkit.checkpoint import ALIASES_KEY, ARCH_KEY, ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import FormatError, ParseError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import tied_names
from modelkit.parse import safetensors as safetensors_header
from modelkit.parse.detect import safetensors as detect  # noqa: F401  (the converter's detect)
from modelkit.parse.paths import plain_name_problem
from modelkit.storage import compressed_tensors, quantized_layout
from modelkit.storage.dtypes import SAFETENSORS_DTYPES, DType, tensor_bytes
from modelkit.storage.mapped import FileSpan, MappedFile, copy_span

_ALIGN = 8
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


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """Open a file, a sharded folder or its index; tensor data is read only when a tensor is loaded."""
    if path.is_dir() or path.name.endswith(".index.json"):
        return _read_sharded(path)
    return _read_file(path)


def _read_file(path: Path, *, group: bool = True) -> Checkpoint:
    try:
        with safe_open(str(path), framework="numpy") as f:   # validates header, offsets and sizes
            metadata = dict(f.metadata() or {})
            headers = {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()}
        with path.open("rb") as raw, mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = safetensors_header.read_header(buf)   # the offsets safe_open just checked
    except ParseError as e:
        raise FormatError(path, f"not a readable safetensors file ({e})") from e
    except (SafetensorError, OSError, ValueError) as e:
        raise FormatError(path, f"not a readable safetensors file ({e})") from e
    length = header.length
    offsets = {name: tuple(header.entries[name]["data_offsets"]) for name in headers}
    handle = _File(path, offsets, header.data_start)
    tensors: dict[str, LazyTensor] = {}
    for name, (code, shape) in headers.items():
        dtype = SAFETENSORS_DTYPES.get(code)
        if dtype is None:
            raise FormatError(path, f"tensor {name!r} has dtype {code!r}, which modelkit does not know")
        begin, end = offsets[name]
        tensors[name] = LazyTensor(dtype, shape, lambda name=name, dtype=dtype, shape=shape: handle.get(name, dtype, shape),
                                   f"{path}:{name}", span=FileSpan(path, 8 + length + begin, end - begin))
    tensors.update({alias: tensors[target] for alias, target in tied_names(path, metadata, tensors).items()})
    arch_json = metadata.pop(ARCH_KEY, None)
    arch = ArchSpec.from_json(arch_json, source=path) if arch_json is not None else None
    ckpt = Checkpoint(tensors=tensors, metadata=metadata, arch=arch)
    return _group_quantized(path, ckpt) if group else ckpt



def _read_sharded(path: Path) -> Checkpoint:
    folder = path if path.is_dir() else path.parent
    index_path = folder / INDEX_NAME if path.is_dir() else path
    if path.is_dir() and not index_path.is_file():
        return _read_file(folder / SINGLE_NAME)
    size = index_path.stat().st_size
    if size > safetensors_header.MAX_INDEX:
        raise FormatError(index_path, f"index is {size} bytes; refusing anything over {safetensors_header.MAX_INDEX}")
    try:
        weight_map = safetensors_header.read_index(index_path.read_bytes())
    except ParseError as e:
        raise FormatError(index_path, e.reason) from e
    shards: dict[str, Checkpoint] = {}
    for shard in sorted(set(weight_map.values())):
        # A shard name is a plain file name inside the folder: no folders, no '..', no links out.
        target = (folder / shard).resolve()
        if plain_name_problem(shard, str(folder)) is not None:
            raise FormatError(index_path, f"shard {shard!r} is not a file name inside {folder}; refusing to follow it")
        if not target.is_file():
            raise FormatError(index_path, f"shard {shard!r} is missing")
        shards[shard] = _read_file(folder / shard, group=False)   # parts may sit in different shards
    tensors: dict[str, LazyTensor] = {}
    for name, shard in weight_map.items():
        if name not in shards[shard].tensors:
            raise FormatError(index_path, f"tensor {name!r} is not in shard {shard!r}")
        tensors[name] = shards[shard].tensors[name]
    first = shards[min(shards)] if shards else Checkpoint({})
    return _group_quantized(index_path, Checkpoint(tensors, dict(first.metadata), first.arch))


def _stored_tensors(ckpt: Checkpoint) -> tuple[dict[str, LazyTensor], dict[str, str]]:
    """The tensors to store, and the tied names left out (alias -> stored name)."""
    aliases = json.loads(ckpt.metadata.get(ALIASES_KEY, "{}"))
    stored = {}
    for name, entry in ckpt.tensors.items():
        if isinstance(entry, QuantizedTensor):
            raise UnsupportedConversionError(
                "quantized checkpoint", "safetensors", f"tensor {name!r} is quantized ({entry.scheme}); dequantize it first",
            )
        if entry.dtype.code is None:
            raise UnsupportedConversionError(str(entry.dtype), "safetensors", f"tensor {name!r} has a dtype safetensors lacks")
        if name not in aliases:
            stored[name] = entry
    return stored, {a: t for a, t in aliases.items() if t in stored}


def _metadata(ckpt: Checkpoint, aliases: dict[str, str]) -> dict[str, str]:
    metadata = {"format": "pt", **{k: v for k, v in ckpt.metadata.items() if k != ALIASES_KEY}}
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    if ckpt.arch is not None:
        metadata[ARCH_KEY] = ckpt.arch.to_json()
    return metadata


def _write_file(path: Path, tensors: dict[str, LazyTensor], metadata: dict[str, str]) -> None:
    header: dict[str, Any] = {"__metadata__": metadata}
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
            else:
                out.write(tensor_bytes(entry.array()))


def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    """Write one file, or with `options.shard_size` a Hugging Face sharded folder at `path`."""
    ckpt = _flatten_quantized(ckpt)
    tensors, aliases = _stored_tensors(ckpt)
    metadata = _metadata(ckpt, aliases)
    if options.shard_size is None:
        _write_file(path, tensors, metadata)
        return
    path.mkdir(exist_ok=True)
    shards: list[dict[str, LazyTensor]] = [{}]
    size = 0
    for name, entry in tensors.items():       # greedy, in order; an oversized tensor gets a shard of its own
        if shards[-1] and size + entry.nbytes > options.shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = entry
        size += entry.nbytes
    if len(shards) == 1:
        _write_file(path / SINGLE_NAME, shards[0], metadata)
        return
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        # Each shard lists only the tied names whose stored tensor it holds.
        _write_file(path / file_name, shard, _metadata(ckpt, {a: t for a, t in aliases.items() if t in shard}))
        weight_map.update({name: file_name for name in shard})
    weight_map.update({alias: weight_map[target] for alias, target in aliases.items()})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- quantized tensors

QUANT_CONFIG_KEY = "quantization_config"    # compressed-tensors' description, for other tools


def _flatten_quantized(ckpt: Checkpoint) -> Checkpoint:
    """QuantizedTensors as their stored parts (modelkit.storage.quantized_layout), plus compressed-tensors'
    config when it can describe them all (module weights, not GGUF blocks)."""
    config = None
    if all(compressed_tensors.describable(t) is None and n.endswith(".weight")
           for n, t in ckpt.tensors.items() if isinstance(t, QuantizedTensor)):
        config = compressed_tensors.compressed_tensors_config(ckpt)
    ckpt, _ = quantized_layout.flatten(ckpt, target="safetensors")
    if config is not None:
        ckpt.metadata[QUANT_CONFIG_KEY] = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return ckpt


def _group_quantized(path: Path, ckpt: Checkpoint) -> Checkpoint:
    """Put QuantizedTensors back together from their stored parts, as the metadata describes them."""
    return quantized_layout.group(path, ckpt, also_drop=(QUANT_CONFIG_KEY,))
