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
- A Hugging Face family (modelkit/models/<family>.py) and tinylm (through the llama family's table)
  follow llama.cpp's conventions for their architecture (modelkit.models._hf.Conventions): its
  `{arch}.*` hyperparameters, `token_embd` / `blk.N.attn_q` / ... tensor names, the family's quirks
  (Q/K row permutation, Gemma's norms + 1, GPT-2's transposed Conv1D weights, Llama-3's
  `rope_freqs`), 1-D tensors in F32, and the tokenizer (tinylm's 256-token byte vocabulary; a
  folder's tokenizer.json through modelkit.models.gguf_vocab), so llama.cpp runs the file. Other
  models (or none) use the architecture "modelkit" and their own tensor names.
- Dtypes: F32, F16, BF16, F64 and I8-I64 as themselves; uint8, bool, uint16-64 and float8 as the
  signed integer type of the same width, the original dtype recorded. Nothing is lost.

Reading takes any GGUF file, llama.cpp's own included: files of a family's architecture get
Hugging Face names back (the family's storage undone) and the family's ArchSpec; block-quantized tensors (Q4_0, Q8_0, K-quants, ...) become
QuantizedTensors with layout "gguf", dequantized by gguf-py on load (float32 tensors instead with
`ReadOptions(dequantize=True)`). Before gguf's reader sees a file, every count and length in its
header is checked against the file size (the reader trusts them: an array count past the end of
the file makes it loop without end).

Longer than our usual 400 lines: the family storage rules and the header bounds walk are GGUF's alone.
"""
from __future__ import annotations

import json
import math
import mmap
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
from gguf import dequantize as gguf_dequantize

from modelkit.checkpoint import ALIASES_KEY, ARCH_KEY, ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import ConfigError, FormatError, ParseError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import FILE_TYPE_KEY, META_PREFIX, TENSORS_KEY, tied_names
from modelkit.models import _hf
from modelkit.parse import gguf as gguf_header
from modelkit.parse.detect import gguf as detect  # noqa: F401  (the converter's detect)
from modelkit.storage.dtypes import DTYPES, DType, dtype_name, narrow_float32, widen_to_float32
from modelkit.storage.mapped import FileSpan, MappedFile, copy_span
from modelkit.storage.write_behind import write_all


class _KEYS:
    """Every metadata key this module writes or reads (llama.cpp's names, as in gguf-py's constants.py)."""

    ARCHITECTURE = "general.architecture"
    NAME = "general.name"
    FILE_TYPE = "general.file_type"
    QUANTIZATION_VERSION = "general.quantization_version"
    ALIGNMENT = "general.alignment"
    # tokenizer
    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENS = "tokenizer.ggml.tokens"
    SCORES = "tokenizer.ggml.scores"
    TOKEN_TYPE = "tokenizer.ggml.token_type"
    BOS_ID = "tokenizer.ggml.bos_token_id"
    EOS_ID = "tokenizer.ggml.eos_token_id"
    PAD_ID = "tokenizer.ggml.padding_token_id"
    ADD_BOS = "tokenizer.ggml.add_bos_token"
    ADD_EOS = "tokenizer.ggml.add_eos_token"
    ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
    # modelkit's own
    ARCH = ARCH_KEY                      # "modelkit.arch": the ArchSpec as JSON
    META_PREFIX = META_PREFIX            # "modelkit.meta." + each Checkpoint metadata key; the value verbatim
    TENSORS = TENSORS_KEY                # "modelkit.tensors": stored name -> {"name", "dtype", "shape"} where they differ


_GENERIC_ARCH = "modelkit"
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

# The Hugging Face <-> llama.cpp tensor names and hyperparameters of each family are the families' own
# data (modelkit/models/<family>.py, shared rules in modelkit/models/_hf.py); tinylm uses llama's.
_LOSSY_RTOL = 2.0 ** -23      # a norm stored + 1 (Gemma) reads back within one float32 ulp of (1 + |w|)


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
        arch = ArchSpec.from_json(fields[_KEYS.ARCH], source=path) if ours and isinstance(fields.get(_KEYS.ARCH), str) \
            else None
        rules = _foreign_conventions(path, fields, reader) if not ours else _conventions(path, arch)
        tensors: dict[str, LazyTensor | QuantizedTensor] = {}
        mapped = MappedFile(path)
        for tensor in reader.tensors:
            if rules is not None and tensor.name in _hf.DERIVED_TENSORS:    # derived from the config's rope scaling
                continue
            name, entry = _entry(path, mapped, tensor, records.get(tensor.name, {}), rules, options)
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
        for alias, target in tied_names(path, metadata, tensors).items():
            tensors.setdefault(alias, tensors[target])
    else:   # a file from another tool: its scalar metadata as text, and the spec of the family it follows
        metadata = {k: str(v) for k, v in fields.items()}
        arch = _foreign_spec(tensors, rules)
    assets = _tokenizer_assets(reader) if rules is not None and rules.tokenizer == "hf" else {}
    return Checkpoint(tensors=tensors, metadata=metadata, arch=arch, assets=assets)


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


def _conventions(path: Path | str, arch: ArchSpec | None) -> _hf.Conventions | None:
    """The llama.cpp conventions of the model `arch` names (a family, or tinylm), or None."""
    from modelkit.models import gguf_conventions

    try:
        return gguf_conventions(arch)
    except (ConfigError, KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise FormatError(path, f"the architecture {arch.name!r} has a config llama.cpp's layout cannot use ({e})") from e


def _foreign_conventions(path: Path, fields: dict[str, Any], reader: GGUFReader) -> _hf.Conventions | None:
    """A file from llama.cpp (or another tool): the family its `general.architecture` names, with a config
    rebuilt from its keys; None for architectures no family follows."""
    from modelkit.models import hf_families

    architecture = fields.get(_KEYS.ARCHITECTURE)
    matches = [(name, f) for name, f in hf_families().items() if f.architecture == architecture]
    if not matches:
        return None
    name, family = next(((n, f) for n, f in matches if n == architecture), matches[0])
    if architecture == "llama" and "mistral" in str(fields.get(_KEYS.NAME, "")).lower():
        name, family = next(((n, f) for n, f in matches if n == "mistral"), (name, family))
    tied = all(t.name != "output.weight" for t in reader.tensors)
    rope = {t.name: [float(v) for v in t.data.reshape(-1)] for t in reader.tensors
            if t.name in _hf.DERIVED_TENSORS and t.tensor_type == F32 and t.data.size <= 65536}
    try:
        config = _hf.config_from_gguf(family, fields, tied=tied, rope_tensors=rope)
    except ConfigError as e:
        raise FormatError(path, str(e)) from e
    if "vocab_size" not in config:
        embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embed is not None:
            config["vocab_size"] = int(embed.shape[-1])
    return _conventions(path, ArchSpec(name, config))


def _foreign_spec(tensors: dict[str, Any], rules: _hf.Conventions | None) -> ArchSpec | None:
    """A file from another tool: its family's spec (llama's for any llama file: transformers runs them all),
    or, for a llama file with a 256-token byte vocabulary that a zoo model holds exactly, that model (tinylm)."""
    if rules is None or not set(tensors) <= set(rules.names):
        return None
    if rules.family.architecture == "llama" and rules.config.get("vocab_size") == 256:
        spec = _zoo_spec(rules, tensors)
        if spec is not None:
            return spec
    return ArchSpec(rules.family_name, rules.config)


def _zoo_spec(rules: _hf.Conventions, tensors: dict[str, Any]) -> ArchSpec | None:
    """The first registered zoo model following the llama layout (tinylm) whose config holds this file."""
    from modelkit.models import config_from_dict, config_to_dict, load_model_module, zoo_models

    config = rules.config
    if config.get("rope_parameters", {}).get("rope_type", "default") != "default" or "head_dim" in config:
        return None
    values = {k: config.get(k) for k in ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size",
                                         "num_hidden_layers", "num_key_value_heads", "max_position_embeddings",
                                         "rms_norm_eps")}
    values["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    for name in zoo_models():
        layout = getattr(load_model_module(name), "GGUF", None)
        if layout is None or layout.architecture != "llama":
            continue
        try:
            zoo = config_from_dict(name, values)
        except (ConfigError, TypeError, ValueError):
            continue
        if set(tensors) == set(_hf.tensor_names(rules.family, zoo.num_hidden_layers)):
            return ArchSpec(name, config_to_dict(zoo))
    return None


def _tokenizer_assets(reader: GGUFReader) -> dict[str, bytes]:
    """tokenizer.json and friends rebuilt from the file's tokenizer keys (modelkit.models.gguf_vocab),
    when it has them."""
    if "tokenizer.ggml.model" not in reader.fields:
        return {}
    try:
        from modelkit.models.gguf_vocab import tokenizer_assets
    except ModuleNotFoundError as e:     # the vocabulary module lands separately; until then weights only
        if e.name != "modelkit.models.gguf_vocab":
            raise
        return {}
    fields = {name: _value(field) if field.types[:1] != [GGUFValueType.ARRAY] else field.contents()
              for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return tokenizer_assets(fields)


def _entry(path: Path, mapped: MappedFile, tensor: Any, record: dict[str, Any], rules: _hf.Conventions | None,
           options: ReadOptions) -> tuple[str, LazyTensor | QuantizedTensor]:
    """One ReaderTensor as a Checkpoint entry: (name, lazy tensor), the family's storage undone."""
    name = rules.from_gguf.get(tensor.name, tensor.name) if rules is not None else tensor.name
    name = record.get("name", name)
    if not isinstance(name, str):
        raise FormatError(path, f"tensor {tensor.name!r}: {_KEYS.TENSORS} records the name {name!r}, not a string")
    undo = _Undo.of(rules, name)
    n_heads = undo.n_heads
    ggml_type = GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))        # GGML order -> numpy order
    source = f"{path}:{tensor.name}"
    data = tensor.data                                                    # gguf's view: shape and bounds
    span = (int(tensor.data_offset), int(data.nbytes))                    # our copy-on-write view's bytes
    if n_heads is not None and not _rows_pair_up(data.shape, n_heads):
        raise FormatError(path, f"tensor {tensor.name!r} of shape {list(data.shape)}: its rows do not "
                                f"split into RoPE pairs for {n_heads} heads")
    if ggml_type in _NATIVE:
        if undo.transpose and len(shape) == 2:
            shape = shape[::-1]
        dtype, shape = _original(path, tensor.name, record, ggml_type, shape)
        if n_heads is not None and not _rows_pair_up(shape, n_heads):
            raise FormatError(path, f"tensor {tensor.name!r}: recorded shape {list(shape)} does not fit {n_heads} heads")
        same_bytes = not undo and dtype.itemsize == _NATIVE[ggml_type].itemsize
        return name, LazyTensor(dtype, shape, lambda: _load(mapped, span, ggml_type, dtype, shape, undo), source,
                                span=mapped.span(*span) if same_bytes else None)
    if undo.offset:                      # a shifted norm in blocks: undone on the float values
        def values() -> np.ndarray:
            raw = mapped.view(*span, f"tensor at offset {span[0]}").reshape(data.shape)
            return gguf_dequantize(raw, ggml_type).reshape(shape) - np.float32(undo.offset)
        return name, LazyTensor(DTYPES["float32"], shape, values, source)
    byte_shape = tuple(data.shape)       # gguf's reader gives block data as (rows, bytes per row)
    qdata = LazyTensor(DTYPES["uint8"], byte_shape,
                       lambda: _load(mapped, span, ggml_type, DTYPES["uint8"], byte_shape, _Undo(undo.n_heads)), source)
    flipped = undo.transpose and len(shape) == 2        # blocks along the stored rows: the tensor says so
    params = {"ggml_type": ggml_type.name, **({"transposed": True} if flipped else {})}
    quantized = QuantizedTensor(scheme=ggml_type.name.lower(), layout="gguf", shape=shape[::-1] if flipped else shape,
                                dtype=DTYPES["float32"], parts={"qdata": qdata}, params=params, source=source)
    if options.dequantize:
        return name, LazyTensor(DTYPES["float32"], shape, quantized.load, source)
    return name, quantized


@dataclass(frozen=True)
class _Undo:
    """What a family did to one tensor on the way into GGUF (and reading undoes)."""

    n_heads: int | None = None       # rows permuted for llama.cpp's RoPE
    transpose: bool = False          # Conv1D (in, out) stored (out, in)
    offset: float = 0.0              # stored + offset (Gemma's norms)

    def __bool__(self) -> bool:
        return self.n_heads is not None or self.transpose or bool(self.offset)

    @classmethod
    def of(cls, rules: _hf.Conventions | None, name: str) -> _Undo:
        if rules is None:
            return cls()
        return cls(rules.heads.get(name), name in rules.transposed,
                   rules.family.norm_offset if name in rules.offsets else 0.0)


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
          shape: tuple[int, ...], undo: _Undo) -> np.ndarray:
    """One tensor's stored bits as a view of the file's pages with its dtype, shape and row order
    (copied only where a cast or the family's storage rules need new memory)."""
    raw = mapped.view(*span, f"tensor at offset {span[0]}")
    stored = _NATIVE.get(ggml_type)
    if undo.offset:
        raw = raw.view(np.float32) - np.float32(undo.offset)
    if stored is None or dtype.itemsize == stored.itemsize:
        array = raw.view(dtype.numpy)
    else:       # F32 -> f16/bf16: exact, the values were f16/bf16 to begin with
        array = narrow_float32(raw.view(np.float32), dtype)
    if undo.transpose and len(shape) == 2:
        return np.ascontiguousarray(array.reshape(shape[::-1]).T)
    array = array.reshape(shape)        # sizes were checked against the header when the file was opened
    return array if undo.n_heads is None else _hf.from_llama_rope(array, undo.n_heads)

# --------------------------------------------------------------------------------------- write


class _ArrayData:
    """An array for GGUFWriter.write_tensor_data whose bytes go out in write() calls of at most 1 MiB
    (numpy's tofile writes them in one: storage.write_behind says why that is slow)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.nbytes = np.ascontiguousarray(array), array.nbytes

    def tofile(self, out: Any) -> None:
        write_all(out, self.array.reshape(-1).view(np.uint8))


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
    undo: _Undo = _Undo()               # the family's storage rules (row permutation, transpose, offset)
    widen: bool = False                 # f16/bf16 1-D tensor stored in F32

    def array(self) -> np.ndarray | _SpanData:
        """Load the tensor, convert it for storage and return its bytes' numpy view (or, for bytes
        stored unchanged from another file, what copies them there file to file)."""
        if isinstance(self.entry, LazyTensor) and self.entry.span is not None and not self.undo \
                and not self.widen and self.entry.dtype.itemsize == self.view.itemsize:
            return _SpanData(self.entry.span)
        if isinstance(self.entry, QuantizedTensor):
            array = self.entry.parts["qdata"].array()
        else:
            array = self.entry.array()
            array = widen_to_float32(array, self.entry.dtype) if self.widen else np.ascontiguousarray(array).view(self.view)
            if self.undo.offset:           # Gemma: llama.cpp multiplies by the stored weight, Gemma by 1 + weight
                array = array.astype(np.float32) + np.float32(self.undo.offset)
            if self.undo.transpose:
                array = array.T
        if self.undo.n_heads is not None:
            array = _hf.to_llama_rope(array, self.undo.n_heads)
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
            data = slot.array()
            writer.write_tensor_data(data if isinstance(data, _SpanData) else _ArrayData(data))
    finally:
        writer.close()


def verify_plan(ckpt: Checkpoint, options: WriteOptions = WriteOptions()) -> tuple[set[str], dict[str, float]]:
    """What reading the written file back cannot give exactly, for the write path's check: the names a
    family drops on purpose (GPT-2's mask buffers) and, per tensor, the relative tolerance of values a
    family stores shifted (Gemma's norms + 1, rounded in float32)."""
    rules = _rules_for(ckpt)
    if rules is None:
        return set(), {}
    return ({n for n in ckpt.tensors if rules.dropped(n)},
            {n: _LOSSY_RTOL for n in ckpt.tensors if n in rules.offsets})


def _rules_for(ckpt: Checkpoint) -> _hf.Conventions | None:
    """The checkpoint's llama.cpp conventions when its names are the ones they map; for a Hugging Face
    family any other name is an error (llama.cpp would not run the file), for a zoo model (tinylm pruned
    into another shape...) the generic layout is used instead."""
    rules = _conventions("checkpoint", ckpt.arch)
    if rules is None:
        return None
    aliases = _aliases(ckpt)
    names = {n for n in ckpt.tensors if not (n in aliases and aliases[n] in ckpt.tensors) and not rules.dropped(n)}
    if rules.tokenizer == "bytes":
        return rules if names == set(rules.names) else None
    unknown = sorted(names - set(rules.names))
    if unknown:
        raise UnsupportedConversionError(
            rules.family_name, "gguf", f"tensor {unknown[0]!r} has no llama.cpp name in the {rules.family_name} family "
                                       f"(modelkit/models/{rules.family_name}.py)")
    return rules


def _aliases(ckpt: Checkpoint) -> dict[str, str]:
    try:
        return dict(json.loads(ckpt.metadata.get(ALIASES_KEY, "{}")))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ConfigError(f"the checkpoint's {ALIASES_KEY} metadata is not a JSON object of names ({e})") from e


KV = dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]


def _plan(ckpt: Checkpoint) -> tuple[str, KV, list[_Slot]]:
    """Architecture name, metadata and tensor slots; every check that can refuse happens here."""
    aliases = _aliases(ckpt)
    rules = _rules_for(ckpt)
    names = [n for n in ckpt.tensors if not (n in aliases and aliases[n] in ckpt.tensors)
             and not (rules is not None and rules.dropped(n))]
    mapping = rules.names if rules else {}
    slots, records, taken = [], {}, set(names)
    for index, name in enumerate(names):
        stored = mapping.get(name, name)
        if len(stored.encode("utf-8")) > _MAX_NAME_BYTES:     # llama.cpp's limit; the record keeps the name
            stored = next(s for n in range(len(taken) + 1) if (s := f"modelkit.{index}.{n}") not in taken)
            taken.add(stored)
        slot, record = _slot(ckpt.tensors[name], name, stored, _Undo.of(rules, name), f32_vectors=rules is not None)
        if stored != mapping.get(name, name):
            record["name"] = name
        if record:
            records[stored] = record
        slots.append(slot)
    kv: KV = {
        _KEYS.NAME: (_display_name(ckpt, rules), GGUFValueType.STRING, None),
        _KEYS.FILE_TYPE: (_stated_file_type(ckpt) or int(_file_type(slots)), GGUFValueType.UINT32, None),
        _KEYS.QUANTIZATION_VERSION: (GGML_QUANT_VERSION, GGUFValueType.UINT32, None),
    }
    if rules is not None:
        kv.update(_family_kv(rules, ckpt))
        for stored, factors in _hf.rope_tensors(rules.family, rules.config).items():   # llama.cpp reads rope scaling here
            array = np.asarray(factors, dtype=np.float32)
            slots.append(_Slot(stored, LazyTensor(DTYPES["float32"], array.shape, lambda array=array: array, "rope scaling"),
                               F32, array.shape, np.dtype("<f4")))
    if ckpt.arch is not None:
        kv[_KEYS.ARCH] = (ckpt.arch.to_json(), GGUFValueType.STRING, None)
    kv[_KEYS.TENSORS] = (json.dumps(records, sort_keys=True, separators=(",", ":")), GGUFValueType.STRING, None)
    for key, value in ckpt.metadata.items():
        if key != FILE_TYPE_KEY:
            kv[_KEYS.META_PREFIX + key] = (value, GGUFValueType.STRING, None)
    return (rules.family.architecture if rules else _GENERIC_ARCH), kv, slots


def _slot(entry: LazyTensor | QuantizedTensor, name: str, stored: str, undo: _Undo,
          *, f32_vectors: bool) -> tuple[_Slot, dict[str, Any]]:
    """How one entry is stored, and what `modelkit.tensors` must record to give it back exactly."""
    n_heads = undo.n_heads
    if isinstance(entry, QuantizedTensor):
        if entry.layout != "gguf" or "qdata" not in entry.parts:
            raise UnsupportedConversionError(
                "quantized checkpoint", "gguf",
                f"tensor {name!r} is quantized with layout {entry.layout!r} ({entry.scheme}); write it dequantized "
                "with --dtype f32/f16/bf16")
        ggml_type = GGMLQuantizationType.__members__.get(str(entry.params.get("ggml_type")))
        if ggml_type is None:
            raise UnsupportedConversionError("quantized checkpoint", "gguf",
                                             f"tensor {name!r} names no GGML type ({entry.params!r})")
        flipped = bool(entry.params.get("transposed"))      # blocks already along the stored rows
        if undo.offset or undo.transpose != flipped:
            raise UnsupportedConversionError("quantized checkpoint", "gguf",
                                             f"tensor {name!r} is quantized in another layout than its family stores "
                                             "(transposed or shifted); quantize it from the float weights")
        if n_heads is not None and not _rows_pair_up(entry.parts["qdata"].shape, n_heads):
            raise _bad_rows(name, entry.shape, n_heads)
        return _Slot(stored, entry, ggml_type, entry.shape[::-1] if flipped else entry.shape, _BYTES,
                     _Undo(n_heads)), {}
    if entry.dtype.name not in _STORAGE:
        raise UnsupportedConversionError(dtype_name(entry.dtype), "gguf",
                                         f"tensor {name!r} has a dtype GGUF cannot hold, even as raw bytes")
    ggml_type, view = _STORAGE[entry.dtype.name]
    record: dict[str, Any] = {}
    widen = f32_vectors and len(entry.shape) == 1 and entry.dtype.name in _HALVES
    if widen:                          # llama.cpp keeps norms and vectors in F32; f16/bf16 -> f32 is exact
        ggml_type, view = F32, np.dtype("<f4")
    if _NATIVE[ggml_type] is not entry.dtype:
        record["dtype"] = dtype_name(entry.dtype)
    shape = entry.shape
    if undo.transpose and len(shape) == 2:
        shape = shape[::-1]
    if not shape:                       # gguf's reader cannot give a 0-d BF16 tensor back: store (1,)
        shape = (1,)
    elif len(shape) > _MAX_DIMS:        # llama.cpp allows 4 dimensions: fold the leading ones
        shape = (math.prod(shape[:-_MAX_DIMS + 1]), *shape[-_MAX_DIMS + 1:])
    if shape != entry.shape and not undo.transpose:
        record["shape"] = list(entry.shape)
    if n_heads is not None and not _rows_pair_up(shape, n_heads):
        raise _bad_rows(name, entry.shape, n_heads)
    return _Slot(stored, entry, ggml_type, shape, view, undo, widen), record


def _bad_rows(name: str, shape: tuple[int, ...], n_heads: int) -> UnsupportedConversionError:
    return UnsupportedConversionError("checkpoint", "gguf", f"tensor {name!r} of shape {list(shape)} does not split "
                                                            f"into {n_heads} heads of RoPE pairs; check the ArchSpec")


def _stated_file_type(ckpt: Checkpoint) -> int | None:
    """The LLAMA_FTYPE a recipe stated (FILE_TYPE_KEY), or None."""
    value = ckpt.metadata.get(FILE_TYPE_KEY)
    if value is None:
        return None
    if not str(value).isdigit():
        raise ConfigError(f"the checkpoint's {FILE_TYPE_KEY} metadata is {value!r}, not llama.cpp's file type number")
    return int(value)


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


_VALUE_TYPES = ((bool, GGUFValueType.BOOL), (int, GGUFValueType.UINT32), (float, GGUFValueType.FLOAT32),
                (str, GGUFValueType.STRING))


def _family_kv(rules: _hf.Conventions, ckpt: Checkpoint) -> KV:
    """llama.cpp's hyperparameters (`{arch}.*`) for the model's config, and its tokenizer's keys."""
    try:
        values = _hf.gguf_hparams(rules.family, rules.config)
    except (ConfigError, KeyError, TypeError, ZeroDivisionError) as e:
        raise UnsupportedConversionError(rules.family_name, "gguf", f"the config cannot be stored for llama.cpp ({e})") from e
    kv: KV = {}
    for suffix, value in values.items():
        vtype = next(t for cls, t in _VALUE_TYPES if isinstance(value, cls))
        kv[f"{rules.family.architecture}.{suffix}"] = (value, vtype, None)
    if rules.tokenizer == "bytes":
        kv.update(_byte_vocab_kv(int(values.get("vocab_size", 256)), rules))
    elif "tokenizer.json" in ckpt.assets:
        from modelkit.models.gguf_vocab import gguf_tokenizer_kv

        kv.update(gguf_tokenizer_kv(ckpt.assets, int(values.get("vocab_size", 0))))
    else:                  # no tokenizer files: the special token ids config.json names (as llama.cpp's SpecialVocab reads them)
        for key, config_key in _SPECIAL_IDS.items():
            value = rules.config.get(config_key)
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < int(values.get("vocab_size", 2**31)):
                kv[key] = (value, GGUFValueType.UINT32, None)
    return kv


_SPECIAL_IDS = {_KEYS.BOS_ID: "bos_token_id", _KEYS.EOS_ID: "eos_token_id", _KEYS.PAD_ID: "pad_token_id"}


def _display_name(ckpt: Checkpoint, rules: _hf.Conventions | None) -> str:
    """general.name: the zoo model's name; for a Hugging Face family the folder's `_name_or_path` or the
    family's class ("Mistral": transformers' GGUF loader treats a file named exactly "mistral" as a
    Mistral architecture gguf-py does not have)."""
    if ckpt.arch is None:
        return _GENERIC_ARCH
    if rules is None or rules.tokenizer == "bytes":
        return ckpt.arch.name
    source = rules.config.get("_name_or_path")
    if isinstance(source, str) and source.strip("/"):
        return source.rstrip("/").rsplit("/", 1)[-1]
    return rules.family.hf_class.removesuffix("ForCausalLM").removesuffix("LMHeadModel")


def _byte_vocab_kv(vocab_size: int, rules: _hf.Conventions) -> KV:
    """tinylm's tokenizer: token i is byte i, as llama.cpp's SentencePiece-style byte vocabulary."""
    u32 = GGUFValueType.UINT32
    tokens, types = _byte_vocab()
    return {
        _KEYS.TOKENIZER_MODEL: ("llama", GGUFValueType.STRING, None),
        _KEYS.TOKENS: (tokens[:vocab_size], GGUFValueType.ARRAY, GGUFValueType.STRING),
        _KEYS.SCORES: ([0.0] * min(256, vocab_size), GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
        _KEYS.TOKEN_TYPE: (types[:vocab_size], GGUFValueType.ARRAY, GGUFValueType.INT32),
        _KEYS.BOS_ID: (rules.bos_id, u32, None),
        _KEYS.EOS_ID: (rules.eos_id, u32, None),
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
