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


def pt2_zip(*, nodes: list[str] | None = None, weights: dict | None = None, constants: dict | None = None,
            pickled: frozenset[str] = frozenset(), extra: dict[str, bytes] | None = None, root: str = "archive",
            branch: list[str] | None = None) -> bytes:
    """A PT2-shaped zip (what torch.export.save writes): archive_format, a program whose graph calls `nodes`
    (targets), payload configs `weights`/`constants` ({fqn: path_name}; `use_pickle` for the fqns in `pickled`
    and for names other than weight_N/tensor_N) with a float32 [2] tensor in each raw member, plus `extra`
    members (name under root). `branch`: targets of a nested graph, passed to a torch.cond node as torch.export
    serializes control flow."""
    meta = {"dtype": 7, "sizes": [{"as_int": 2}], "strides": [{"as_int": 1}], "storage_offset": {"as_int": 0},
            "requires_grad": False, "device": {"type": "cpu", "index": None}, "layout": 7}
    members = {f"{root}/archive_format": b"pt2", f"{root}/archive_version": b"0", f"{root}/byteorder": b"little"}
    graph = {"inputs": [], "outputs": [], "tensor_values": {}, "custom_obj_values": {},
             "nodes": [{"target": t, "inputs": [], "outputs": [], "metadata": {}, "name": f"n{i}"}
                       for i, t in enumerate(nodes or ["torch.ops.aten.relu.default"])]}
    if branch:
        nested = {"graph": {"nodes": [{"target": t, "inputs": [], "outputs": [], "metadata": {}} for t in branch]}}
        graph["nodes"].append({"target": "torch.ops.higher_order.cond", "outputs": [], "metadata": {},
                               "inputs": [{"name": "true_fn", "arg": {"as_graph": nested}, "kind": 1}]})
    program = {"graph_module": {"graph": graph, "signature": {"input_specs": [], "output_specs": []},
                                "module_call_graph": []}, "range_constraints": {}, "schema_version": {"major": 8, "minor": 20}}
    members[f"{root}/models/model.json"] = json.dumps(program).encode()
    for folder, entries in (("weights", weights or {"w": "weight_0"}), ("constants", constants or {})):
        config = {}
        for fqn, path_name in entries.items():
            raw = path_name.startswith(("weight_", "tensor_")) and fqn not in pickled
            config[fqn] = {"path_name": path_name, "is_param": folder == "weights", "use_pickle": not raw,
                           "tensor_meta": meta if raw else None}
            if raw and "/" not in path_name:
                members[f"{root}/data/{folder}/{path_name}"] = struct.pack("<2f", 1.0, 2.0)
        members[f"{root}/data/{folder}/model_{folder}_config.json"] = json.dumps({"config": config}).encode()
    members.update({f"{root}/{name}": data for name, data in (extra or {}).items()})
    return zip_bytes(members)


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
        "aoti.pt2": pt2_zip(extra={"data/aotinductor/model/model.so": b"\x7fELF\x02\x01\x01" + bytes(57)}),
        "shared-library.pt2": pt2_zip(extra={"extra/libhelper.so": b"\x7fELF\x02\x01\x01" + bytes(57)}),
        "pickled-constant.pt2": pt2_zip(constants={"c": "tensor_0"}, pickled=frozenset({"c"}),
                                        extra={"data/constants/tensor_0": evil}),
        "opaque-object.pt2": pt2_zip(constants={"c": "opaque_obj_0"}, extra={"data/constants/opaque_obj_0": evil}),
        "sample-inputs.pt2": pt2_zip(extra={"data/sample_inputs/model.pt": torch_zip(evil)}),
        "escape.pt2": pt2_zip(extra={"../../escaped.py": b"print(1)\n"}),
        "config-escape.pt2": pt2_zip(weights={"w": "../../../etc/passwd"}),
        "target.pt2": pt2_zip(nodes=["torch.ops.aten.relu.default", "torch.os.system"]),
        "load-target.pt2": pt2_zip(nodes=["torch.load"]),
        "nested-target.pt2": pt2_zip(branch=["torch.ops.aten.sin.default", "torch.os.system"]),
        "torch-and-pt2.pt": pt2_zip(nodes=["torch.os.system"], extra={"data.pkl": pickle.dumps({}, protocol=2)}),
        "file-op.pt2": pt2_zip(nodes=["torch.ops.aten.from_file.default"]),
        "raise-class.ts": torchscript_zip('def f(x):\n  ops.prim.RaiseException("true", "os.system")\n'),
        "model.7z.pt": b"7z\xbc\xaf\x27\x1c\x00\x04" + bytes(56),
        "rar-member.pt": torch_zip(pickle.dumps({}, protocol=2), extra={"archive/extra.bin": b"Rar!\x1a\x07\x01\x00" + bytes(8)}),
    }
