"""Builders of hostile and malformed model files, for tests of the scanner and the parsers.

Every payload here is harmless (`true`, `id`) and is only *dumped* or assembled from bytes: nothing in
this module loads one, and a test that loads what it builds is a bug (STYLE.md: assert on scan() only).
They live here, not in the repository's fixtures, so no hostile file is ever committed and every test
builds the same ones. Standard library only.
"""
from __future__ import annotations

import base64
import io
import json
import marshal
import os
import pickle
import struct
import zipfile


class Reduce:
    """Pickles as `func(*args)`: dumping never calls func, loading would."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def system_pickle(command: str = "true", *, protocol: int = 2) -> bytes:
    """A pickle that would run `os.system(command)` when loaded."""
    return pickle.dumps(Reduce(os.system, command), protocol=protocol)


def zip_bytes(members: dict[str, bytes], **kwargs) -> bytes:
    """A zip archive of `members` (name -> content) in memory; kwargs go to zipfile.ZipFile."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", **kwargs) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return out.getvalue()


def torch_zip(data_pkl: bytes, *, root: str = "archive", extra: dict[str, bytes] | None = None) -> bytes:
    """A torch.save-shaped zip: `<root>/data.pkl`, `<root>/version`, plus `extra` members."""
    return zip_bytes({f"{root}/data.pkl": data_pkl, f"{root}/version": b"3\n", **(extra or {})})


def torchscript_zip(code: str, *, root: str = "model", data_pkl: bytes | None = None) -> bytes:
    """A TorchScript-shaped zip (data.pkl, constants.pkl, code/__torch__.py) carrying `code`."""
    return zip_bytes({f"{root}/data.pkl": data_pkl if data_pkl is not None else pickle.dumps({}, protocol=2),
                      f"{root}/constants.pkl": pickle.dumps((), protocol=2),
                      f"{root}/code/__torch__.py": code.encode(), f"{root}/version": b"3\n"})


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    """A safetensors file: the header as JSON after its 8-byte length, then `data`."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def gguf_bytes(*, version: int = 3, kv: bytes = b"", tensors: bytes = b"", n_kv: int = 0, n_tensors: int = 0,
               tail: bytes = b"") -> bytes:
    """A GGUF header with the given (possibly lying) counts, raw key/value and tensor-info bytes, then `tail`."""
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kv + tensors + tail


def gguf_string(text: str) -> bytes:
    """A GGUF string: u64 length, then UTF-8 bytes."""
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_tensor_info(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    """One GGUF tensor info: name, n_dims, dims, ggml type, data offset."""
    return gguf_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


def varint(value: int) -> bytes:
    """A protobuf varint."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def proto_field(number: int, payload: bytes | int) -> bytes:
    """A protobuf field: a varint for an int, length-delimited for bytes."""
    if isinstance(payload, int):
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def onnx_external_model(location: str, *, name: str = "w", length: int = 4) -> bytes:
    """A minimal ModelProto (ir_version, graph with one FLOAT initializer) whose data is external at `location`."""
    entries = (proto_field(13, proto_field(1, b"location") + proto_field(2, location.encode()))
               + proto_field(13, proto_field(1, b"length") + proto_field(2, str(length).encode())))
    tensor = proto_field(1, 1) + proto_field(2, 1) + proto_field(8, name.encode()) + entries + proto_field(14, 1)
    return proto_field(1, 8) + proto_field(7, proto_field(5, tensor)) + proto_field(8, proto_field(2, 17))


def keras_lambda_config() -> bytes:
    """A .keras config.json with a Lambda layer (its bytecode would run on load)."""
    layer = {"class_name": "Lambda", "config": {"name": "l", "function": "4wEAAAAAAAAA"}}
    return json.dumps({"class_name": "Sequential", "config": {"layers": [layer]}}).encode()


def keras_zip(config: bytes) -> bytes:
    """A .keras archive: config.json, metadata.json, model.weights.h5 (empty)."""
    return zip_bytes({"config.json": config, "metadata.json": b"{}", "model.weights.h5": b""})


def keras_marshal_lambda(name: str = "lambda") -> dict:
    """A Keras 2 Lambda layer config whose function is marshalled bytecode (base64, as func_dump writes it).

    The code object is a harmless `lambda x: x`, marshalled (never run); Keras would unmarshal and call it.
    """
    code = base64.encodebytes(marshal.dumps((lambda x: x).__code__)).decode("ascii")
    return {"class_name": "Lambda", "config": {"name": name, "trainable": True, "dtype": "float32",
                                               "function": [code, None, None], "function_type": "lambda",
                                               "output_shape": None, "output_shape_type": "raw",
                                               "arguments": {}}}


def keras_sequential(layers: list[dict], *, input_shape: tuple[int, ...] = (3,)) -> dict:
    """A Keras Sequential config (`model.to_json()`'s shape) of the given layer configs."""
    first = [dict(layers[0], config=dict(layers[0]["config"], batch_input_shape=[None, *input_shape]))] if layers else []
    return {"class_name": "Sequential", "config": {"name": "sequential", "layers": first + layers[1:]},
            "keras_version": "2.15.0", "backend": "tensorflow"}


def tfjs_model_json(topology, manifest: list[dict] | None = None, *, fmt: str = "layers-model",
                    **extra) -> bytes:
    """A TensorFlow.js model.json: format, modelTopology, weightsManifest (empty unless given)."""
    doc = {"format": fmt, "generatedBy": "keras v2.15.0", "convertedBy": "TensorFlow.js Converter v4.22.0",
           "modelTopology": topology, "weightsManifest": manifest if manifest is not None else [], **extra}
    return json.dumps(doc).encode()


def tfjs_group(paths: list[str], weights: list[tuple[str, list[int], str]]) -> dict:
    """A weightsManifest group: shard paths and (name, shape, dtype) weights."""
    return {"paths": paths, "weights": [{"name": n, "shape": s, "dtype": d} for n, s, d in weights]}


def tfjs_lambda(*, wrapped: bool = False) -> bytes:
    """A TF.js Layers model.json whose Keras config holds a Lambda with marshalled bytecode; `wrapped`
    puts the config under `model_config`, as tensorflowjs_converter writes Keras .h5 models."""
    config = keras_sequential([keras_marshal_lambda()])
    return tfjs_model_json({"model_config": config, "training_config": {}} if wrapped else config)


def tfjs_shard_path(path: str) -> bytes:
    """A TF.js Layers model.json (a Dense layer, one group holding its bias) whose manifest names shard `path`."""
    topology = keras_sequential([{"class_name": "Dense", "config": {"name": "dense", "units": 2}}])
    return tfjs_model_json(topology, [tfjs_group([path], [("dense/bias", [2], "float32")])])


def tfjs_graph(op: str) -> bytes:
    """A TF.js graph model.json with a Placeholder feeding one node running `op`."""
    nodes = [{"name": "x", "op": "Placeholder", "attr": {"dtype": {"type": "DT_FLOAT"}}},
             {"name": "f", "op": op, "input": ["x"], "attr": {"token": {"s": "cHlfZnVuY18w"}}}]
    return tfjs_model_json({"node": nodes, "versions": {"producer": 1482}}, fmt="graph-model")


def hostile_corpus() -> dict[str, bytes]:
    """One of each kind of hostile or malformed file the parsers and the scanner must survive (name -> bytes).

    The names carry the suffix a loader would pick the file by.
    """
    evil = system_pickle()
    return {
        "reduce.pkl": evil,
        "reduce-protocol0.pkl": system_pickle(protocol=0),
        "truncated.pkl": evil[: len(evil) // 2],
        "memo-bypass.pkl": b"\x80\x02c__builtin__\ngetattr\nq\x00h\x05.",
        "deep-marks.pkl": b"\x80\x02" + b"(" * 20_000 + b".",
        "huge-length.pkl": b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b"x",
        "torch.pt": torch_zip(evil),
        "traversal.pt": zip_bytes({"archive/data.pkl": pickle.dumps({}, protocol=2), "../../etc/x": b"x"}),
        "torchscript.pt": torchscript_zip("import os\nos.system('true')\n"),
        "polyglot.pt": evil + torch_zip(pickle.dumps({}, protocol=2)),
        "lying.safetensors": safetensors_bytes({"w": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}),
        "huge-header.safetensors": struct.pack("<Q", 2**63) + b"{}",
        "duplicate.safetensors": b'\x1c\x00\x00\x00\x00\x00\x00\x00{"a":{"x":1},"a":{"x":2}}   ',
        "counts.gguf": gguf_bytes(n_kv=2**62, n_tensors=2**62, tail=bytes(64)),
        "string.gguf": gguf_bytes(n_kv=1, kv=gguf_string("k") + struct.pack("<IQ", 8, 2**60) + b"abc"),
        "array.gguf": gguf_bytes(n_kv=1, kv=gguf_string("k") + struct.pack("<IIQ", 9, 8, 2**40) + b"abc"),
        "tensor.gguf": gguf_bytes(n_tensors=1, tensors=gguf_tensor_info("w", [2**62]), tail=bytes(64)),
        "template.gguf": gguf_bytes(n_kv=1, kv=gguf_string("tokenizer.chat_template") + struct.pack("<I", 8)
                                    + gguf_string("{{ cycler.__init__.__globals__.os.popen('id') }}")),
        "escape.onnx": onnx_external_model("../../etc/passwd"),
        "absolute.onnx": onnx_external_model("/etc/passwd"),
        "lambda.keras": keras_zip(keras_lambda_config()),
        "lambda-tfjs.json": tfjs_lambda(),
        "lambda-wrapped-tfjs.json": tfjs_lambda(wrapped=True),
        "escape-tfjs.json": tfjs_shard_path("../../../../etc/shadow"),
        "absolute-tfjs.json": tfjs_shard_path("/etc/shadow"),
        "pyfunc-tfjs.json": tfjs_graph("PyFunc"),
        "bad-varint.onnx": b"\x08" + b"\xff" * 12,
        "bomb.zip": zip_bytes({"b.bin": b"\0" * (80 << 20)}, compression=zipfile.ZIP_DEFLATED),
        "npy-header.npy": b"\x93NUMPY\x01\x00" + struct.pack("<H", 0xFFFF) + b"{",
    }
