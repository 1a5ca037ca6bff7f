"""onnx: the model's graph and weights as one ONNX ModelProto; runs in onnxruntime.

Spec: https://onnx.ai/onnx/repo-docs/IR.html and onnx/onnx.proto. A file is one serialized
protobuf message with no magic number. The fields modelkit reads (number: type):

    ModelProto   1 ir_version varint | 2 producer_name | 3 producer_version | 4 domain | 5 model_version
                 | 6 doc_string | 7 graph | 8 opset_import | 14 metadata_props {1 key, 2 value} | 20, 25, 26
    GraphProto   1 node | 2 name | 5 initializer (TensorProto) | 15 sparse_initializer | 11 input | 12 output
    TensorProto  1 dims (int64, packed or not) | 2 data_type | 8 name | 9 raw_data (little-endian)
                 | 13 external_data {location, offset, length} | 14 data_location (1 = external)
                 | 4, 5, 7, 10, 11 typed values (float_data, int32_data, int64_data, double_data, uint64_data)

Write: `torch.onnx.export` (the torch.export-based exporter, torch's default since 2.9) at opset
20, with a dynamic batch axis (and a dynamic sequence axis for tinylm), then
`onnx.checker.check_model(full_check=True)`. A Hugging Face causal LM (modelkit/testing/causal_lm.py
recognises one by its config and forward) is exported with the signature input_ids, attention_mask,
position_ids -> logits, batch and sequence free; with `WriteOptions.kv_cache` also
past_key_values.N.key/value -> present.N.key/value (docs/formats/onnx.md, "Hugging Face causal LMs").
The exporter's optimizer renames, transposes and
de-duplicates initializers, so the state_dict name of every tensor is stored in
`metadata_props["modelkit.names"]` ({name: {"initializer": ..., "transpose": [1, 0]}}); a tensor
the exporter folded away is kept as an extra, unused initializer, so reading back is bit-exact.
`metadata_props` also holds the ArchSpec (`modelkit.arch`), `modelkit.version` and the
Checkpoint's str->str metadata.

Models over 2 GiB keep their weights in `<name>.onnx.data` beside the file (ONNX external data);
the file itself stays under protobuf's 2 GiB limit.

Quantized checkpoints are written as QDQ weight-only graphs at opset 21: the float model holding
the dequantized weights is exported, then each quantized weight's initializer is replaced by
integer (INT8 / UINT8 / INT4 / UINT4), float32 scale and zero point initializers feeding a
DequantizeLinear node whose output has the old initializer's name (modelkit/storage/qdq.py has the
mapping). `metadata_props["modelkit.quantized"]` records, per weight, what rebuilds the
QuantizedTensor bit for bit on reading (scheme, layout, shape, dtype, params, encoding, transpose,
scale dtype, initializer names); its `modelkit.names` entry is `{"quantized": true}`.

Read: the header is walked here without loading tensor data (and without onnx.load, which would
read every byte): each initializer becomes a LazyTensor reading its bytes from the file or from
the external data file. External data must be a file inside the model's folder (no `..`, no
absolute path, no symlink out), and every offset and length is checked against its file's size
before anything is read. `runnable` checks every tensor of the model the same way before
onnxruntime sees it.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import math
import mmap
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from google.protobuf.message import DecodeError
from onnx import TensorProto, numpy_helper

from modelkit import __version__
from modelkit.checkpoint import ARCH_KEY, ArchSpec, Checkpoint, LazyTensor, QuantizedTensor, _tied_names, instantiate
from modelkit.errors import ConfigError, FormatError, ParseError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions
from modelkit.metadata import NAMES_KEY, VERSION_KEY, json_object
from modelkit.models import MODELS
from modelkit.parse.detect import onnx as detect  # noqa: F401  (the converter's detect)
from modelkit.parse.onnx import GRAPH, MODEL, TENSOR, TYPED_TENSOR_FIELDS
from modelkit.parse.paths import resolve_location
from modelkit.parse.protobuf import LEN, VARINT, fields, int64s, string_pairs, text
from modelkit.storage import qdq, quantized_layout
from modelkit.storage.dtypes import tensor_bytes
from modelkit.testing import causal_lm
from modelkit.testing import export as export_shapes

logger = logging.getLogger(__name__)

OPSET = 20                          # torch.onnx's default; onnxruntime >= 1.17 runs it
QDQ_OPSET = 21                      # quantized weights: DequantizeLinear's block_size and INT4/UINT4 arrived in 21
QDQ_ACCURACY_LEVEL = "session.qdq_matmulnbits_accuracy_level"   # onnxruntime session config key
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**24   # weights above this go to external data (protobuf caps a file at 2 GiB)
_INLINE_LIMIT = 1024                # with external data, tensors smaller than this stay in the file (onnx's default)
_ALIGNMENT = 65536                  # external tensors over 1 MiB start at 64 KiB offsets, so runtimes can mmap them

# ONNX element types torch can hold (TensorProto.DataType); raw bytes are little-endian in both.
_DTYPES: dict[int, torch.dtype] = {
    TensorProto.FLOAT: torch.float32, TensorProto.DOUBLE: torch.float64, TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16, TensorProto.INT8: torch.int8, TensorProto.INT16: torch.int16,
    TensorProto.INT32: torch.int32, TensorProto.INT64: torch.int64, TensorProto.UINT8: torch.uint8,
    TensorProto.UINT16: torch.uint16, TensorProto.UINT32: torch.uint32, TensorProto.UINT64: torch.uint64,
    TensorProto.BOOL: torch.bool, TensorProto.COMPLEX64: torch.complex64, TensorProto.COMPLEX128: torch.complex128,
    TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn, TensorProto.FLOAT8E5M2: torch.float8_e5m2,
    TensorProto.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz, TensorProto.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
}
_ONNX_TYPES: dict[torch.dtype, int] = {v: k for k, v in _DTYPES.items()}
# 4-bit types (opset 21): raw data packs two values a byte, the first in the low nibble; read as
# one int8 / uint8 value per element.
_PACKED4: dict[int, torch.dtype] = {TensorProto.INT4: torch.int8, TensorProto.UINT4: torch.uint8}


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class _Initializer:
    """Where one initializer's bytes are: in the file (raw or typed values) or in an external file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    offset: int
    length: int
    typed: bool = False          # offset/length span the whole TensorProto: parse it with onnx
    packed4: bool = False        # INT4 / UINT4: two values a byte, loaded unpacked as `dtype`


def read(path: Path, options: ReadOptions = ReadOptions()) -> Checkpoint:
    """Initializers as lazy tensors under their state_dict names (or their own names for files
    modelkit did not write); metadata_props as metadata and ArchSpec. Reads no tensor data."""
    try:
        initializers, metadata = _index(path)
    except ParseError as e:
        raise FormatError(path, f"not a readable ONNX file ({e})") from e
    names = metadata.pop(NAMES_KEY, None)
    record = metadata.pop(quantized_layout.QUANTIZED_KEY, None)
    quantized, claimed = _quantized_tensors(path, initializers, record) if record is not None else ({}, set())
    if quantized and names is None:
        raise FormatError(path, f"it has a {quantized_layout.QUANTIZED_KEY} entry but no {NAMES_KEY} entry")
    tensors = _named_tensors(path, initializers, names, quantized, claimed)
    arch_json = metadata.pop(ARCH_KEY, None)
    arch = ArchSpec.from_json(arch_json, source=path) if arch_json is not None else None
    return Checkpoint(tensors=tensors, metadata=metadata, arch=arch)


def _index(path: Path) -> tuple[dict[str, _Initializer], dict[str, str]]:
    if not path.is_file():
        raise FormatError(path, "not a file")
    if path.stat().st_size == 0:
        raise FormatError(path, "empty file; not an ONNX model")
    initializers: dict[str, _Initializer] = {}
    metadata: dict[str, str] = {}
    graphs = 0
    try:
        f = path.open("rb")
    except OSError as e:
        raise FormatError(path, f"cannot open it ({e.strerror})") from e
    with f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for number, wire, value in fields(buf, 0, len(buf)):
            if number == MODEL["metadata_props"] and wire == LEN:
                key, text = string_pairs(buf, value)
                metadata[key] = text
            elif number == MODEL["graph"] and wire == LEN:
                graphs += 1  # a repeated message field merges, so initializers of every copy count
                for n, w, v in fields(buf, *value):
                    if n == GRAPH["sparse_initializer"]:
                        raise ParseError("it has sparse initializers, which modelkit does not read")
                    if n == GRAPH["initializer"] and w == LEN:
                        init = _initializer(buf, path, *v)
                        if init.name in initializers:
                            raise ParseError(f"initializer {init.name!r} appears twice")
                        initializers[init.name] = init
    if not graphs:
        raise ParseError("no graph")
    return initializers, metadata


def _initializer(buf: Any, path: Path, start: int, end: int) -> _Initializer:
    dims: list[int] = []
    data_type, name, raw, typed, location = 0, "", None, False, 0
    external: dict[str, str] = {}
    for number, wire, value in fields(buf, start, end):
        if number == TENSOR["dims"]:
            dims += int64s(buf, wire, value)
        elif number == TENSOR["data_type"] and wire == VARINT:
            data_type = value
        elif number == TENSOR["name"] and wire == LEN:
            name = text(buf, value)
        elif number == TENSOR["raw_data"] and wire == LEN:
            raw = value
        elif number == TENSOR["external_data"] and wire == LEN:
            key, entry = string_pairs(buf, value)
            external[key] = entry
        elif number == TENSOR["data_location"] and wire == VARINT:
            location = value
        elif number == TENSOR["segment"]:
            raise ParseError(f"tensor {name or '?'!r} is segmented, which modelkit does not read")
        elif number in TYPED_TENSOR_FIELDS:
            typed = True
    if not name:
        raise ParseError("an initializer has no name (ONNX requires one)")
    label = repr(name)
    packed4 = data_type in _PACKED4
    dtype = _PACKED4.get(data_type) or _DTYPES.get(data_type)
    if dtype is None:
        kind = TensorProto.DataType.Name(data_type) if data_type in TensorProto.DataType.values() else data_type
        raise ParseError(f"initializer {label} has element type {kind}, which torch cannot hold")
    if any(d < 0 for d in dims):
        raise ParseError(f"initializer {label} has negative dims {dims}")
    nbytes = (math.prod(dims) + 1) // 2 if packed4 else math.prod(dims) * dtype.itemsize
    shape = tuple(dims)
    if location == TensorProto.EXTERNAL or external:
        file, offset, length = _external(path, name, external, nbytes)
        return _Initializer(name, dtype, shape, file, offset, length, packed4=packed4)
    if raw is not None:
        if raw[1] - raw[0] != nbytes:
            kind = "4-bit" if packed4 else str(dtype)
            raise ParseError(f"initializer {label} has {raw[1] - raw[0]} bytes of data; {kind} {dims} needs {nbytes}")
        return _Initializer(name, dtype, shape, path, raw[0], nbytes, packed4=packed4)
    if math.prod(dims) > 2 * (end - start):  # every typed value takes at least half a byte
        raise ParseError(f"initializer {label} claims {math.prod(dims)} values in a {end - start}-byte message")
    if math.prod(dims) and not typed:
        raise ParseError(f"initializer {label} has no data")
    return _Initializer(name, dtype, shape, path, start, end - start, typed=True, packed4=packed4)


def _external(path: Path, name: str, info: dict[str, str], nbytes: int | None) -> tuple[Path, int, int]:
    """The checked (file, offset, length) of an external tensor: inside the model's folder, within the
    file, and as long as its dtype and dims need (when modelkit knows the dtype: `nbytes`)."""
    data = _data_file(path, info.get("location", ""), name)
    size = data.stat().st_size
    try:
        offset = int(info.get("offset", "0"))
        length = int(info["length"]) if "length" in info else nbytes if nbytes is not None else size - offset
    except ValueError as e:
        raise ParseError(f"initializer {name!r} has a non-numeric external offset or length") from e
    if offset < 0 or length < 0 or (nbytes is not None and length != nbytes) or offset + length > size:
        raise ParseError(f"initializer {name!r} wants bytes {offset}..{offset + length} (needs {nbytes}) "
                         f"of {data.name}, which has {size}")
    return data, offset, length


def _data_file(path: Path, location: str, name: str) -> Path:
    """Resolve an external data location; refuse anything that is not a file inside the model's folder."""
    return Path(resolve_location(str(path.absolute().parent.resolve()), location, what=f"initializer {name!r}"))


def _named_tensors(path: Path, initializers: dict[str, _Initializer], names_json: str | None,
                   quantized: dict[str, QuantizedTensor], claimed: set[str]) -> dict[str, LazyTensor | QuantizedTensor]:
    """The state_dict names in their order; a `{"quantized": true}` entry takes its tensor from `quantized`,
    and no other entry may name an initializer of `claimed` (the quantized tensors' parts)."""
    if names_json is None:  # not written by modelkit: the initializers as they are named
        return {name: _lazy(init) for name, init in initializers.items()}
    names = json_object(path, NAMES_KEY, names_json, what="map state_dict names to initializers")
    tensors: dict[str, LazyTensor | QuantizedTensor] = {}
    for name, entry in names.items():
        if entry == {"quantized": True}:
            if name not in quantized:
                raise FormatError(path, f"{NAMES_KEY} says {name!r} is quantized, but the "
                                        f"{quantized_layout.QUANTIZED_KEY} entry does not describe it")
            tensors[name] = quantized[name]
            continue
        source = entry.get("initializer") if isinstance(entry, dict) else None
        init = initializers.get(source) if isinstance(source, str) and source not in claimed else None
        if init is None:
            raise FormatError(path, f"{NAMES_KEY} maps {name!r} to {source!r}, which is not an initializer in the file")
        perm = entry.get("transpose")
        if perm is None:
            tensors[name] = _lazy(init)
            continue
        if not isinstance(perm, list) or not all(type(p) is int for p in perm) or sorted(perm) != list(range(len(init.shape))):
            raise FormatError(path, f"{NAMES_KEY} gives {name!r} the transpose {perm!r}, which does not fit "
                                    f"{list(init.shape)}")
        shape = tuple(init.shape[p] for p in perm)
        tensors[name] = LazyTensor(init.dtype, shape, lambda init=init, perm=perm: _load(init).permute(perm).contiguous(),
                                   f"{init.file}:{name}")
    missing = sorted(set(quantized) - set(tensors))
    if missing:
        raise FormatError(path, f"quantized tensor {missing[0]!r} is not among the {NAMES_KEY} entries")
    return tensors


# Roles of DequantizeLinear's inputs -> suffix of their initializers' names (onnxruntime's quantizer's names).
_QDQ_SUFFIXES = {"data": "_quantized", "scale": "_scale", "zero_point": "_zero_point"}


def _quantized_tensors(path: Path, initializers: dict[str, _Initializer],
                       raw: str) -> tuple[dict[str, QuantizedTensor], set[str]]:
    """QuantizedTensors from the "modelkit.quantized" record, and the initializers they claim. Each part
    is decoded from DequantizeLinear's integer, scale and zero point initializers when it is loaded;
    every field of the record is checked first."""
    record = quantized_layout.parse_record(path, raw)
    claimed: set[str] = set()
    tensors = {}
    for name, info in record.items():
        bad = functools.partial(_bad_record, path, name)
        transpose = info.get("transpose")
        if transpose not in (None, [1, 0]):
            raise bad(f"transpose {transpose!r} is not [1, 0]")
        try:
            layout = qdq.layout(info["scheme"], info["layout"], tuple(info["shape"]), info["params"],
                                transposed=transpose is not None)
        except UnsupportedConversionError as e:
            raise bad(e.reason) from e
        if info.get("encoding") != layout.encoding:
            raise bad(f"encoding {info.get('encoding')!r} does not fit its layout and params ({layout.encoding})")
        # affine scales come back in their stored dtype; GGUF's d is always f16 inside the block bytes
        logical = quantized_layout.LOGICAL_DTYPES.get(info.get("scale_dtype") if layout.encoding == "affine" else "float16")
        if logical is None:
            raise bad(f"scale_dtype {info.get('scale_dtype')!r} is not one of {', '.join(quantized_layout.LOGICAL_DTYPES)}")
        scale_dtype = logical.torch
        inputs = _qdq_inputs(layout)
        if set(info["parts"]) != set(inputs):
            raise bad(f"parts {sorted(info['parts'])} are not the DequantizeLinear inputs {sorted(inputs)}")
        found = {}
        for role, stored in info["parts"].items():
            init = initializers.get(stored)
            if init is None or stored in claimed:
                raise bad(f"{role} names {stored!r}, which is missing or belongs to another tensor")
            if (init.dtype, init.packed4, init.shape) != inputs[role]:
                raise bad(f"{role} {stored!r} is not {_describe_input(*inputs[role])}")
            claimed.add(stored)
            found[role] = init
        parts = {part: LazyTensor(dtype, shape, functools.partial(_decode_part, path, name, part, layout, scale_dtype, found),
                                  f"{path}:{found['data'].name}")
                 for part, (dtype, shape) in qdq.part_specs(layout, scale_dtype).items()}
        tensors[name] = quantized_layout.quantized_tensor(path, name, info, parts)
    return tensors, claimed


def _bad_record(path: Path, name: str, why: str) -> FormatError:
    return FormatError(path, f"quantized tensor {name!r}: {why}")


def _qdq_inputs(layout: qdq.QDQLayout) -> dict[str, tuple[torch.dtype, bool, tuple[int, ...]]]:
    """role -> (dtype as loaded, 4-bit, dims) of each DequantizeLinear input the layout has."""
    data = (torch.int8 if layout.signed else torch.uint8, layout.bits == 4)
    inputs = {"data": (*data, layout.data_shape), "scale": (torch.float32, False, layout.scale_shape)}
    if layout.zero_point:
        inputs["zero_point"] = (*data, layout.scale_shape)
    return inputs


def _describe_input(dtype: torch.dtype, packed4: bool, shape: tuple[int, ...]) -> str:
    kind = "FLOAT" if dtype == torch.float32 else ("INT" if dtype == torch.int8 else "UINT") + ("4" if packed4 else "8")
    return f"{kind} {list(shape)}"


def _decode_part(path: Path, name: str, part: str, layout: qdq.QDQLayout, scale_dtype: torch.dtype,
                 found: dict[str, _Initializer]) -> torch.Tensor:
    try:
        return qdq.decode_part(part, layout, scale_dtype, lambda role: _load(found[role]))
    except ValueError as e:
        raise FormatError(path, f"quantized tensor {name!r}: {e}") from e


def _lazy(init: _Initializer) -> LazyTensor:
    return LazyTensor(init.dtype, init.shape, lambda: _load(init), f"{init.file}:{init.name}")


def _load(init: _Initializer) -> torch.Tensor:
    data = bytearray(init.length)         # checked against the file size when the header was read
    try:
        with init.file.open("rb") as f:
            f.seek(init.offset)
            got = f.readinto(data)
    except OSError as e:
        raise FormatError(init.file, f"cannot read tensor {init.name!r} ({e.strerror})") from e
    if got != init.length:
        raise FormatError(init.file, f"tensor {init.name!r} is cut short: {got} of {init.length} bytes")
    if init.typed:
        try:
            array = numpy_helper.to_array(TensorProto.FromString(bytes(data)))
            data = bytearray((array.astype(str(init.dtype).removeprefix("torch.")) if init.packed4 else array).tobytes())
        except (DecodeError, ValueError, TypeError, IndexError) as e:
            raise FormatError(init.file, f"tensor {init.name!r} has unreadable values ({e})") from e
        if len(data) != math.prod(init.shape) * init.dtype.itemsize:
            raise FormatError(init.file, f"tensor {init.name!r} holds {len(data)} bytes, not {list(init.shape)}")
    elif init.packed4 and data:
        values = qdq.unpack4(torch.frombuffer(data, dtype=torch.uint8), math.prod(init.shape), signed=init.dtype == torch.int8)
        return values.reshape(init.shape)
    if not data:
        return torch.empty(init.shape, dtype=init.dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(init.dtype).reshape(init.shape)


# ---------------------------------------------------------------- running


def runnable(path: Path, options: ReadOptions = ReadOptions()) -> Callable[..., Any]:
    """An onnxruntime session (CPU) on the file, as a callable on torch tensors returning torch tensors.

    Every tensor of the model (initializers, Constant nodes, subgraphs, functions) is checked
    first: external data must be a file inside the model's folder, with offsets inside it.

    Quantized weights (DequantizeLinear -> MatMul) run as the graph says, in float32:
    onnxruntime's default fuses them into MatMulNBits that round activations to int8
    (`session.qdq_matmulnbits_accuracy_level` 4), an approximation of its own; see
    docs/formats/onnx.md for what that costs.
    """
    import onnxruntime as ort

    try:
        data = path.read_bytes()
        model = onnx.ModelProto.FromString(data)
    except OSError as e:
        raise FormatError(path, f"cannot read it ({e.strerror})") from e
    except DecodeError as e:
        raise FormatError(path, f"not a readable ONNX file ({e})") from e
    try:
        for tensor in _all_tensors(model):
            if tensor.data_location == TensorProto.EXTERNAL or len(tensor.external_data):
                info = {entry.key: entry.value for entry in tensor.external_data}
                _external(path, tensor.name, info, _expected_bytes(tensor))
    except ParseError as e:
        raise FormatError(path, f"refusing to run it: {e}") from e
    session_options = ort.SessionOptions()
    session_options.log_severity_level = 3      # errors only: ORT's warnings go to stderr otherwise
    # Loaded from the bytes checked above; external data resolves against the model's own folder.
    session_options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                             str(path.absolute().parent))
    session_options.add_session_config_entry(QDQ_ACCURACY_LEVEL, "1")      # 1: float32 MatMulNBits
    try:
        session = ort.InferenceSession(data, session_options, providers=["CPUExecutionProvider"])
    except _ort_errors() as e:
        if type(e).__name__ == "NotImplemented":   # a valid model using a kernel the CPU provider lacks
            raise UnsupportedConversionError(path.name, "onnxruntime (CPU)", _first_line(e)) from e
        raise FormatError(path, f"onnxruntime cannot load it ({_first_line(e)})") from e
    return _OrtRunner(session)


def _ort_errors() -> tuple[type[Exception], ...]:
    """onnxruntime's exception types: they share no base class below Exception."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    names = ("Fail", "InvalidArgument", "NoSuchFile", "NoModel", "EngineError", "RuntimeException",
             "InvalidProtobuf", "ModelLoaded", "NotImplemented", "InvalidGraph", "EPFail")
    return tuple(getattr(state, name) for name in names if hasattr(state, name))


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


class _OrtRunner:
    """Runs an onnxruntime session on torch tensors: `runner(x)` -> torch.Tensor (a tuple for several outputs)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.input_names = [i.name for i in session.get_inputs()]

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if len(inputs) != len(self.input_names):
            raise ConfigError(f"the model takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                              f"got {len(inputs)}")
        feeds = {}
        for name, tensor in zip(self.input_names, inputs, strict=True):
            tensor = torch.as_tensor(tensor).detach().cpu().contiguous()
            if tensor.dtype not in (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
                                    torch.int8, torch.uint8, torch.bool):
                raise ConfigError(f"input {name!r} is {tensor.dtype}; feed one of the types numpy holds")
            feeds[name] = tensor.numpy()
        try:
            results = self.session.run(None, feeds)
        except _ort_errors() as e:
            raise ConfigError(f"onnxruntime refused the inputs: {' '.join(str(e).split())}") from e
        outputs = [torch.from_numpy(out) for out in results]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _expected_bytes(tensor: TensorProto) -> int | None:
    """Bytes the tensor's dtype and dims need; None for types torch lacks (strings, 2-bit, ...)."""
    dtype = _DTYPES.get(tensor.data_type)
    if any(d < 0 for d in tensor.dims):
        raise ParseError(f"tensor {tensor.name!r} has negative dims {list(tensor.dims)}")
    if tensor.data_type in _PACKED4:
        return (math.prod(tensor.dims) + 1) // 2
    return None if dtype is None else math.prod(tensor.dims) * dtype.itemsize


def _all_tensors(model: onnx.ModelProto) -> Iterator[TensorProto]:
    """Every TensorProto a runtime would load: graphs, nested subgraphs, functions, training graphs."""
    graphs: list[onnx.GraphProto] = [model.graph]
    graphs += [g for info in model.training_info for g in (info.initialization, info.algorithm)]
    nodes = [node for function in model.functions for node in function.node]
    while graphs or nodes:
        if graphs:
            graph = graphs.pop()
            yield from graph.initializer
            for sparse in graph.sparse_initializer:
                yield from (sparse.values, sparse.indices)
            nodes += graph.node
            continue
        for attribute in nodes.pop().attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            for sparse in (*attribute.sparse_tensors, *([attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else [])):
                yield from (sparse.values, sparse.indices)
            graphs += [attribute.g] if attribute.HasField("g") else []
            graphs += attribute.graphs


# ---------------------------------------------------------------- writing

def write(ckpt: Checkpoint, path: Path, options: WriteOptions = WriteOptions(), *,
          external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> None:
    """Export the checkpoint's module to `path` and check it with onnx.checker (full_check).

    Args:
        ckpt: The weights, metadata and ArchSpec to store.
        path: Where to write (api.save makes it a temporary name beside `options.final_path`).
        options: `module` to export (else rebuilt from the ArchSpec), `example_inputs` (else the
            reference model's own; a causal LM makes its own), `final_path` (names the external
            data file), `kv_cache` (causal LMs: past key/values in, present key/values out).
        external_data_threshold: Weights larger than this (bytes, all tensors together) go to
            `<final name>.data` beside the file as ONNX external data. Tests pass 0 to force it.

    Quantized tensors are stored as QDQ weights (opset 21): the float model holding their
    dequantized values, always rebuilt from the ArchSpec, is exported, then each one's initializer
    is replaced by its integer, scale and zero point initializers feeding a DequantizeLinear node
    whose output keeps the initializer's name (`_to_qdq`).

    Raises:
        UnsupportedConversionError: no module and no ArchSpec ("pass --arch"), quantized tensors
            no DequantizeLinear computes exactly (q4_1, q5_1), `kv_cache` for a module that is
            not a causal LM, or the exporter or onnx.checker refused the model.
    """
    quantized = {name: t for name, t in ckpt.tensors.items() if isinstance(t, QuantizedTensor)}
    for entry in quantized.values():
        qdq.layout_of(entry, transposed=False)      # refuses what has no DequantizeLinear form, before exporting
    final = Path(options.final_path) if options.final_path is not None else path
    narrow = {} if quantized else _narrow_weights(ckpt)
    module = options.module
    if module is None or quantized or narrow:
        module = instantiate(ckpt, source="the checkpoint", target="onnx", dequantize=True)
        # instantiate loads into the model's own dtype (float32): give every tensor the checkpoint's
        # dtype and bits again, so a float16 checkpoint exports as a float16 graph. 16-bit weights
        # in a float32 model (fp16 / bf16 schemes) stay float32 here; _cast_up stores them narrow.
        for name, tensor in module.state_dict(keep_vars=True).items():
            if name in ckpt.tensors and tensor.dtype != ckpt.tensors[name].dtype and name not in narrow:
                tensor.data = ckpt.tensors[name].load().to(tensor.device)
    state = module.state_dict()
    # A tied output head (transformers' lm_head = embed_tokens) is stored once in a Hugging Face folder.
    tied = {alias for alias, target in _tied_names(state).items() if alias not in ckpt.tensors and target in ckpt.tensors}
    state = {name: t for name, t in state.items() if name not in tied}
    if set(state) != set(ckpt.tensors):
        odd = sorted(set(state) ^ set(ckpt.tensors))
        raise ConfigError(f"the module to export and the checkpoint name different tensors (e.g. {odd[0]!r})")
    opset = QDQ_OPSET if quantized else OPSET
    if causal_lm.is_causal_lm(module):
        model = _export_causal_lm(module, options, opset=opset)
    elif options.kv_cache:
        raise UnsupportedConversionError(type(module).__name__, "onnx", "kv_cache applies to Hugging Face causal "
                                         "LMs (a config with vocab_size, forward taking a key/value cache)")
    else:
        model = _export(module, export_shapes.example_inputs(module, options.example_inputs, target="onnx"), opset=opset,
                        names=options.input_names, axes=options.dynamic_axes)
    names = _map_names(model.graph, state)
    if narrow:
        _cast_up(model.graph, narrow, names, ckpt)
    if quantized:
        record = _to_qdq(model.graph, quantized, names, state)
        model.metadata_props[quantized_layout.QUANTIZED_KEY] = json.dumps(record, separators=(",", ":"))
    model.metadata_props.update(ckpt.metadata)
    if ckpt.arch is not None:
        model.metadata_props[ARCH_KEY] = ckpt.arch.to_json()
    model.metadata_props[VERSION_KEY] = __version__
    model.metadata_props[NAMES_KEY] = json.dumps(names, separators=(",", ":"))
    _save(model, path, final, external_data_threshold)


def _export(module: Any, inputs: tuple[Any, ...], *, opset: int = OPSET, names: tuple[str, ...] | None = None,
            axes: dict[str, tuple[int, ...]] | None = None) -> Any:
    """torch.onnx.export (torch.export-based, optimized) -> onnx_ir Model, with named dynamic axes.

    `names` name the graph's inputs; `axes` ({name: axes}) are the free axes when given, named
    "<input>_<axis>" in the file (an axis the exporter finds equal to an earlier one takes that one's
    name); else axis 0 of every input ("batch") and the axes a reference model declares are.
    """
    arch = getattr(type(module), "arch", None)
    dynamic = export_shapes.dynamic_shapes(module, inputs, names=names, axes=axes)
    model = _run_exporter(module, inputs, dynamic, opset=opset,
                          input_names=[n for n, x in zip(names, inputs, strict=True) if isinstance(x, torch.Tensor)]
                          if names else None)
    wanted = [given or {} for x, given in zip(inputs, dynamic, strict=True) if isinstance(x, torch.Tensor)]
    _check_dynamic(model, wanted, strict=arch in MODELS or axes is not None, label=type(module).__name__)
    if axes is not None:
        _name_axes(model)
    _name_outputs(model, "logits" if arch in MODELS else "output")   # every reference model returns logits
    return model


def _export_causal_lm(module: Any, options: WriteOptions, *, opset: int) -> Any:
    """A Hugging Face causal LM through `causal_lm.CausalLMGraph`: input_ids, attention_mask and
    position_ids in, logits out (and past_key_values.N.* in, present.N.* out with `kv_cache`),
    batch and sequence free (docs/formats/onnx.md, "Hugging Face causal LMs"). The signature is
    fixed: the caller's input names and dynamic axes may only repeat it."""
    kv_cache = options.kv_cache
    graph = causal_lm.graph(module, kv_cache=kv_cache)
    names = causal_lm.input_names(graph.layers, kv_cache=kv_cache)
    axes = causal_lm.dynamic_axes(graph.layers, kv_cache=kv_cache)
    _check_causal_lm_options(options, names, axes)
    model = _run_exporter(graph, causal_lm.export_inputs(module, kv_cache=kv_cache),
                          export_shapes.causal_lm_shapes(graph.layers, kv_cache=kv_cache), opset=opset, input_names=names, output_names=causal_lm.output_names(graph.layers, kv_cache=kv_cache))
    _check_dynamic(model, axes, strict=True, label=type(module).__name__)
    return model


def _check_causal_lm_options(options: WriteOptions, names: list[str], axes: list[dict[int, Any]]) -> None:
    given = options.input_names or ()
    if tuple(given) != tuple(names[:len(given)]):
        raise ConfigError(f"a causal LM's graph takes {', '.join(names[:3])} (in that order); "
                          f"drop the input names {', '.join(given)}")
    free = dict(zip(names, ({*entry} for entry in axes), strict=True))
    for name, wanted in (options.dynamic_axes or {}).items():
        if name not in free or set(wanted) != free[name]:
            raise ConfigError(f"a causal LM's graph leaves axes {sorted(free.get(name, ()))} of {name!r} free, "
                              f"not {sorted(wanted)}: drop the dynamic axes")


@functools.cache
def _reuse_torchlib_table() -> None:
    """Build onnxscript's table of torchlib functions once per process, not once per export: torch 2.13's
    exporter asks `onnxscript_apis.get_torchlib_ops()` for it on every call, and making it (the IR of ~500
    functions) is a quarter of a small model's export (measured: tinylm 1.7-2.1 -> 1.3-1.45 s of CPU from the
    second export on). The table is read, never changed, by the exporter. Skipped where the layout differs."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        return
    apis = getattr(_registration, "onnxscript_apis", None)
    make = getattr(apis, "get_torchlib_ops", None)
    if make is not None and not hasattr(make, "cache_info"):
        apis.get_torchlib_ops = functools.cache(make)


def _run_exporter(module: Any, inputs: tuple[Any, ...], dynamic: tuple[Any, ...], *, opset: int,
                  input_names: list[str] | None = None, output_names: list[str] | None = None) -> Any:
    """torch.onnx.export in eval mode (the caller's modes restored after), quiet; the exporter's
    failure as UnsupportedConversionError; no stack-trace metadata on the nodes."""
    import torch.onnx

    _reuse_torchlib_table()
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with _quiet():
            program = torch.onnx.export(module, inputs, dynamo=True, opset_version=opset, dynamic_shapes=dynamic,
                                        input_names=input_names, output_names=output_names, optimize=True,
                                        verbose=False)
    except torch.onnx.OnnxExporterError as e:
        raise UnsupportedConversionError(type(module).__name__, "onnx",
                                         f"torch.onnx.export failed: {_first_line(e.__cause__ or e)}") from e
    finally:
        for submodule, training in modes:   # as the caller had them, submodule by submodule
            submodule.training = training
    model = program.model
    for node in model.graph.all_nodes():  # tracebacks with this machine's file paths: not for shipping
        node.metadata_props.pop("pkg.torch.onnx.stack_trace", None)
    return model


def _name_axes(model: Any) -> None:
    """Give the exporter's symbolic axes (s0, s23, ...) the name of the first input axis holding them
    ("ids_1"), everywhere in the graph, so the file says which axis is which."""
    import onnx_ir as ir

    rename: dict[str, str] = {}
    for value in model.graph.inputs:
        for axis, dim in enumerate(value.shape or ()):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None and dim.value not in rename:
                rename[dim.value] = f"{value.name}_{axis}"
    values = [*model.graph.inputs, *model.graph.outputs, *(out for node in model.graph.all_nodes() for out in node.outputs)]
    for value in values:
        if value.shape is not None and any(isinstance(d, ir.SymbolicDim) and d.value in rename for d in value.shape):
            value.shape = ir.Shape([ir.SymbolicDim(rename[d.value]) if isinstance(d, ir.SymbolicDim) and d.value in rename
                                    else d for d in value.shape])


def _check_dynamic(model: Any, wanted: list[dict[int, Any]], *, strict: bool, label: str) -> None:
    """The exporter quietly fixes an axis the model's code pins to one size; say so (and refuse it
    for a reference model, or axes the caller named).

    `wanted` holds the dynamic axes asked for each tensor input, in the order of the graph's inputs.
    """
    import onnx_ir as ir

    fixed = [f"{value.name}[{axis}]" for value, axes in zip(model.graph.inputs, wanted, strict=False)
             for axis in axes if not isinstance(value.shape[axis], ir.SymbolicDim)]
    if not fixed:
        return
    message = f"the exporter fixed axes {', '.join(fixed)} to their example sizes"
    if strict:
        raise UnsupportedConversionError(label, "onnx", message)
    logger.warning("%s; the ONNX model accepts only those sizes", message)


def _name_outputs(model: Any, base: str) -> None:
    outputs = model.graph.outputs
    wanted = [base] if len(outputs) == 1 else [f"{base}_{i}" for i in range(len(outputs))]
    taken = _value_names(model.graph)
    for value, name in zip(outputs, wanted, strict=True):
        if value.producer() is not None and name not in taken:
            value.name = name


def _value_names(graph: Any) -> set[str]:
    names = {v.name for v in graph.inputs} | set(graph.initializers)
    return names | {out.name for node in graph.all_nodes() for out in node.outputs}


def _map_names(graph: Any, state: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """state_dict name -> the initializer holding its exact bytes (transposed or shared, as the
    optimizer left it). A tensor the exporter folded into something else, or made a Constant, is
    added as an unused initializer under its own name: onnxruntime ignores it, read() finds it."""
    initializers = graph.initializers
    exact = {name for name, t in state.items()
             if name in initializers and initializers[name].const_value is not None
             and _same(initializers[name].const_value, t)}
    index = _digest_index(initializers) if len(exact) < len(state) else {}
    taken = _value_names(graph)
    names: dict[str, dict[str, Any]] = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        if name in exact:
            names[name] = {"initializer": name}
            continue
        found = index.get((tensor.dtype, tuple(tensor.shape), _digest(tensor_bytes(tensor))))
        if found is not None and _same_after(initializers[found[0]].const_value, found[1], tensor):
            names[name] = {"initializer": found[0], **({"transpose": found[1]} if found[1] else {})}
            continue
        new = _free_name(name, taken)
        graph.register_initializer(_ir_value(new, tensor))
        taken.add(new)
        names[name] = {"initializer": new}
        logger.debug("%s: not among the exported initializers; stored as unused initializer %r", name, new)
    return names


def _to_qdq(graph: Any, quantized: dict[str, QuantizedTensor], names: dict[str, dict[str, Any]],
            state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Each quantized weight's float initializer becomes integer, scale (and zero point) initializers
    feeding DequantizeLinear, whose output takes the initializer's name, so its consumers are unchanged.

    Returns the "modelkit.quantized" record; `names` marks those weights `{"quantized": true}`. A weight
    whose initializer is unused (the exporter folded it) or already replaced (two weights with the
    same values) keeps only its initializers; a float tensor that shared a replaced initializer gets
    its own unused copy, so reading back stays exact.
    """
    taken = _value_names(graph)
    replaced: set[str] = set()
    record: dict[str, Any] = {}
    for name, entry in quantized.items():
        where = names[name]
        layout = qdq.layout_of(entry, transposed="transpose" in where)
        inputs = qdq.encode(entry, layout)
        _check_exact(name, entry, layout, inputs)
        values = {}
        for role, tensor in inputs.items():
            stored = _free_name(name + _QDQ_SUFFIXES[role], taken)
            taken.add(stored)
            values[role] = _qdq_value(stored, tensor, layout.bits if role != "scale" else 32)
            graph.register_initializer(values[role])
        if where["initializer"] not in replaced:
            old = graph.initializers.pop(where["initializer"])
            if old.uses():
                output = _dequantize(graph, name, entry, layout, values)
                old.replace_all_uses_with(output)
                output.name = old.name
            replaced.add(old.name)
        record[name] = {**quantized_layout.describe(name, entry, target="onnx"), "encoding": layout.encoding,
                        "parts": {role: value.name for role, value in values.items()},
                        **({"transpose": [1, 0]} if layout.transposed else {}),
                        **({"scale_dtype": str(entry.parts["scale"].dtype).removeprefix("torch.")}
                           if "scale" in entry.parts else {})}
        names[name] = {"quantized": True}
    for name, where in names.items():
        if where.get("initializer") in replaced:       # a float tensor with the same bytes: its own copy
            copy = _free_name(name, taken)
            graph.register_initializer(_ir_value(copy, state[name].detach().cpu()))
            taken.add(copy)
            names[name] = {"initializer": copy}
    return record


def _narrow_weights(ckpt: Checkpoint) -> dict[str, torch.dtype]:
    """16-bit float tensors of a checkpoint that also holds float32 ones (the fp16 / bf16 schemes:
    weights narrow, biases and norms float32): exported as float32, then stored narrow."""
    floats = {name: t.dtype.torch for name, t in ckpt.tensors.items() if t.dtype.is_floating_point}
    if torch.float32 not in floats.values():
        return {}
    return {name: dtype for name, dtype in floats.items() if dtype in (torch.float16, torch.bfloat16)}


def _cast_up(graph: Any, narrow: dict[str, torch.dtype], names: dict[str, dict[str, Any]], ckpt: Checkpoint) -> None:
    """Each 16-bit weight's float32 initializer becomes the 16-bit initializer feeding a Cast to
    float32 that takes the old name, so the graph computes what the torch model computes (the
    weight cast up, exactly) and the file holds the 16-bit values; `names` points at them."""
    import onnx_ir as ir
    from onnx_ir.convenience import convert_attributes

    taken = _value_names(graph)
    for name in narrow:
        where = names[name]
        perm = where.get("transpose")
        tensor = ckpt.tensors[name].load().detach().cpu()
        if perm:                                         # stored = tensor laid out as the initializer is
            tensor = tensor.permute([perm.index(i) for i in range(len(perm))])
        stored = _free_name(f"{name}_{str(tensor.dtype).removeprefix('torch.')}", taken)
        taken.add(stored)
        value = _ir_value(stored, tensor.contiguous())
        graph.register_initializer(value)
        old = graph.initializers.get(where["initializer"])
        if old is not None and old.uses() and old.const_value is not None and old.const_value.dtype == ir.DataType.FLOAT:
            graph.initializers.pop(old.name)
            cast = ir.Node("", "Cast", [value], convert_attributes({"to": ir.DataType.FLOAT}), name=f"{name}/Cast")
            output = cast.outputs[0]
            output.type, output.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(tensor.shape)
            if graph.num_nodes():
                graph.insert_before(graph.node(0), [cast])
            else:
                graph.append(cast)
            old.replace_all_uses_with(output)
            output.name = old.name
        names[name] = {"initializer": stored, **({"transpose": perm} if perm else {})}


def _check_exact(name: str, entry: QuantizedTensor, layout: qdq.QDQLayout, inputs: dict[str, torch.Tensor]) -> None:
    """The parts rebuilt from the DequantizeLinear inputs must be the parts, bit for bit."""
    scale_dtype = entry.parts["scale"].dtype.torch if "scale" in entry.parts else torch.float16
    specs = qdq.part_specs(layout, scale_dtype)
    for part in sorted(set(specs) | set(entry.parts)):
        same = part in specs and part in entry.parts
        if same:
            want, got = entry.parts[part].load(), qdq.decode_part(part, layout, scale_dtype, inputs.__getitem__)
            same = got.dtype == want.dtype and got.shape == want.shape and torch.equal(_bytes_of(got), _bytes_of(want))
        if not same:
            raise UnsupportedConversionError(f"quantized tensor {name!r} ({entry.scheme})", "onnx",
                                             f"its {part!r} part does not come back bit for bit from DequantizeLinear's "
                                             "inputs; write safetensors or pth instead")


def _qdq_value(name: str, tensor: torch.Tensor, bits: int) -> Any:
    """An initializer for a DequantizeLinear input; 4-bit values packed two per byte (INT4 / UINT4)."""
    import onnx_ir as ir

    if bits != 4:
        return _ir_value(name, tensor.contiguous())
    dtype = ir.DataType.INT4 if tensor.dtype == torch.int8 else ir.DataType.UINT4
    packed = ir.PackedTensor(qdq.pack4(tensor).numpy(), dtype, shape=ir.Shape(tensor.shape), name=name)
    return ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(dtype), const_value=packed)


def _dequantize(graph: Any, name: str, entry: QuantizedTensor, layout: qdq.QDQLayout, values: dict[str, Any]) -> Any:
    """DequantizeLinear (then Reshape for a blocked N-D weight, Cast for a float16 one) at the top of the graph."""
    import onnx_ir as ir
    from onnx_ir.convenience import convert_attributes

    attributes = {"axis": layout.axis, **({"block_size": layout.block_size} if layout.block_size else {})}
    inputs = [values["data"], values["scale"], *([values["zero_point"]] if "zero_point" in values else [])]
    nodes = [ir.Node("", "DequantizeLinear", inputs, convert_attributes(attributes), name=f"{name}/DequantizeLinear")]
    if layout.data_shape != layout.output_shape:            # dequantized as the (rows, cols) matrix
        target = _ir_value(f"{name}/shape", torch.tensor(layout.output_shape, dtype=torch.int64))
        graph.register_initializer(target)
        nodes.append(ir.Node("", "Reshape", [nodes[-1].outputs[0], target], name=f"{name}/Reshape"))
    if entry.dtype.torch != torch.float32:                  # computed in float32, as modelkit dequantizes
        to = convert_attributes({"to": ir.DataType(_ONNX_TYPES[entry.dtype.torch])})
        nodes.append(ir.Node("", "Cast", [nodes[-1].outputs[0]], to, name=f"{name}/Cast"))
    output = nodes[-1].outputs[0]
    output.type = ir.TensorType(ir.DataType(_ONNX_TYPES[entry.dtype.torch]))
    output.shape = ir.Shape(layout.output_shape)
    if graph.num_nodes():
        graph.insert_before(graph.node(0), nodes)
    else:
        graph.extend(nodes)
    return output


def _digest(data: Any) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _digest_index(initializers: Any) -> dict[tuple[Any, ...], tuple[str, list[int] | None]]:
    """(dtype, shape, digest) -> (initializer, transpose): each initializer as it is, and 2-D ones transposed."""
    index: dict[tuple[Any, ...], tuple[str, list[int] | None]] = {}
    for name, value in initializers.items():
        tensor = value.const_value
        dtype = _DTYPES.get(int(tensor.dtype)) if tensor is not None else None
        if dtype is None:
            continue
        array = tensor.numpy()
        index.setdefault((dtype, tuple(array.shape), _digest(array.tobytes())), (name, None))
        if array.ndim == 2:
            index.setdefault((dtype, tuple(array.shape[::-1]), _digest(array.T.tobytes())), (name, [1, 0]))
    return index


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same(stored: Any, tensor: torch.Tensor) -> bool:
    if int(stored.dtype) != _ONNX_TYPES.get(tensor.dtype) or tuple(stored.shape) != tuple(tensor.shape):
        return False
    raw = getattr(stored, "raw", None)  # the exporter's TorchTensor wraps the parameter itself
    if isinstance(raw, torch.Tensor) and raw.dtype == tensor.dtype:
        return torch.equal(_bytes_of(raw), _bytes_of(tensor))
    return stored.tobytes() == bytes(tensor_bytes(tensor))


def _same_after(stored: Any, perm: list[int] | None, tensor: torch.Tensor) -> bool:
    array = stored.numpy()
    array = array.transpose(perm) if perm else array
    return tuple(array.shape) == tuple(tensor.shape) and array.tobytes() == bytes(tensor_bytes(tensor))


def _free_name(name: str, taken: set[str]) -> str:
    candidate, n = name, 0
    while candidate in taken:
        n += 1
        candidate = f"modelkit::{name}" + (f".{n}" if n > 1 else "")
    return candidate


def _ir_value(name: str, tensor: torch.Tensor) -> Any:
    import onnx_ir as ir

    onnx_type = _ONNX_TYPES.get(tensor.dtype)
    if onnx_type is None:
        raise UnsupportedConversionError(str(tensor.dtype), "onnx", f"tensor {name!r} has a dtype ONNX lacks")
    dtype = ir.DataType(onnx_type)
    t = tensor.detach().cpu().contiguous()
    if t.dtype.is_floating_point and t.dtype not in (torch.float16, torch.float32, torch.float64):
        array = t.view(torch.uint16 if t.dtype.itemsize == 2 else torch.uint8).numpy().view(dtype.numpy())
    else:
        array = t.numpy()
    return ir.Value(name=name, shape=ir.Shape(t.shape), type=ir.TensorType(dtype),
                    const_value=ir.Tensor(array, dtype=dtype, name=name))


def _save(model: Any, path: Path, final: Path, threshold: int) -> None:
    """Serialize, with external data `<final name>.data` beside `path` when the weights exceed
    `threshold` bytes.

    The writer is handed `path` inside a temporary folder, under the output's own name
    (atomic_path with FORMATS["onnx"].companions), so the data file already has the name the
    model refers to; the rename into place moves both, and an error leaves neither.
    """
    import onnx_ir as ir

    total = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if total <= threshold:
        ir.save(model, path, format="protobuf")
        _check(path)
        return
    if path.name != final.name:
        raise ConfigError(f"a model over {threshold} bytes keeps its weights in {final.name}.data; write it "
                          "with modelkit.save or modelkit.convert, which stage both files together")
    data_path = final.with_name(f"{final.name}.data")
    if data_path.exists() and not final.exists():
        raise ConfigError(f"{data_path} exists but {final} does not (another model's data or a leftover); "
                          "remove it or choose another output name")
    ir.save(model, path, format="protobuf", external_data=f"{final.name}.data", size_threshold_bytes=_INLINE_LIMIT,
            alignment=_ALIGNMENT)
    _check(path)
    logger.debug("wrote %d bytes of weights to external data %s", total, data_path)


def _check(path: Path) -> None:
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise UnsupportedConversionError("the exported graph", "onnx", f"onnx.checker rejects it ({_first_line(e)})") from e


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the exporter: its loggers, its warnings, and the graphs it prints when a capture fails.

    Redirecting stdout/stderr is process-wide, so it lasts only for the export call; what was
    captured goes to this module's debug log instead of being lost.
    """
    loggers = [logging.getLogger(name) for name in ("torch", *logging.root.manager.loggerDict)
               if name == "torch" or name.startswith(("torch.", "onnxscript", "onnx_ir"))]
    levels = [(lg, lg.level) for lg in loggers]
    captured = io.StringIO()
    try:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL + 1)
        with warnings.catch_warnings(), contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in levels:
            lg.setLevel(level)
        if captured.getvalue().strip():
            logger.debug("torch.onnx.export printed:\n%s", captured.getvalue())
