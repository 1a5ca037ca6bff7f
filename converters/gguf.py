"""gguf: llama.cpp's single-file format: typed key/value metadata, then tensor infos, then aligned data.

Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (read and written with the `gguf`
package's GGUFReader / GGUFWriter).
Layout (little-endian): "GGUF" | u32 version (3) | u64 tensor_count | u64 kv_count |
kv_count x (string key | u32 value type | value) | tensor_count x (string name | u32 n_dims |
n_dims x u64 ne, fastest-varying first (numpy order reversed) | u32 ggml_type | u64 offset) |
padding to general.alignment (32) | tensor data, each tensor aligned. A string is a u64 length
and UTF-8 bytes; an array is a u32 item type, a u64 count and the items.

What modelkit stores:
- `general.*` always (architecture, name, file_type, quantization_version).
- The Checkpoint's str->str metadata under `modelkit.meta.<key>`, the ArchSpec as JSON under
  `modelkit.arch`, and `modelkit.tensors` (JSON: stored name -> the original name, dtype and shape,
  only where the GGUF tensor alone does not say them), so reading gives back the Checkpoint exactly.
- A model whose module declares a llama `GGUF` layout (tinylm) follows llama.cpp's `llama`
  conventions: `llama.*` hyperparameters, `token_embd` / `blk.N.attn_q` / ... tensor names, the
  Q/K row permutation of convert_hf_to_gguf.py, norms in F32 and the tokenizer the layout names
  (a 256-token byte vocabulary), so llama.cpp runs the file. Other models (or none) use the
  architecture "modelkit" and their own tensor names.
- Dtypes: F32, F16, BF16, F64 and I8-I64 as themselves; uint8, bool, uint16-64 and float8 as the
  signed integer type of the same width, the original dtype recorded. Nothing is lost.

Reading takes any GGUF file, llama.cpp's own included: llama files get Hugging Face names back
(the permutation undone); block-quantized tensors (Q4_0, Q8_0, K-quants, ...) become
QuantizedTensors with layout "gguf", dequantized by gguf-py on load (float32 tensors instead with
`ReadOptions(dequantize=True)`). Before gguf's reader sees a file, every count and length in its
header is checked against the file size (the reader trusts them: an array count past the end of
the file makes it loop without end).

Longer than our usual 400 lines: the llama tables and the header bounds walk are GGUF's alone.
"""
from __future__ import annotations

import json
import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_VERSION,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    TokenType,
)

from modelkit.checkpoint import ALIASES_KEY, ARCH_KEY, ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import ConfigError, FormatError, ParseError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import META_PREFIX, TENSORS_KEY, tied_names
from modelkit.parse import gguf as gguf_header
from modelkit.parse.detect import gguf as detect  # noqa: F401  (the converter's detect)
from modelkit.storage.dtypes import DTYPES, DType, dtype_name, narrow_float32, widen_to_float32
from modelkit.storage.mapped import FileSpan, MappedFile, copy_span


class _KEYS:
    """Every metadata key this module writes or reads (llama.cpp's names, as in gguf-py's constants.py)."""

    ARCHITECTURE = "general.architecture"
    NAME = "general.name"
    FILE_TYPE = "general.file_type"
    QUANTIZATION_VERSION = "general.quantization_version"
    ALIGNMENT = "general.alignment"
    # llama hyperparameters ("llama" is the architecture name in each key)
    CONTEXT_LENGTH = "llama.context_length"
    EMBEDDING_LENGTH = "llama.embedding_length"
    BLOCK_COUNT = "llama.block_count"
    FEED_FORWARD_LENGTH = "llama.feed_forward_length"
    ROPE_DIMENSION_COUNT = "llama.rope.dimension_count"
    ROPE_FREQ_BASE = "llama.rope.freq_base"
    ROPE_SCALING_TYPE = "llama.rope.scaling.type"
    HEAD_COUNT = "llama.attention.head_count"
    HEAD_COUNT_KV = "llama.attention.head_count_kv"
    KEY_LENGTH = "llama.attention.key_length"
    VALUE_LENGTH = "llama.attention.value_length"
    RMS_EPS = "llama.attention.layer_norm_rms_epsilon"
    VOCAB_SIZE = "llama.vocab_size"
    # tokenizer
    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENS = "tokenizer.ggml.tokens"
    SCORES = "tokenizer.ggml.scores"
    TOKEN_TYPE = "tokenizer.ggml.token_type"
    BOS_ID = "tokenizer.ggml.bos_token_id"
    EOS_ID = "tokenizer.ggml.eos_token_id"
    ADD_BOS = "tokenizer.ggml.add_bos_token"
    ADD_EOS = "tokenizer.ggml.add_eos_token"
    ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
    # modelkit's own
    ARCH = ARCH_KEY                      # "modelkit.arch": the ArchSpec as JSON
    META_PREFIX = META_PREFIX            # "modelkit.meta." + each Checkpoint metadata key; the value verbatim
    TENSORS = TENSORS_KEY                # "modelkit.tensors": stored name -> {"name", "dtype", "shape"} where they differ


_GENERIC_ARCH = "modelkit"
_LLAMA_ARCH = "llama"
_MAX_DIMS = gguf_header.MAX_DIMS  # GGML_MAX_DIMS: llama.cpp refuses tensors with more
_MAX_NAME_BYTES = 63             # GGML_MAX_NAME is 64 including the terminating NUL

F32, F16, BF16, F64 = (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                       GGMLQuantizationType.BF16, GGMLQuantizationType.F64)
I8, I16, I32, I64 = (GGMLQuantizationType.I8, GGMLQuantizationType.I16,
                     GGMLQuantizationType.I32, GGMLQuantizationType.I64)

# dtype name -> (GGUF type, same-width numpy type whose bytes are written). Dtypes GGUF lacks are
# stored as the signed integer of their width and `modelkit.tensors` records the original.
_STORAGE: dict[str, tuple[GGMLQuantizationType, np.dtype]] = {
    "float32": (F32, np.dtype("<f4")), "float16": (F16, np.dtype("<f2")),
    "bfloat16": (BF16, np.dtype("<i2")),           # numpy has no bfloat16: hand gguf its bytes
    "float64": (F64, np.dtype("<f8")),
    "int8": (I8, np.dtype("i1")), "int16": (I16, np.dtype("<i2")),
    "int32": (I32, np.dtype("<i4")), "int64": (I64, np.dtype("<i8")),
    "uint8": (I8, np.dtype("i1")), "bool": (I8, np.dtype("i1")),
    "uint16": (I16, np.dtype("<i2")), "uint32": (I32, np.dtype("<i4")), "uint64": (I64, np.dtype("<i8")),
    "float8_e4m3fn": (I8, np.dtype("i1")), "float8_e5m2": (I8, np.dtype("i1")),
}
_BYTES = np.dtype("u1")                 # block-quantized data
_NATIVE: dict[GGMLQuantizationType, DType] = {
    F32: DTYPES["float32"], F16: DTYPES["float16"], BF16: DTYPES["bfloat16"], F64: DTYPES["float64"],
    I8: DTYPES["int8"], I16: DTYPES["int16"], I32: DTYPES["int32"], I64: DTYPES["int64"],
}
_HALVES = ("float16", "bfloat16")       # kept in F32 as norms by llama.cpp's convention
_FILE_TYPES = {F32: LlamaFileType.ALL_F32, F16: LlamaFileType.MOSTLY_F16, BF16: LlamaFileType.MOSTLY_BF16}

# Hugging Face Llama name -> llama.cpp name; "{n}" is the block number (gguf-py's tensor_mapping.py
# lists the same pairs). q_proj / k_proj are permuted on the way (see _to_llama_rope).
_LLAMA_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LLAMA_BLOCK_NAMES = {
    "model.layers.{n}.input_layernorm.weight": "blk.{n}.attn_norm.weight",
    "model.layers.{n}.self_attn.q_proj.weight": "blk.{n}.attn_q.weight",
    "model.layers.{n}.self_attn.k_proj.weight": "blk.{n}.attn_k.weight",
    "model.layers.{n}.self_attn.v_proj.weight": "blk.{n}.attn_v.weight",
    "model.layers.{n}.self_attn.o_proj.weight": "blk.{n}.attn_output.weight",
    "model.layers.{n}.post_attention_layernorm.weight": "blk.{n}.ffn_norm.weight",
    "model.layers.{n}.mlp.gate_proj.weight": "blk.{n}.ffn_gate.weight",
    "model.layers.{n}.mlp.up_proj.weight": "blk.{n}.ffn_up.weight",
    "model.layers.{n}.mlp.down_proj.weight": "blk.{n}.ffn_down.weight",
}
_FROM_LLAMA_BLOCK = {g.removeprefix("blk.{n}."): h for h, g in _LLAMA_BLOCK_NAMES.items()}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")


# ---------------------------------------------------------------------------------------- read


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """Open a GGUF file; tensor data is read (and copied) only when a tensor is loaded."""
    _check_layout(path)
    try:
        reader = GGUFReader(path)   # memory-maps the file read-only
        if reader.byte_order != "I":
            raise FormatError(path, "the file is big-endian; modelkit reads little-endian GGUF files only")
        fields = {name: _value(field) for name, field in reader.fields.items()
                  if not name.startswith("GGUF.") and field.types[:1] != [GGUFValueType.ARRAY]}   # skip vocabularies
        ours = _KEYS.TENSORS in fields
        records = _records(path, fields) if ours else {}
        llama = fields.get(_KEYS.ARCHITECTURE) == _LLAMA_ARCH
        heads = _head_counts(fields) if llama else None
        tensors: dict[str, LazyTensor | QuantizedTensor] = {}
        mapped = MappedFile(path)
        for tensor in reader.tensors:
            name, entry = _entry(path, mapped, tensor, records.get(tensor.name, {}), llama, heads, options)
            if name in tensors:
                raise FormatError(path, f"two tensors map to the name {name!r}")
            tensors[name] = entry
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, struct.error, OSError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(path, f"not a readable GGUF file ({type(e).__name__}: {e})") from e
    if ours:
        metadata = {k.removeprefix(_KEYS.META_PREFIX): v for k, v in fields.items()
                    if k.startswith(_KEYS.META_PREFIX) and isinstance(v, str)}
        arch = ArchSpec.from_json(fields[_KEYS.ARCH], source=path) if isinstance(fields.get(_KEYS.ARCH), str) else None
        for alias, target in tied_names(path, metadata, tensors).items():
            tensors.setdefault(alias, tensors[target])
    else:   # a file from another tool: its scalar metadata as text, and a tinylm spec if it is one
        metadata = {k: str(v) for k, v in fields.items()}
        arch = _tinylm_spec(fields, tensors) if llama else None
    return Checkpoint(tensors=tensors, metadata=metadata, arch=arch)


def _value(field: Any) -> Any:
    """A scalar field's value: str, int, float or bool."""
    value = field.contents()
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _records(path: Path, fields: dict[str, Any]) -> dict[str, dict[str, Any]]:
    try:
        records = json.loads(fields[_KEYS.TENSORS])
    except (json.JSONDecodeError, TypeError) as e:
        raise FormatError(path, f"the {_KEYS.TENSORS} entry is not valid JSON") from e
    if not isinstance(records, dict) or not all(isinstance(r, dict) for r in records.values()):
        raise FormatError(path, f"the {_KEYS.TENSORS} entry must map tensor names to objects")
    return records


def _head_counts(fields: dict[str, Any]) -> tuple[int, int] | None:
    """(query heads, key/value heads) of a llama file, needed to undo the Q/K permutation; None if absent."""
    n_head = fields.get(_KEYS.HEAD_COUNT)
    n_head_kv = fields.get(_KEYS.HEAD_COUNT_KV, n_head)
    if isinstance(n_head, int) and isinstance(n_head_kv, int) and n_head > 0 and n_head_kv > 0:
        return n_head, n_head_kv
    return None


def _hf_name(name: str) -> tuple[str, str | None]:
    """llama.cpp name -> (Hugging Face name, "q" or "k" when the rows were permuted)."""
    for hf, gguf_name in _LLAMA_NAMES.items():
        if name == gguf_name:
            return hf, None
    match = _BLOCK_NAME.fullmatch(name)
    if match and match.group(2) in _FROM_LLAMA_BLOCK:
        hf = _FROM_LLAMA_BLOCK[match.group(2)].format(n=int(match.group(1)))
        return hf, {"attn_q.weight": "q", "attn_k.weight": "k"}.get(match.group(2))
    return name, None


def _entry(path: Path, mapped: MappedFile, tensor: Any, record: dict[str, Any], llama: bool,
           heads: tuple[int, int] | None, options: ReadOptions) -> tuple[str, LazyTensor | QuantizedTensor]:
    """One ReaderTensor as a Checkpoint entry: (name, lazy tensor)."""
    name, permuted = _hf_name(tensor.name) if llama else (tensor.name, None)
    if permuted is not None and heads is None:
        raise FormatError(path, f"tensor {tensor.name!r} needs positive integers {_KEYS.HEAD_COUNT} and "
                                f"{_KEYS.HEAD_COUNT_KV} to undo llama.cpp's Q/K permutation")
    name = record.get("name", name)
    if not isinstance(name, str):
        raise FormatError(path, f"tensor {tensor.name!r}: {_KEYS.TENSORS} records the name {name!r}, not a string")
    n_heads = None if permuted is None else heads[0] if permuted == "q" else heads[1]
    ggml_type = GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))        # GGML order -> numpy order
    source = f"{path}:{tensor.name}"
    data = tensor.data                                                    # gguf's view: shape and bounds
    span = (int(tensor.data_offset), int(data.nbytes))                    # our copy-on-write view's bytes
    if n_heads is not None and not _rows_pair_up(data.shape, n_heads):
        raise FormatError(path, f"tensor {tensor.name!r} of shape {list(data.shape)}: its rows do not "
                                f"split into RoPE pairs for {n_heads} heads")
    if ggml_type in _NATIVE:
        dtype, shape = _original(path, tensor.name, record, ggml_type, shape)
        if n_heads is not None and not _rows_pair_up(shape, n_heads):
            raise FormatError(path, f"tensor {tensor.name!r}: recorded shape {list(shape)} does not fit {n_heads} heads")
        same_bytes = n_heads is None and dtype.itemsize == _NATIVE[ggml_type].itemsize
        return name, LazyTensor(dtype, shape, lambda: _load(mapped, span, ggml_type, dtype, shape, n_heads), source,
                                span=mapped.span(*span) if same_bytes else None)
    byte_shape = tuple(data.shape)       # gguf's reader gives block data as (rows, bytes per row)
    qdata = LazyTensor(DTYPES["uint8"], byte_shape,
                       lambda: _load(mapped, span, ggml_type, DTYPES["uint8"], byte_shape, n_heads), source)
    quantized = QuantizedTensor(scheme=ggml_type.name.lower(), layout="gguf", shape=shape, dtype=DTYPES["float32"],
                                parts={"qdata": qdata}, params={"ggml_type": ggml_type.name}, source=source)
    if options.dequantize:
        return name, LazyTensor(DTYPES["float32"], shape, quantized.load, source)
    return name, quantized


def _rows_pair_up(shape: tuple[int, ...], n_heads: int) -> bool:
    """Whether `shape`'s rows split into `n_heads` heads of RoPE pairs (what the permutation needs)."""
    return len(shape) >= 1 and shape[0] > 0 and shape[0] % (2 * n_heads) == 0


def _original(path: Path, name: str, record: dict[str, Any], ggml_type: GGMLQuantizationType,
              shape: tuple[int, ...]) -> tuple[DType, tuple[int, ...]]:
    """The dtype and shape to return: the stored ones, or those `modelkit.tensors` recorded."""
    stored = _NATIVE[ggml_type]
    recorded = record.get("dtype", stored.name)
    dtype = DTYPES.get(recorded) if isinstance(recorded, str) and recorded in _STORAGE else None
    original = record.get("shape", list(shape))
    if dtype is None or not isinstance(original, list) or not all(isinstance(d, int) and d >= 0 for d in original):
        raise FormatError(path, f"tensor {name!r}: {_KEYS.TENSORS} records {record!r}, not a dtype and shape")
    widened = ggml_type == F32 and dtype.name in _HALVES                         # norms kept in F32
    if math.prod(original) != math.prod(shape) or (dtype.itemsize != stored.itemsize and not widened):
        raise FormatError(path, f"tensor {name!r} is stored as {ggml_type.name} {list(shape)}, which cannot "
                                f"hold the recorded {dtype_name(dtype)} {original}")
    return dtype, tuple(original)


def _load(mapped: MappedFile, span: tuple[int, int], ggml_type: GGMLQuantizationType, dtype: DType,
          shape: tuple[int, ...], n_heads: int | None) -> np.ndarray:
    """One tensor's stored bits as a view of the file's pages with its dtype, shape and row order
    (copied only where a cast or llama.cpp's row permutation needs new memory)."""
    raw = mapped.view(*span, f"tensor at offset {span[0]}")
    stored = _NATIVE.get(ggml_type)
    if stored is None or dtype.itemsize == stored.itemsize:
        array = raw.view(dtype.numpy)
    else:       # F32 -> f16/bf16: exact, the values were f16/bf16 to begin with
        array = narrow_float32(raw.view(np.float32), dtype)
    array = array.reshape(shape)        # sizes were checked against the header when the file was opened
    return array if n_heads is None else _from_llama_rope(array, n_heads)



def _layout(name: str) -> Any:
    """The GGUFLayout registered model `name` declares (modelkit.models.plugin), or None."""
    from modelkit.models import MODELS, load_model_module

    layout = load_model_module(name).GGUF if name in MODELS else None
    return layout if layout is not None and layout.architecture == _LLAMA_ARCH else None


def _llama_models() -> list[str]:
    """Registered models that follow llama.cpp's llama conventions: tinylm, ..."""
    from modelkit.models import MODELS

    return [name for name in MODELS if _layout(name) is not None]


def _tinylm_spec(fields: dict[str, Any], tensors: dict[str, Any]) -> ArchSpec | None:
    """The ArchSpec of a llama file from another tool, naming the first registered llama model (tinylm)
    that can run it exactly; else None."""
    from modelkit.models import config_from_dict, config_to_dict

    n_embd, n_head = fields.get(_KEYS.EMBEDDING_LENGTH), fields.get(_KEYS.HEAD_COUNT)
    embed = tensors.get("model.embed_tokens.weight")
    if not isinstance(n_embd, int) or not isinstance(n_head, int) or n_head <= 0 or embed is None:
        return None
    head_dim = n_embd // n_head
    if fields.get(_KEYS.ROPE_SCALING_TYPE, "none") != "none" or any(
            fields.get(key, head_dim) != head_dim for key in (_KEYS.ROPE_DIMENSION_COUNT, _KEYS.KEY_LENGTH, _KEYS.VALUE_LENGTH)):
        return None
    eps = fields.get(_KEYS.RMS_EPS)
    values = {
        "vocab_size": embed.shape[0], "hidden_size": n_embd, "num_attention_heads": n_head,
        "intermediate_size": fields.get(_KEYS.FEED_FORWARD_LENGTH), "num_hidden_layers": fields.get(_KEYS.BLOCK_COUNT),
        "num_key_value_heads": fields.get(_KEYS.HEAD_COUNT_KV, n_head),
        "max_position_embeddings": fields.get(_KEYS.CONTEXT_LENGTH),
        "rope_theta": fields.get(_KEYS.ROPE_FREQ_BASE, 10000.0),
        # stored as float32: 1e-5 reads back as 9.99999974e-06; 7 digits give the written value back
        "rms_norm_eps": float(f"{eps:.7g}") if isinstance(eps, float) else None,
    }
    for name in _llama_models():
        try:
            config = config_from_dict(name, values)
        except (ConfigError, TypeError, ValueError):
            continue
        if set(tensors) == set(_llama_names(config.num_hidden_layers)):
            return ArchSpec(name, config_to_dict(config))
    return None


# --------------------------------------------------------------------------------------- write


class _SpanData:
    """What GGUFWriter.write_tensor_data needs of an array (nbytes, tofile), for bytes that go
    unchanged from a file: copied file to file by modelkit.storage.mapped.copy_span."""

    def __init__(self, span: FileSpan) -> None:
        self.span = span
        self.nbytes = span.nbytes

    def tofile(self, out: Any) -> None:
        copy_span(self.span, out)


@dataclass(frozen=True)
class _Slot:
    """One tensor to write: the Checkpoint entry and how it is stored."""

    stored: str                         # GGUF tensor name
    entry: LazyTensor | QuantizedTensor
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]              # stored shape, numpy order
    view: np.dtype                      # numpy type whose bytes gguf gets (uint8 for block-quantized data)
    n_heads: int | None = None          # permute rows for llama.cpp's RoPE
    widen: bool = False                 # f16/bf16 norm stored in F32

    def array(self) -> np.ndarray | _SpanData:
        """Load the tensor, convert it for storage and return its bytes' numpy view (or, for bytes
        stored unchanged from another file, what copies them there file to file)."""
        if isinstance(self.entry, LazyTensor) and self.entry.span is not None and self.n_heads is None \
                and not self.widen and self.entry.dtype.itemsize == self.view.itemsize:
            return _SpanData(self.entry.span)
        if isinstance(self.entry, QuantizedTensor):
            array = self.entry.parts["qdata"].array()
        else:
            array = self.entry.array()
            array = widen_to_float32(array, self.entry.dtype) if self.widen else np.ascontiguousarray(array).view(self.view)
        if self.n_heads is not None:
            array = _to_llama_rope(array, self.n_heads)
        return np.ascontiguousarray(array).reshape(self.shape if self.view != _BYTES else array.shape)


def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions()) -> None:
    """Write `ckpt` to `path`: header and tensor infos from the specs, then one tensor at a time."""
    arch, kv, slots = _plan(ckpt)          # raises UnsupportedConversionError before anything is written
    writer = GGUFWriter(None, arch)
    for key, (value, vtype, sub_type) in kv.items():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for slot in slots:
        nbytes = slot.entry.parts["qdata"].nbytes if isinstance(slot.entry, QuantizedTensor) \
            else math.prod(slot.shape) * _NATIVE[slot.ggml_type].itemsize
        shape = slot.entry.parts["qdata"].shape if slot.view == _BYTES else slot.shape
        writer.add_tensor_info(slot.stored, shape, slot.view, nbytes, raw_dtype=slot.ggml_type)
    # The writer's fixed sequence. write_tensors_to_file needs every array in memory at once, so the
    # data goes through write_tensor_data instead (its streaming form): one tensor loaded at a time.
    try:
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for slot in slots:
            writer.write_tensor_data(slot.array())
    finally:
        writer.close()


def _plan(ckpt: Checkpoint) -> tuple[str, dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]], list[_Slot]]:
    """Architecture name, metadata and tensor slots; every check that can refuse happens here."""
    try:
        aliases = dict(json.loads(ckpt.metadata.get(ALIASES_KEY, "{}")))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ConfigError(f"the checkpoint's {ALIASES_KEY} metadata is not a JSON object of names ({e})") from e
    names = [n for n in ckpt.tensors if not (n in aliases and aliases[n] in ckpt.tensors)]
    llama = _llama_config(ckpt)
    mapping = _llama_names(llama.num_hidden_layers) if llama else {}
    slots, records, taken = [], {}, set(names)
    for index, name in enumerate(names):
        stored = mapping.get(name, name)
        if len(stored.encode("utf-8")) > _MAX_NAME_BYTES:     # llama.cpp's limit; the record keeps the name
            stored = next(s for n in range(len(taken) + 1) if (s := f"modelkit.{index}.{n}") not in taken)
            taken.add(stored)
        n_heads = None
        if llama and name.endswith(("q_proj.weight", "k_proj.weight")):
            n_heads = llama.num_attention_heads if name.endswith("q_proj.weight") else llama.num_key_value_heads
        slot, record = _slot(ckpt.tensors[name], name, stored, n_heads, widen_norm=bool(llama))
        if stored != mapping.get(name, name):
            record["name"] = name
        if record:
            records[stored] = record
        slots.append(slot)
    kv: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {
        _KEYS.NAME: (ckpt.arch.name if ckpt.arch else _GENERIC_ARCH, GGUFValueType.STRING, None),
        _KEYS.FILE_TYPE: (int(_file_type(slots)), GGUFValueType.UINT32, None),
        _KEYS.QUANTIZATION_VERSION: (GGML_QUANT_VERSION, GGUFValueType.UINT32, None),
    }
    if llama:
        kv.update(_llama_kv(llama, _layout(ckpt.arch.name)))
    if ckpt.arch is not None:
        kv[_KEYS.ARCH] = (ckpt.arch.to_json(), GGUFValueType.STRING, None)
    kv[_KEYS.TENSORS] = (json.dumps(records, sort_keys=True, separators=(",", ":")), GGUFValueType.STRING, None)
    for key, value in ckpt.metadata.items():
        kv[_KEYS.META_PREFIX + key] = (value, GGUFValueType.STRING, None)
    return (_LLAMA_ARCH if llama else _GENERIC_ARCH), kv, slots


def _slot(entry: LazyTensor | QuantizedTensor, name: str, stored: str, n_heads: int | None,
          *, widen_norm: bool) -> tuple[_Slot, dict[str, Any]]:
    """How one entry is stored, and what `modelkit.tensors` must record to give it back exactly."""
    if isinstance(entry, QuantizedTensor):
        if entry.layout != "gguf" or "qdata" not in entry.parts:
            raise UnsupportedConversionError(
                "quantized checkpoint", "gguf",
                f"tensor {name!r} is quantized with layout {entry.layout!r}; dequantize it first")
        ggml_type = GGMLQuantizationType.__members__.get(str(entry.params.get("ggml_type")))
        if ggml_type is None:
            raise UnsupportedConversionError("quantized checkpoint", "gguf",
                                             f"tensor {name!r} names no GGML type ({entry.params!r})")
        if n_heads is not None and not _rows_pair_up(entry.parts["qdata"].shape, n_heads):
            raise _bad_rows(name, entry.shape, n_heads)
        return _Slot(stored, entry, ggml_type, entry.shape, _BYTES, n_heads), {}
    if entry.dtype.name not in _STORAGE:
        raise UnsupportedConversionError(dtype_name(entry.dtype), "gguf",
                                         f"tensor {name!r} has a dtype GGUF cannot hold, even as raw bytes")
    ggml_type, view = _STORAGE[entry.dtype.name]
    record: dict[str, Any] = {}
    widen = widen_norm and len(entry.shape) == 1 and entry.dtype.name in _HALVES
    if widen:                          # llama.cpp keeps norms in F32; f16/bf16 -> f32 is exact
        ggml_type, view = F32, np.dtype("<f4")
    if _NATIVE[ggml_type] is not entry.dtype:
        record["dtype"] = dtype_name(entry.dtype)
    shape = entry.shape
    if not shape:                       # gguf's reader cannot give a 0-d BF16 tensor back: store (1,)
        shape = (1,)
    elif len(shape) > _MAX_DIMS:        # llama.cpp allows 4 dimensions: fold the leading ones
        shape = (math.prod(shape[:-_MAX_DIMS + 1]), *shape[-_MAX_DIMS + 1:])
    if shape != entry.shape:
        record["shape"] = list(entry.shape)
    if n_heads is not None and not _rows_pair_up(shape, n_heads):
        raise _bad_rows(name, entry.shape, n_heads)
    return _Slot(stored, entry, ggml_type, shape, view, n_heads, widen), record


def _bad_rows(name: str, shape: tuple[int, ...], n_heads: int) -> UnsupportedConversionError:
    return UnsupportedConversionError("tinylm", "gguf", f"tensor {name!r} of shape {list(shape)} does not split "
                                                        f"into {n_heads} heads of RoPE pairs; check the ArchSpec")


def _file_type(slots: list[_Slot]) -> LlamaFileType:
    """general.file_type: the type holding most elements of the matrices, as llama.cpp names it."""
    counts: dict[GGMLQuantizationType, int] = {}
    for slot in slots:
        if len(slot.shape) >= 2:
            counts[slot.ggml_type] = counts.get(slot.ggml_type, 0) + math.prod(slot.shape)
    if not counts:
        return LlamaFileType.ALL_F32
    main = max(counts, key=lambda t: counts[t])
    if main in _FILE_TYPES:
        return _FILE_TYPES[main]
    return getattr(LlamaFileType, f"MOSTLY_{main.name}", LlamaFileType.GUESSED)


def _llama_config(ckpt: Checkpoint) -> Any:
    """The config of a model that declares GGUF = "llama" (tinylm), when the checkpoint has exactly its
    Hugging Face names; else None."""
    from modelkit.models import config_from_dict

    if ckpt.arch is None or _layout(ckpt.arch.name) is None:
        return None

    config = config_from_dict(ckpt.arch.name, ckpt.arch.config)
    return config if set(ckpt.tensors) == set(_llama_names(config.num_hidden_layers)) else None


def _llama_names(n_layers: int) -> dict[str, str]:
    names = dict(_LLAMA_NAMES)
    for n in range(n_layers):
        names.update({hf.format(n=n): g.format(n=n) for hf, g in _LLAMA_BLOCK_NAMES.items()})
    return names


def _llama_kv(config: Any, layout: Any) -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
    """llama.cpp's hyperparameters for a Hugging Face Llama config, and the tokenizer `layout` names."""
    if layout.tokenizer != "bytes":
        raise UnsupportedConversionError(type(config).__name__, "gguf", f"no GGUF writer for the {layout.tokenizer!r} "
                                         "tokenizer (known: 'bytes')")
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    tokens, types = _byte_vocab()
    return {
        _KEYS.CONTEXT_LENGTH: (config.max_position_embeddings, u32, None),
        _KEYS.EMBEDDING_LENGTH: (config.hidden_size, u32, None),
        _KEYS.BLOCK_COUNT: (config.num_hidden_layers, u32, None),
        _KEYS.FEED_FORWARD_LENGTH: (config.intermediate_size, u32, None),
        _KEYS.ROPE_DIMENSION_COUNT: (config.head_dim, u32, None),
        _KEYS.HEAD_COUNT: (config.num_attention_heads, u32, None),
        _KEYS.HEAD_COUNT_KV: (config.num_key_value_heads, u32, None),
        _KEYS.RMS_EPS: (config.rms_norm_eps, f32, None),
        _KEYS.ROPE_FREQ_BASE: (config.rope_theta, f32, None),
        _KEYS.VOCAB_SIZE: (config.vocab_size, u32, None),
        _KEYS.TOKENIZER_MODEL: ("llama", GGUFValueType.STRING, None),
        _KEYS.TOKENS: (tokens[:config.vocab_size], GGUFValueType.ARRAY, GGUFValueType.STRING),
        _KEYS.SCORES: ([0.0] * min(256, config.vocab_size), GGUFValueType.ARRAY, f32),
        _KEYS.TOKEN_TYPE: (types[:config.vocab_size], GGUFValueType.ARRAY, GGUFValueType.INT32),
        _KEYS.BOS_ID: (layout.bos_id, u32, None),
        _KEYS.EOS_ID: (layout.eos_id, u32, None),
        _KEYS.ADD_BOS: (False, GGUFValueType.BOOL, None),
        _KEYS.ADD_EOS: (False, GGUFValueType.BOOL, None),
        _KEYS.ADD_SPACE_PREFIX: (False, GGUFValueType.BOOL, None),
    }


def _byte_vocab() -> tuple[list[str], list[int]]:
    """Token i is byte i. llama.cpp's SentencePiece tokenizer turns ' ' into '▁' and looks pieces up
    by text, falling back to '<0xXX>' byte tokens; so printable ASCII are NORMAL tokens spelled as
    themselves (space as '▁') and every other byte is a BYTE token '<0xXX>': text tokenizes to its bytes."""
    tokens, types = [], []
    for byte in range(256):
        if byte == 0x20:
            tokens.append("\u2581")
        elif 0x21 <= byte <= 0x7E:
            tokens.append(chr(byte))
        else:
            tokens.append(f"<0x{byte:02X}>")
        types.append(int(TokenType.NORMAL if 0x20 <= byte <= 0x7E else TokenType.BYTE))
    return tokens, types


def _to_llama_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder each head's rows from Hugging Face's RoPE layout to llama.cpp's.

    Hugging Face rotates row i of a head with row i + head_dim/2 ("rotate half"); llama.cpp's llama
    architecture uses ggml's normal RoPE, which rotates rows 2i and 2i+1. Rows (head, half, i) become
    (head, i, half), as llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) does.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _from_llama_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of _to_llama_rope: rows (head, i, half) back to (head, half, i)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------- header bounds


def _check_layout(path: Path) -> None:
    """Check the header's counts, lengths, tensor types and data offsets against the file size
    (modelkit.parse.gguf) before gguf's reader, which trusts them, sees the file."""
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            if size < gguf_header.HEADER_BYTES:
                raise FormatError(path, f"a GGUF file has a {gguf_header.HEADER_BYTES}-byte header; "
                                        f"this file has {size} bytes")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                gguf_header.read_header(data)
    except ParseError as e:
        raise FormatError(path, str(e)) from e
    except (OSError, ValueError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(path, f"cannot read the file ({e})") from e
