"""hf: a Hugging Face model folder, as transformers' `save_pretrained` writes it and `from_pretrained` reads it.

Layout (https://huggingface.co/docs/transformers/main_classes/model#transformers.PreTrainedModel.save_pretrained):

    config.json                       the architecture: `model_type` + hyperparameters (the ArchSpec's config)
    model.safetensors                 the weights, or, past the shard size,
    model-00001-of-0000N.safetensors  shards, with
    model.safetensors.index.json      {"metadata": {"total_size": N}, "weight_map": {name: shard}}
    tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json,
    tokenizer.model                   carried along as Checkpoint.assets, byte for byte

Reading: config.json's `model_type` picks the family (modelkit/models/<family>.py; an unknown one is a
one-line error naming it and the known families); the ArchSpec is (family, config.json), the tensors are
read lazily from the safetensors files (modelkit.storage.safetensors_files, shared with the safetensors
converter); tokenizer_config.json's chat template goes through the scanner's template check first.
Writing: the same folder (tinylm, whose names and config are Llama's, as a llama folder); tied weights (an alias of the embeddings) are left out as transformers leaves
them out, and come back from the shard metadata's "modelkit.aliases" on reading. No torch anywhere.

Quantized folders (int4, int8, gptq, int8-dynamic weights): compressed-tensors' layout, as llm-compressor
writes it and transformers (with the `compressed-tensors` package) and vLLM load it: config.json carries
`quantization_config` (modelkit.storage.compressed_tensors.compressed_tensors_config), the shards hold the
packed parts (`N_packed`, `N_scale`, `N_zero_point`, `N_shape`; int8-dynamic: `N` int8 and `N_scale`), and
each shard's metadata carries modelkit's "modelkit.quantized" record (modelkit.storage.quantized_layout), from
which reading puts the same QuantizedTensors back together. The ArchSpec's config never holds
`quantization_config`: it describes how the weights are stored, which the tensors say; the writer derives it.
GGUF block types have no compressed-tensors form and are refused. Folders other tools quantized with
compressed-tensors (llm-compressor's; no record) are read by modelkit.storage.compressed_tensors_read: int4/int8
weights as the same QuantizedTensors, the rest dequantized as compressed-tensors does. See docs/formats/hf.md.
"""
from __future__ import annotations

import json
from pathlib import Path

from modelkit.checkpoint import ALIASES_KEY, ARCH_KEY, ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import FormatError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import QUANTIZED_KEY
from modelkit.parse import compressed_tensors as ct_config
from modelkit.parse import hf as hf_folder
from modelkit.parse.detect import hf as detect  # noqa: F401  (the converter's detect)
from modelkit.storage import compressed_tensors, compressed_tensors_read, quantized_layout
from modelkit.storage import safetensors_files as files

QUANTIZATION_CONFIG = "quantization_config"     # config.json's key for how the weights are quantized
DEFAULT_SHARD_SIZE = 5 * 1024**3      # transformers' max_shard_size default before 5.0 ("5GB")


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """Open a model folder: config.json, the assets, and the weights' headers (data is read on load)."""
    from modelkit.models import family_for_config

    folder = path if path.is_dir() else path.parent
    config = hf_folder.read_config(folder)
    family = family_for_config(config, source=folder / hf_folder.CONFIG_NAME)
    assets = read_assets(folder, trust=options.trust)
    tensors, metadata, where = files.read_folder(folder)
    for key in ("format", ARCH_KEY):              # the folder's config.json is the architecture
        metadata.pop(key, None)
    stored = config.pop(QUANTIZATION_CONFIG, None)     # how the weights are stored: the tensors say it
    if stored is not None and QUANTIZED_KEY not in metadata:     # another tool's folder (llm-compressor's)
        tensors, _ = compressed_tensors_read.read(_foreign_config(folder, stored), tensors, str(where))
    ckpt = quantized_layout.group(where, Checkpoint(tensors=tensors, metadata=metadata,
                                                    arch=ArchSpec(family, config), assets=assets))
    if options.dequantize:          # float tensors, each dequantized when it is read (quantize --allow-requantize)
        ckpt.tensors = {n: LazyTensor(t.dtype, t.shape, t.load, t.source) if isinstance(t, QuantizedTensor) else t
                        for n, t in ckpt.tensors.items()}
    return ckpt


def quantization(path: Path) -> dict | None:
    """How a folder's weights are quantized (compressed-tensors' config groups, ignore list, KV cache) and how
    modelkit reads them (`inspect`); None for float folders and the ones modelkit wrote (their tensors say it)."""
    folder = path if path.is_dir() else path.parent
    stored = hf_folder.read_config(folder).get(QUANTIZATION_CONFIG)
    if stored is None:
        return None
    tensors, metadata, where = files.read_folder(folder)
    if QUANTIZED_KEY in metadata:
        return None
    return compressed_tensors_read.read(_foreign_config(folder, stored), tensors, str(where))[1]


def _foreign_config(folder: Path, stored: object) -> ct_config.Config:
    """The checked quantization_config of a folder modelkit did not write: compressed-tensors' only."""
    source = folder / hf_folder.CONFIG_NAME
    if not isinstance(stored, dict) or stored.get("quant_method") != ct_config.QUANT_METHOD:
        raise FormatError(source, f"a quantized folder ({_describe(stored)}); modelkit reads quant_method "
                          "'compressed-tensors' folders and float folders: dequantize it with transformers first")
    return ct_config.parse(stored, source=str(source))          # a ParseError is a FormatError naming config.json


def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    """Write the folder at `path`: config.json, the weights (sharded past `options.shard_size`), the assets."""
    config = {k: v for k, v in _config(ckpt).items() if k != QUANTIZATION_CONFIG}
    quantization = _quantization_config(ckpt)
    if quantization is not None:
        config[QUANTIZATION_CONFIG] = quantization
        ckpt, _ = quantized_layout.flatten(ckpt, target="hf")
    tensors, aliases = files.stored_tensors(ckpt.tensors, ckpt.metadata, target="hf")
    metadata = {"format": "pt", **{k: v for k, v in ckpt.metadata.items() if k != ALIASES_KEY}}

    def metadata_for(shard: dict[str, LazyTensor]) -> dict[str, str]:
        tied = {a: t for a, t in aliases.items() if t in shard}
        return {**metadata, ALIASES_KEY: json.dumps(tied, sort_keys=True)} if tied else metadata

    path.mkdir(exist_ok=True)
    (path / hf_folder.CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    files.write_folder(path, tensors, options.shard_size or DEFAULT_SHARD_SIZE, metadata_for)
    for name, data in ckpt.assets.items():
        if name in hf_folder.ASSETS:              # only the files a folder holds, by their plain names
            (path / name).write_bytes(data)


def read_assets(folder: Path, *, trust: bool = False) -> dict[str, bytes]:
    """The tokenizer and generation files in `folder` (those of `hf_folder.ASSETS` present), the chat
    template scanned first: a Jinja program some runtimes render."""
    assets = {name: hf_folder.read_bytes(folder / name) for name in hf_folder.ASSETS if (folder / name).is_file()}
    if "tokenizer_config.json" in assets:
        from modelkit.scan import gate

        gate(folder / "tokenizer_config.json", trust=trust)
    if "chat_template.jinja" in assets:
        from modelkit.scan import gate_template

        gate_template(folder / "chat_template.jinja", assets["chat_template.jinja"].decode("utf-8", "replace"))
    return assets


def _quantization_config(ckpt: Checkpoint) -> dict | None:
    """compressed-tensors' config for the quantized weights (None when there are none); what it cannot
    describe (GGUF blocks, 2- or 3-bit values) is refused in one line."""
    try:
        return compressed_tensors.compressed_tensors_config(ckpt)
    except UnsupportedConversionError as e:
        raise UnsupportedConversionError("quantized checkpoint", "hf", f"{e.reason}; a Hugging Face folder holds "
                                         "int4, int8, gptq or int8-dynamic weights (compressed-tensors), "
                                         "GGUF blocks go to .gguf or .safetensors") from e


def _describe(quantization: object) -> str:
    if not isinstance(quantization, dict):
        return "not an object"
    return f"quant_method {quantization.get('quant_method')!r}, format {quantization.get('format')!r}"


def _config(ckpt: Checkpoint) -> dict:
    """config.json: a family's ArchSpec config as it is; a zoo model stored by a family's layout (tinylm:
    Llama's) as that family's config; anything else cannot be a Hugging Face folder."""
    from modelkit.models import _hf, gguf_conventions, hf_families

    families = hf_families()
    if ckpt.arch is not None and ckpt.arch.name in families:
        return ckpt.arch.config
    rules = gguf_conventions(ckpt.arch)
    if rules is not None and set(ckpt.tensors) == set(rules.names):
        return _hf.zoo_config(rules)
    what = f"is a {ckpt.arch.name!r} model" if ckpt.arch else "names no architecture"
    raise UnsupportedConversionError("checkpoint", "hf", f"a Hugging Face folder holds one of the families "
                                     f"{', '.join(sorted(families))} (or tinylm, as llama); this checkpoint {what}")
