"""Fuzzing of everything that reads untrusted bytes: parsers, the scanner, the converters' readers.

One module, three levels, the same mutations (truncations, bit flips, huge declared lengths and counts,
inserted and deleted bytes, random bytes behind a format's magic):
- every modelkit.parse function raises only ParseError (booleans answer, never raise);
- the scanner never raises and never hangs; a file it cannot read is an error in its report;
- every format's `detect` never raises and `read` raises only ModelkitError, one line, naming the file.
Plus the held corpus of hostile files (modelkit.testing.payloads), built here and only ever scanned
or parsed, never loaded by anything that would run them.
"""
from __future__ import annotations

import io
import json
import pickle
import shutil
import struct
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import modelkit
from modelkit.checkpoint import Checkpoint
from modelkit.errors import FormatError, ModelkitError, ParseError
from modelkit.formats import FORMATS, WRITABLE, load_format
from modelkit.models import build
from modelkit.parse import compressed_tensors as ct_parse
from modelkit.parse import (
    ggml,
    gguf,
    hdf5,
    keras,
    npy,
    npz,
    onnx,
    paths,
    pt2,
    safetensors,
    savedmodel,
    sniff,
    tf_bundle,
    tfjs,
    torch_format,
    zipdir,
)
from modelkit.parse import imatrix as imatrix_parse
from modelkit.parse import openvino as openvino_ir
from modelkit.parse import pickle as pickle_parse
from modelkit.parse.protobuf import fields, int64s, text
from modelkit.scan import Limits, Severity, scan
from modelkit.testing import payloads
from modelkit.testing.legacy_ggml import tiny_llama_bytes

_SETTINGS = settings(max_examples=60, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
_HUGE = [2**64 - 1, 2**63, 2**60, 2**40, 10**12, 2**32 - 1, 2**31, 77, 9, 0]


@st.composite
def mutated(draw, seeds: list[bytes]) -> bytes:
    """A seed after a few mutations: truncation, bit flips, huge u32/u64 values, inserted/deleted bytes."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["truncate", "flip", "u64", "u32", "insert", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "truncate":
            del data[at:]
        elif kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind in ("u64", "u32") and len(data) >= 8:
            packed = struct.pack("<Q" if kind == "u64" else "<I", draw(st.sampled_from(_HUGE)) % (2**64 if kind == "u64" else 2**32))
            at = min(at, len(data) - len(packed))
            data[at:at + len(packed)] = packed
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete" and data:
            del data[at:at + draw(st.integers(1, 8))]
    return bytes(data)


# ---------------------------------------------------------------------------------------------
# Seeds: small valid inputs for each parser, built from the payload builders.

def _gguf_seed() -> bytes:
    kv = (payloads.gguf_string("general.architecture") + struct.pack("<I", 8) + payloads.gguf_string("llama")
          + payloads.gguf_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2)
          + payloads.gguf_string("a") + payloads.gguf_string("b")
          + payloads.gguf_string("general.alignment") + struct.pack("<II", 4, 32))
    tensors = payloads.gguf_tensor_info("w", [4], 0, 0) + payloads.gguf_tensor_info("q", [32], 2, 32)
    head = payloads.gguf_bytes(n_kv=3, n_tensors=2, kv=kv, tensors=tensors)
    return head + bytes(-len(head) % 32) + bytes(32 + 18)


def _imatrix_seeds() -> list[bytes]:
    """llama-imatrix's two forms: GGUF (metadata, W.in_sum2 and W.counts) and the legacy .dat."""
    kv = (payloads.gguf_string("general.type") + struct.pack("<I", 8) + payloads.gguf_string("imatrix")
          + payloads.gguf_string("imatrix.datasets") + struct.pack("<IIQ", 9, 8, 1) + payloads.gguf_string("c.txt")
          + payloads.gguf_string("imatrix.chunk_count") + struct.pack("<II", 4, 2)
          + payloads.gguf_string("imatrix.chunk_size") + struct.pack("<II", 4, 512))
    tensors = payloads.gguf_tensor_info("w.in_sum2", [4, 1], 0, 0) + payloads.gguf_tensor_info("w.counts", [1, 1], 0, 32)
    head = payloads.gguf_bytes(n_kv=4, n_tensors=2, kv=kv, tensors=tensors)
    values = struct.pack("<4f", 1.0, 2.0, 0.0, 8.0)
    gguf_form = head + bytes(-len(head) % 32) + values + bytes(16) + struct.pack("<f", 2.0)
    legacy = (struct.pack("<ii", 1, 1) + b"w" + struct.pack("<ii", 2, 4) + values
              + struct.pack("<ii", 2, 5) + b"c.txt")
    return [gguf_form, legacy]


_PICKLES = [pickle.dumps({"w": [1.0, 2.0], "n": None, "s": "x" * 5000}, protocol=p) for p in (0, 1, 2, 5)]
_ZIP = payloads.torch_zip(pickle.dumps({"a": 1}, protocol=2), extra={"archive/data/0": b"\0" * 16})
_SAFETENSORS = payloads.safetensors_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                           "__metadata__": {"k": "v"}}, b"\0" * 8)
_ONNX = payloads.onnx_external_model("w.bin")
_NPY = b"\x93NUMPY\x01\x00v\x00{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }" + b" " * 50 + b"\n" + bytes(16)
_CORPUS = payloads.hostile_corpus()


def _npz_seed(compressed: bool) -> bytes:
    """What numpy writes: C and Fortran order, big-endian, 0-d; stored or deflated."""
    out = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(
        out, w=np.arange(6, dtype=np.float32).reshape(2, 3), f=np.asfortranarray(np.ones((2, 2))),
        b=np.arange(3, dtype=">i4"), s=np.float16(1.5))
    return out.getvalue()


_NPZ = [_npz_seed(False), _npz_seed(True)]
_HDF5 = hdf5.SIGNATURE + bytes([0, 0, 0, 0, 0, 8, 8, 0]) + bytes(80)     # superblock v0, 8-byte offsets
# TensorFlow 2.21's own files (fixtures/tensorflow/generate.py): a checkpoint index, its object graph, SavedModels.
_TF = Path(__file__).resolve().parents[1] / "fixtures" / "tensorflow"
_TF_INDEX = (_TF / "benign" / "module_ckpt" / "ckpt-1.index").read_bytes()
_TF_GRAPH_ENTRY = tf_bundle.read_index(_TF_INDEX).entries[tf_bundle.OBJECT_GRAPH_KEY]
_TF_GRAPH_STRING = (_TF / "benign" / "module_ckpt" / "ckpt-1.data-00000-of-00001").read_bytes()[
    _TF_GRAPH_ENTRY.offset:_TF_GRAPH_ENTRY.offset + _TF_GRAPH_ENTRY.size]
_GGML = {kind: tiny_llama_bytes(type_name, kind=kind, version=version, n_layer=1, n_ff=32)
         for kind, version, type_name in (("ggjt", 3, "Q4_0"), ("ggml", None, "F16"))}
_TF_SAVED = [(_TF / "hostile" / name / "saved_model.pb").read_bytes() for name in ("read_file", "tf1_read_file")]
SEEDS = [*_PICKLES, _ZIP, _SAFETENSORS, _ONNX, _gguf_seed(), _NPY, _HDF5,
         payloads.torchscript_zip("def f(x):\n  return x\n"), *_NPZ, _TF_INDEX, _TF_SAVED[0]]


def _torch_save_seed(legacy: bool) -> bytes:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"w": base, "t": base.t(), "row": base[1], "h": torch.ones(3, dtype=torch.bfloat16),
             "f8": torch.zeros(2, dtype=torch.float8_e4m3fn), "n": 3}
    buffer = io.BytesIO()
    torch.save(state, buffer, _use_new_zipfile_serialization=not legacy)
    return buffer.getvalue()


_TORCH_SAVES = [_torch_save_seed(legacy=False), _torch_save_seed(legacy=True)]


def _torch_script_seed(how: str) -> bytes:
    """A small torch.jit.save archive: float32 and bf16 parameters, a tie, a strided buffer, a List[int]."""
    import warnings

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 3), torch.nn.LayerNorm(3).bfloat16())
    net[1].weight = torch.nn.Parameter(net[0].weight.t())
    net.register_buffer("mix", torch.arange(6.0).reshape(2, 3).t())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = torch.jit.script(net) if how == "script" else torch.jit.trace(net[:2], torch.ones(1, 3))
        buffer = io.BytesIO()
        torch.jit.save(compiled, buffer)
    return buffer.getvalue()


_TORCH_SCRIPTS = [_torch_script_seed("script"), _torch_script_seed("trace")]


def _read_small_tensors(parsed: torch_format.TorchFile) -> None:
    """Read every tensor small enough to read here (mutations may claim large expanded views)."""
    for record in parsed.tensors:
        if record.nbytes <= 1 << 26:
            parsed.array(record)
            parsed.span(record)


def _torch_file(data: bytes) -> None:
    _read_small_tensors(torch_format.parse(data, source="fuzz.pt", limits=pickle_parse.Bounds(seconds=5)))


def _torch_script(data: bytes) -> None:
    """A TorchScript archive, parsed and read the same way."""
    _read_small_tensors(torch_format.parse_script(data, source="fuzz.pt", limits=pickle_parse.Bounds(seconds=5)))


def _pt2_seed() -> bytes:
    """A small torch.export.save archive: a parameter, a buffer, a lifted constant, a dynamic batch."""
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)
            self.register_buffer("scale", torch.arange(2.0))
            self.bias = torch.tensor([0.5, 1.5])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * self.scale + self.bias

    program = torch.export.export(Net(), (torch.ones(2, 3),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


_PT2 = [_pt2_seed(), payloads.pt2_zip(constants={"c": "tensor_0"})]


def _pt2_archive(data: bytes) -> None:
    """A PT2 archive parsed, its program summarised and every tensor read the way the converter reads them."""
    parsed = pt2.parse(data, source="fuzz.pt2")
    parsed.program.summary()
    parsed.read_extra("modelkit.json", 1 << 16)
    for record in (*parsed.weights.values(), *parsed.constants.values()):
        if record.nbytes <= 1 << 26:
            parsed.file.array(record)
            parsed.file.span(record)


def _walk_fields(data: bytes) -> None:
    for _, wire, value in fields(data, 0, len(data)):
        if wire == 2:
            text(data, value, strict=False)
            int64s(data, wire, value)


def _zip_members(data: bytes) -> None:
    for entry in zipdir.read_directory(data):
        try:
            zipdir.member_data(data, entry)
        except ParseError:
            pass


def _zip_member_bytes(data: bytes) -> None:
    for entry in zipdir.read_directory(data):
        zipdir.read_start(data, entry, 64)
        if entry.file_size <= 1 << 20:
            zipdir.read_into(data, entry, bytearray(entry.file_size))


def _safetensors_header(data: bytes) -> None:
    header = safetensors.read_header(data)
    for info in header.entries.values():
        safetensors.tensor_problem(info, len(data) - header.data_start)


def _tfjs_model(data: bytes) -> None:
    """Parse a model.json, then check its shards against an empty folder (sizes only; nothing is read)."""
    model = tfjs.read_model(data)
    tfjs.declared_paths(model.document)
    tfjs.shard_problems(model, "/nonexistent-modelkit-fuzz")


_TFJS = [payloads.tfjs_model_json(payloads.keras_sequential([{"class_name": "Dense", "config": {"name": "d"}}]),
                                  [payloads.tfjs_group(["g1-s1of2.bin", "g1-s2of2.bin"],
                                                       [("d/kernel", [3, 2], "float32"), ("d/bias", [2], "float16")])]),
         payloads.tfjs_lambda(wrapped=True), payloads.tfjs_graph("PyFunc")]


_IR = (b'<?xml version="1.0"?>\n<net name="m" version="11"><layers>'
       b'<layer id="0" name="x" type="Parameter" version="opset1"><data shape="?,2" element_type="f32"/></layer>'
       b'<layer id="1" name="w" type="Const" version="opset1"><data element_type="f32" shape="3, 2" offset="0" size="24"/>'
       b'<output><port id="0" names="w"/></output></layer>'
       b'<layer id="2" name="loop" type="Loop" version="opset5"><body><layers><layer id="0" name="c" type="Const" '
       b'version="custom"><data element_type="u4" shape="4" offset="24" size="2"/></layer></layers></body></layer>'
       b'</layers><rt_info><modelkit><names value="{}"/></modelkit></rt_info></net>')


def _openvino_ir(data: bytes) -> None:
    ir = openvino_ir.read_ir(data)
    openvino_ir.custom_layers(ir)
    for const in ir.consts:
        openvino_ir.const_problem(const, 24)


def _pickle_stream(data: bytes) -> None:
    pos = 0
    while pos < len(data):
        pos = pickle_parse.walk(data, pos, len(data), pickle_parse.Bounds(seconds=5)).end


# parser -> (call on bytes, seeds); each may raise ParseError only
_W4A16_CONFIG = json.dumps({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
    "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                                   "symmetric": True, "dynamic": False}}},
    "ignore": ["lm_head"], "quantization_status": "compressed"}).encode()
_MIXED_CONFIG = json.dumps({"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {
    "a": {"targets": ["re:.*q_proj$"], "format": "float-quantized",
          "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}},
    "b": {"targets": ["model.layers.0.mlp.up_proj"], "format": "int-quantized", "weights": {"num_bits": 8}}},
    "kv_cache_scheme": {"num_bits": 8, "type": "float"}, "sparsity_config": {"format": "dense"}}).encode()


def _quantization_config(data: bytes) -> None:
    """config.json's quantization_config once JSON has parsed it (parse.hf.read_json raises ParseError otherwise)."""
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return
    ct_parse.parse(value, source="config.json")


PARSERS = {
    "protobuf.fields": (_walk_fields, [_ONNX, *SEEDS]),
    "gguf.read_header": (lambda b: gguf.read_header(b, versions=(1, 2, 3)), [_gguf_seed(), _CORPUS["tensor.gguf"]]),
    "safetensors.read_header": (_safetensors_header, [_SAFETENSORS, _CORPUS["duplicate.safetensors"]]),
    "safetensors.read_index": (safetensors.read_index, [b'{"weight_map": {"a": "m-1.safetensors"}}']),
    "zipdir": (_zip_members, [_ZIP, payloads.torchscript_zip("x = 1\n"), payloads.keras_zip(b"{}")]),
    "keras.load_json": (keras.load_json, [payloads.keras_lambda_config(), b'{"chat_template": "x"}']),
    "keras.configs_in": (lambda b: list(keras.configs_in(b)), [b"\x00" + payloads.keras_lambda_config() + b"\x00"]),
    "keras.read_archive": (keras.read_archive, [payloads.keras_zip(json.dumps(payloads.keras_sequential(
        [{"class_name": "Dense", "config": {"name": "d"}}])).encode())]),
    "tfjs.read_model": (_tfjs_model, _TFJS),
    "openvino.read_ir": (_openvino_ir, [_IR]),
    "npy.read_header": (npy.read_header, [_NPY, _CORPUS["npy-header.npy"]]),
    "npz.read_members": (npz.read_members, _NPZ),
    "zipdir.read_into": (_zip_member_bytes, _NPZ),
    "pickle.walk": (_pickle_stream, _PICKLES + [payloads.system_pickle(protocol=p) for p in (0, 2, 4)]),
    "torch_format.parse": (_torch_file, _TORCH_SAVES),
    "torch_format.parse_script": (_torch_script, _TORCH_SCRIPTS),
    "tf_bundle.read_index": (tf_bundle.read_index, [_TF_INDEX, (_TF / "benign" / "dense_savedmodel" / "variables" /
                                                                "variables.index").read_bytes()]),
    "tf_bundle.strings": (lambda b: tf_bundle.strings(b, 2), [_TF_GRAPH_STRING]),
    "tf_bundle.object_graph": (lambda b: tf_bundle.object_graph(tf_bundle.strings(b, 1)[0]), [_TF_GRAPH_STRING]),
    "savedmodel.read": (savedmodel.read, _TF_SAVED),
    "savedmodel.keras_metadata": (savedmodel.keras_metadata,
                                  [(_TF / "hostile" / "keras2_lambda" / "keras_metadata.pb").read_bytes()]),
    "ggml.read": (ggml.read, list(_GGML.values())),
    "imatrix.read_imatrix": (lambda b: [e.importance for e in imatrix_parse.read_imatrix(b).entries.values()],
                             _imatrix_seeds()),
    "pt2.parse": (_pt2_archive, _PT2),
    "compressed_tensors.parse": (_quantization_config, [_W4A16_CONFIG, _MIXED_CONFIG]),
}
# predicates: answer True or False for anything
PREDICATES = {
    "sniff.sniff": lambda b: sniff.sniff(b, 0, len(b)) in (None, *{"zip", "pickle", "npy", "gguf", "hdf5",
                                                                   "safetensors", "tar", "onnx", "gzip", "bzip2",
                                                                   "xz", "lzma", "zlib", "savedmodel",
                                                                   "tf-checkpoint", "ggml"}),
    "sniff.describe": lambda b: isinstance(sniff.describe(b), str),
    "onnx.looks_like_model": lambda b: onnx.looks_like_model(b, 0, len(b)) in (True, False),
    "onnx.is_model": lambda b: onnx.is_model(b) in (True, False),
    "gguf.plausible": lambda b: gguf.plausible(b) in (True, False),
    "safetensors.plausible": lambda b: safetensors.plausible(b, len(b)) in (True, False),
    "hdf5.plausible_superblock": lambda b: hdf5.plausible_superblock(b) in (True, False),
    "zipdir.has_directory": lambda b: zipdir.has_directory(b) in (True, False),
    "pickle.looks_like_pickle": lambda b: pickle_parse.looks_like_pickle(b) in (True, False),
    "tfjs.looks_like_model": lambda b: tfjs.looks_like_model(b) in (True, False),
    "ggml.magic": lambda b: ggml.magic(b) in (None, "ggml", "ggmf", "ggjt"),
    "savedmodel.looks_like": lambda b: savedmodel.looks_like(b, 0, len(b)) in (True, False),
    "savedmodel.fingerprint": lambda b: savedmodel.fingerprint(b, 0, len(b)) in (True, False),
    "sniff.unsupported_archive": lambda b: sniff.unsupported_archive(b) in (None, "7z", "rar", "zstd", "lz4", "cab",
                                                                          "xar", "ar", "cpio", "squashfs", "snappy",
                                                                          "lzop"),
}


@pytest.mark.parametrize("name", sorted(PARSERS))
@_SETTINGS
@given(data=st.data())
def test_parsers_raise_only_parse_errors(name, data):
    parse, seeds = PARSERS[name]
    blob = data.draw(mutated(seeds) | st.binary(max_size=300))
    started = time.monotonic()
    try:
        parse(blob)
    except ParseError as e:
        assert str(e) and "\n" not in str(e)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("name", sorted(PREDICATES))
@_SETTINGS
@given(data=st.data())
def test_predicates_never_raise(name, data):
    blob = data.draw(mutated(SEEDS) | st.binary(max_size=300))
    assert PREDICATES[name](blob)


@_SETTINGS
@given(name=st.text(max_size=40))
def test_path_rules_never_raise(tmp_path, name):
    assert paths.member_problem(name) is None or isinstance(paths.member_problem(name), str)
    problem = paths.location_problem(name, str(tmp_path))
    assert problem is None or isinstance(problem, str)
    try:
        paths.resolve_location(str(tmp_path), name, what="initializer 'w'")
    except ParseError as e:
        assert "initializer 'w'" in str(e)


@pytest.mark.parametrize("name", sorted(_CORPUS))
def test_corpus_through_every_parser(name):
    blob = _CORPUS[name]
    for parse, _ in PARSERS.values():
        try:
            parse(blob)
        except ParseError:
            pass
    assert all(predicate(blob) for predicate in PREDICATES.values())


# ---------------------------------------------------------------------------------------------
# The scanner: never raises, never hangs, never calls a hostile file clean.

@pytest.mark.parametrize("name", sorted(_CORPUS))
def test_scanner_flags_the_corpus(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(_CORPUS[name])
    started = time.monotonic()
    report = scan(path, limits=Limits(seconds=10))
    assert time.monotonic() - started < 10
    assert not any("internal scanner error" in e.message for e in report.errors), report.errors
    # every corpus file is hostile or malformed: never a clean report
    assert report.errors or report.worst >= Severity.SUSPICIOUS, (name, report.findings)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=mutated(SEEDS + list(_CORPUS.values())))
def test_scanner_never_raises_or_hangs(tmp_path, blob):
    path = tmp_path / "fuzz.bin"
    path.write_bytes(blob)
    started = time.perf_counter()
    report = scan(path, limits=Limits(seconds=5))
    assert time.perf_counter() - started < 5
    assert report.errors or report.files
    assert not any("internal scanner error" in e.message for e in report.errors), report.errors


# ---------------------------------------------------------------------------------------------
# The converters: detect never raises; read raises only one-line ModelkitErrors naming the file.

def _plain_h5(path):
    with h5py.File(path, "w") as f:
        f.create_group("vars").attrs["name"] = "sequential"
        f["layers/dense/vars/0"] = np.arange(6, dtype=np.float32).reshape(2, 3)
        f["layers/dense_1/vars/0"] = np.arange(6, dtype=">f8").reshape(3, 2)
    return path


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> dict[str, bytes]:
    """One small valid file per format (and the variants whose readers differ), to mutate."""
    folder = tmp_path_factory.mktemp("fuzz-samples")
    mlp = Checkpoint.from_module(build("mlp", {"hidden": [3]}, seed=0), metadata={"note": "x"})
    tiny = build("tinylm", {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                            "num_key_value_heads": 1, "max_position_embeddings": 16, "vocab_size": 32}, seed=0)
    out = {}
    for fmt in sorted(f for f in WRITABLE if not FORMATS[f].folder):     # hf: a folder, its files are these
        out[fmt] = modelkit.save(mlp, folder / f"m{FORMATS[fmt].suffixes[0]}", format=fmt).read_bytes()
    out["gguf-llama"] = modelkit.save(Checkpoint.from_module(tiny), folder / "l.gguf").read_bytes()
    out["onnx-tinylm"] = modelkit.save(Checkpoint.from_module(tiny), folder / "l.onnx").read_bytes()
    legacy = folder / "legacy.pt"
    torch.save(build("mlp", {"hidden": [3]}, seed=0).state_dict(), legacy, _use_new_zipfile_serialization=False)
    out["pth-legacy"] = legacy.read_bytes()
    out["hdf5-plain"] = _plain_h5(folder / "plain.h5").read_bytes()
    out["npz-numpy"] = _NPZ[1]
    out["ggml"], out["ggml-unversioned"] = _GGML["ggjt"], _GGML["ggml"]
    return out


_VARIANTS = sorted([*(f for f in WRITABLE if not FORMATS[f].folder), "gguf-llama", "onnx-tinylm", "pth-legacy", "hdf5-plain", "npz-numpy",
                    "ggml", "ggml-unversioned"])
_PREFIXES = {"safetensors": struct.pack("<Q", 40), "gguf": b"GGUF\x03\x00\x00\x00", "onnx": b"\x08\x0a\x3a",
             "pth": b"PK\x03\x04", "torchscript": b"PK\x03\x04", "pt2": b"PK\x03\x04", "hdf5": hdf5.SIGNATURE,
             "npz": b"PK\x03\x04", "ggml": b"tjgg\x03\x00\x00\x00", "keras": b"PK\x03\x04",
             "openvino": b'<?xml version="1.0"?>\n<net name="m" version="11">'}


@pytest.mark.parametrize("variant", _VARIANTS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_readers_raise_only_modelkit_errors(tmp_path, samples, variant, data):
    fmt = variant.split("-")[0]
    seed = samples[variant]
    blob = data.draw(mutated([seed]) | st.binary(max_size=200).map(lambda b: _PREFIXES[fmt] + b))
    path = tmp_path / f"fuzz{FORMATS[fmt].suffixes[0]}"
    path.write_bytes(blob)
    module = load_format(fmt)
    module.detect(path)                                                # never raises
    started = time.monotonic()
    try:
        modelkit.load(path, format=fmt).materialize()
    except ModelkitError as e:
        assert "\n" not in str(e)
        if isinstance(e, FormatError):
            assert str(path) in str(e)                                 # every message names the file
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("name, member", [("benign/module_savedmodel", "saved_model.pb"),
                                          ("benign/module_savedmodel", "variables/variables.index")])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_tensorflow_readers_raise_only_modelkit_errors(tmp_path, name, member, data):
    folder = tmp_path / "tf"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(_TF / name, folder)
    target = folder / member
    target.write_bytes(data.draw(mutated([target.read_bytes()])))
    try:
        modelkit.load(folder, format="savedmodel" if "savedmodel" in name else "tfcheckpoint").materialize()
    except ModelkitError as e:
        assert str(e) and "\n" not in str(e)


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) |
                     st.text(max_size=20), lambda inner: st.lists(inner, max_size=4) |
                     st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=10)
_CONFIG_FIELDS = [("format",), ("quantization_status",), ("config_groups",), ("ignore",), ("kv_cache_scheme",),
                  ("sparsity_config",), ("transform_config",), ("config_groups", "group_0"),
                  ("config_groups", "group_0", "targets"), ("config_groups", "group_0", "format"),
                  ("config_groups", "group_0", "weights")] + [
    ("config_groups", "group_0", "weights", key) for key in ("num_bits", "type", "strategy", "group_size",
                                                            "block_structure", "symmetric", "dynamic", "actorder")]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(_CONFIG_FIELDS), value=_JSON)
def test_a_quantization_config_with_any_field_raises_only_parse_errors(field, value):
    """compressed-tensors' quantization_config with one field replaced by any JSON value: parsed, or one ParseError."""
    config = json.loads(_W4A16_CONFIG)
    owner = config
    for key in field[:-1]:
        owner = owner[key]
    owner[field[-1]] = value
    try:
        ct_parse.parse(config, source="config.json")
    except ParseError as e:
        assert "\n" not in str(e)
