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
from pathlib import Path

from modelkit.checkpoint import ALIASES_KEY, ARCH_KEY, ArchSpec, Checkpoint, QuantizedTensor
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.parse.detect import safetensors as detect  # noqa: F401  (the converter's detect)
from modelkit.storage import compressed_tensors, quantized_layout
from modelkit.storage import safetensors_files as files

INDEX_NAME, SINGLE_NAME = files.INDEX_NAME, files.SINGLE_NAME


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """Open a file, a sharded folder or its index; tensor data is read only when a tensor is loaded."""
    if path.is_dir() or path.name.endswith(".index.json"):
        folder = path if path.is_dir() else path.parent
        tensors, metadata, where = files.read_folder(folder, None if path.is_dir() else path)
    else:
        (tensors, metadata), where = files.read_file(path), path
    arch_json = metadata.pop(ARCH_KEY, None)
    arch = ArchSpec.from_json(arch_json, source=where) if arch_json is not None else None
    return _group_quantized(where, Checkpoint(tensors=tensors, metadata=metadata, arch=arch))


def _metadata(ckpt: Checkpoint, aliases: dict[str, str]) -> dict[str, str]:
    metadata = {"format": "pt", **{k: v for k, v in ckpt.metadata.items() if k != ALIASES_KEY}}
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    if ckpt.arch is not None:
        metadata[ARCH_KEY] = ckpt.arch.to_json()
    return metadata


def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    """Write one file, or with `options.shard_size` a Hugging Face sharded folder at `path`."""
    ckpt = _flatten_quantized(ckpt)
    tensors, aliases = files.stored_tensors(ckpt.tensors, ckpt.metadata, target="safetensors")
    if options.shard_size is None:
        files.write_file(path, tensors, _metadata(ckpt, aliases))
        return
    # Each shard lists only the tied names whose stored tensor it holds.
    files.write_folder(path, tensors, options.shard_size,
                       lambda shard: _metadata(ckpt, {a: t for a, t in aliases.items() if t in shard}), aliases)


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
