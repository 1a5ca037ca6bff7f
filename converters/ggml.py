"""ggml: legacy llama.cpp files ('ggml', 'ggmf', 'ggjt' v1-v3, before GGUF), read as a Hugging Face llama.

The bytes are parsed by modelkit.parse.ggml (layout in its docstring; every length checked against the file).
The file becomes what the GGUF reader makes of a llama.cpp GGUF file, through the same family rules
(modelkit.models._hf, the llama family):

- the hyperparameters become llama.cpp's `llama.*` keys and from them a LlamaConfig (`_hf.config_from_gguf`):
  n_embd, n_head, n_layer; n_ff from layers.0.feed_forward.w1 and the key/value heads from the wk rows (the
  file does not say them); the context length (2048) and RMS epsilon (5e-6) the file does not hold are
  llama.cpp's converter's defaults;
- the tensors' Meta names (tok_embeddings, layers.N.attention.wq, ...) become llama.cpp's (gguf-py's tensor
  table), then Hugging Face's (the family's), and the Q/K rows go back from llama.cpp's RoPE order to
  Hugging Face's (undone again when GGUF is written, as for every llama);
- F32/F16 tensors are lazy float arrays; Q4_0, Q4_1, Q8_0 (and ggjt v3's other block types) stay
  QuantizedTensors of layout "gguf", their blocks copied as they are (ggjt v3 blocks are GGUF's);
- the vocabulary becomes llama.cpp's SentencePiece keys as its convert_llama_ggml_to_gguf.py defines them
  (ids 0-2 <unk>, <s>, </s>; one-byte tokens 3-258 BYTE tokens <0xXX>; spaces as U+2581; the scores kept),
  and from them tokenizer.json (modelkit.models.gguf_vocab), so GGUF and Hugging Face folders get it.

Quantized blocks of files older than ggjt v3 (f32 scales, ggjt v1's nibble order) are not GGUF's blocks:
such a file is refused with the reason, as llama.cpp's converter refuses it; their F32/F16 files convert.
Read-only: modelkit writes GGUF, never these.
"""
from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
from gguf import MODEL_ARCH, GGMLQuantizationType, TokenType, get_tensor_name_map

from modelkit.checkpoint import ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import FormatError, ParseError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import GGML_SOURCE_KEY
from modelkit.models import _hf
from modelkit.parse import ggml as legacy
from modelkit.parse.detect import ggml as detect  # noqa: F401  (the converter's detect)
from modelkit.storage.dtypes import DTYPES

CONTEXT_LENGTH = 2048        # convert_llama_ggml_to_gguf.py's --context-length default: the files do not say
RMS_EPS = 5e-6               # ...and its --eps default (LLaMA-1 used 1e-6, Llama-2 1e-5)
_FLOAT = {"F32": DTYPES["float32"], "F16": DTYPES["float16"]}
_SPACE = "\u2581"


def _mapped(path: Path) -> mmap.mmap:
    with path.open("rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def parse(path: Path) -> legacy.GgmlFile:
    """The file's header, vocabulary and tensor records (no tensor data read)."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return legacy.read(buf)
    except (OSError, ValueError) as e:
        raise FormatError(path, f"cannot read it ({getattr(e, 'strerror', None) or e})") from e
    except ParseError as e:
        raise FormatError(path, str(e)) from e


def _vocab_fields(file: legacy.GgmlFile) -> dict[str, Any]:
    """llama.cpp's tokenizer keys for the file's vocabulary (convert_llama_ggml_to_gguf.py's rules)."""
    tokens, types = [], []
    for i, raw in enumerate(file.tokens):
        if i <= 2:
            text, kind = ("<unk>", TokenType.UNKNOWN) if i == 0 else ("<s>" if i == 1 else "</s>", TokenType.CONTROL)
        elif not raw:
            text, kind = "", TokenType.CONTROL
        elif i <= 258 and len(raw) == 1:
            text, kind = f"<0x{raw[0]:02X}>", TokenType.BYTE
        else:
            text, kind = raw.decode("utf-8", "replace").replace(" ", _SPACE), TokenType.NORMAL
        tokens.append(text)
        types.append(int(kind))
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [float(s) for s in file.scores], "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2}


def _fields(path: Path, file: legacy.GgmlFile, gguf_names: dict[str, str]) -> dict[str, Any]:
    """The `llama.*` keys llama.cpp's converter writes for this file."""
    hp = file.hparams
    by_gguf = {g: t for t, g in zip(file.tensors, (gguf_names[t.name] for t in file.tensors), strict=True)}
    ffn, wk = by_gguf.get("blk.0.ffn_gate.weight"), by_gguf.get("blk.0.attn_k.weight")
    if ffn is None or wk is None or hp["n_head"] == 0 or hp["n_embd"] % hp["n_head"]:
        raise FormatError(path, "is not a llama model: layer 0's feed-forward and key weights are missing, or "
                                f"n_embd {hp['n_embd']} does not split into {hp['n_head']} heads")
    head_dim = hp["n_embd"] // hp["n_head"]
    if wk.shape[0] % head_dim:
        raise FormatError(path, f"layers.0.attention.wk has {wk.shape[0]} rows, not whole heads of {head_dim}")
    return {"llama.context_length": CONTEXT_LENGTH, "llama.embedding_length": hp["n_embd"],
            "llama.block_count": hp["n_layer"], "llama.feed_forward_length": ffn.shape[0],
            "llama.attention.head_count": hp["n_head"], "llama.attention.head_count_kv": wk.shape[0] // head_dim,
            "llama.attention.layer_norm_rms_epsilon": RMS_EPS, "llama.vocab_size": hp["n_vocab"],
            "llama.rope.freq_base": 10000.0, **_vocab_fields(file)}


def _gguf_names(path: Path, file: legacy.GgmlFile) -> dict[str, str]:
    table = get_tensor_name_map(MODEL_ARCH.LLAMA, file.hparams["n_layer"])
    names = {}
    for tensor in file.tensors:
        mapped = table.get_name(tensor.name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise FormatError(path, f"tensor {tensor.name!r} is not a llama tensor llama.cpp knows")
        names[tensor.name] = mapped
    return names


def _entry(buf_of, tensor: legacy.Tensor, n_heads: int | None, source: str) -> LazyTensor | QuantizedTensor:
    """One tensor, rows in Hugging Face's order (llama.cpp's RoPE order undone for Q/K)."""
    shape = tensor.shape
    if tensor.type_name in _FLOAT:
        dtype = _FLOAT[tensor.type_name]

        def values() -> np.ndarray:
            array = np.frombuffer(buf_of(), dtype=dtype.numpy, count=tensor.nbytes // dtype.itemsize,
                                  offset=tensor.offset).reshape(shape)
            return np.array(array if n_heads is None else _hf.from_llama_rope(array, n_heads))
        return LazyTensor(dtype, shape, values, source)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    byte_shape = (rows, tensor.nbytes // rows)

    def blocks() -> np.ndarray:
        array = np.frombuffer(buf_of(), dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset).reshape(byte_shape)
        return np.array(array if n_heads is None else _hf.from_llama_rope(array, n_heads))
    qdata = LazyTensor(DTYPES["uint8"], byte_shape, blocks, source)
    ggml_type = GGMLQuantizationType(tensor.type_code)
    return QuantizedTensor(scheme=ggml_type.name.lower(), layout="gguf", shape=shape, dtype=DTYPES["float32"],
                           parts={"qdata": qdata}, params={"ggml_type": ggml_type.name}, source=source)


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """The file as a llama Checkpoint: Hugging Face names, the config, the tokenizer; tensors read lazily."""
    from modelkit.models import hf_families
    from modelkit.models.gguf_vocab import tokenizer_assets
    from modelkit.scan import gate

    gate(path, trust=options.trust)
    file = parse(path)
    quantized = sorted({t.type_name for t in file.tensors if t.type_name not in _FLOAT})
    if quantized and not file.blocks_like_gguf:
        raise UnsupportedConversionError(
            f"{path.name} ({file.label})", "a modelkit checkpoint",
            f"its {', '.join(quantized)} blocks predate ggjt v3 (f32 scales, older nibble order) and are not GGUF's "
            "blocks; convert the model's F16 or F32 file instead, as llama.cpp's converter also requires")
    gguf_names = _gguf_names(path, file)
    fields = _fields(path, file, gguf_names)
    family = hf_families()["llama"]
    tied = "output.weight" not in gguf_names.values()
    config = _hf.config_from_gguf(family, fields, tied=tied)
    rules = _hf.conventions("llama", family, config)
    mapped: list[mmap.mmap] = []

    def buf_of() -> mmap.mmap:
        if not mapped:
            mapped.append(_mapped(path))
        return mapped[0]

    tensors: dict[str, LazyTensor | QuantizedTensor] = {}
    for tensor in file.tensors:
        name = rules.from_gguf.get(gguf_names[tensor.name])
        if name is None:
            raise FormatError(path, f"tensor {tensor.name!r} ({gguf_names[tensor.name]}) has no place in a llama model")
        n_heads = rules.heads.get(name)
        if n_heads is not None and tensor.shape[0] % (2 * n_heads):
            raise FormatError(path, f"tensor {tensor.name!r} of shape {list(tensor.shape)} does not split into "
                                    f"{n_heads} heads of RoPE pairs")
        entry = _entry(buf_of, tensor, n_heads, f"{path}:{tensor.name}")
        if options.dequantize and isinstance(entry, QuantizedTensor):
            entry = LazyTensor(DTYPES["float32"], entry.shape, entry.load, entry.source)
        tensors[name] = entry
    metadata = {GGML_SOURCE_KEY: f"{file.label}, ftype {file.hparams['ftype']}"}
    return Checkpoint(tensors, metadata, ArchSpec("llama", config), tokenizer_assets(fields))


def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    raise UnsupportedConversionError("checkpoint", "ggml", "modelkit reads legacy ggml/ggjt files but does not write "
                                     "them; write GGUF, their successor, instead")
