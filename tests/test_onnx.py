"""The ONNX converter: exact weights, checker- and onnxruntime-approved graphs, external data, safety."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import modelkit
from modelkit.checkpoint import ARCH_KEY, Checkpoint, QuantizedTensor
from modelkit.errors import ConfigError, FormatError, UnsupportedConversionError
from modelkit.formats import WriteOptions, detect_format, load_format
from modelkit.models import build, load_model_module
from modelkit.storage.atomic import atomic_path

onnx_format = load_format("onnx")

# Largest |torch eager - onnxruntime| accepted on the small test configs (float32, CPU EP).
# Measured 2026-11-21 (torch 2.13.0, onnxruntime 1.31.1, opset 20) over the batch sizes and
# sequence lengths of test_onnxruntime_matches_eager: mlp 2.98e-08, cnn 1.49e-08, tinylm 1.34e-07.
# The trained default-size models in runs/ measured mlp 7.63e-06, cnn 4.77e-06, tinylm 1.41e-05
# (outputs up to 60 in size). Pinned with about 10x headroom: only summation order differs.
ATOL = {"mlp": 5e-7, "cnn": 5e-7, "tinylm": 2e-6}
SHAPES = {  # (batch, sequence) pairs fed to each model; None: the model has no sequence axis
    "mlp": [(1, None), (3, None), (17, None)],
    "cnn": [(1, None), (3, None), (17, None)],
    "tinylm": [(1, 1), (2, 7), (5, 16), (3, 64)],
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _props(path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


@pytest.fixture(scope="module")
def export_once(tmp_path_factory):
    """Export each small reference model once per module: the export is the slow part."""
    files = {}

    def export(name: str, model: nn.Module):
        if name not in files:
            path = tmp_path_factory.mktemp(name) / f"{name}.onnx"
            modelkit.save(Checkpoint.from_module(model, metadata={"note": "hello"}), path)
            files[name] = path
        return files[name]

    return export


@pytest.fixture
def exported(export_once, model_name, small_model):
    return export_once(model_name, small_model)


def _inputs(name: str, batch: int, seq: int | None, seed: int) -> torch.Tensor:
    make = load_model_module(name).example_inputs
    return make(batch, seed=seed) if seq is None else make(batch, seed=seed, seq_len=seq)


# ---------------------------------------------------------------- round trip and judges


def test_round_trip_is_bit_exact(exported, small_model):
    back = modelkit.load(exported)
    original = small_model.state_dict()
    assert list(back.tensors) == list(original)
    for name, tensor in back.materialize().items():
        assert tensor.dtype == original[name].dtype and tensor.shape == original[name].shape, name
        assert torch.equal(_bits(tensor), _bits(original[name])), name
    assert back.arch == Checkpoint.from_module(small_model).arch
    assert back.metadata["note"] == "hello"


def test_load_module_rebuilds_the_model(exported, small_model, model_name):
    rebuilt = modelkit.load_module(exported)
    modelkit.assert_same_outputs(small_model, rebuilt, _inputs(model_name, 3, 5 if model_name == "tinylm" else None, 1))


def test_onnx_checker_accepts_the_file(exported):
    onnx.checker.check_model(str(exported), full_check=True)
    model = onnx.load(str(exported))
    assert {o.domain: o.version for o in model.opset_import}[""] == onnx_format.OPSET
    assert model.producer_name == "pytorch"


def test_onnxruntime_matches_eager_with_dynamic_axes(exported, small_model, model_name):
    graph = onnx.load(str(exported)).graph
    dims = [d.dim_param or d.dim_value for d in graph.input[0].type.tensor_type.shape.dim]
    assert dims[0] == "batch" and (model_name != "tinylm" or dims[1] == "sequence")
    assert [o.name for o in graph.output] == ["logits"]
    run = onnx_format.runnable(exported)
    worst = 0.0
    with torch.no_grad():
        for seed, (batch, seq) in enumerate(SHAPES[model_name]):
            x = _inputs(model_name, batch, seq, seed)
            expected, actual = small_model(x), run(x)
            assert actual.shape == expected.shape and actual.dtype == expected.dtype
            worst = max(worst, float((expected - actual).abs().max()))
    assert worst <= ATOL[model_name]


def test_metadata_props_hold_arch_version_names_and_metadata(exported, small_model):
    props = _props(exported)
    assert json.loads(props[ARCH_KEY]) == json.loads(Checkpoint.from_module(small_model).arch.to_json())
    assert props[onnx_format.VERSION_KEY] == modelkit.__version__
    assert props["note"] == "hello"
    names = json.loads(props[onnx_format.NAMES_KEY])
    assert list(names) == list(small_model.state_dict())
    initializers = {t.name for t in onnx.load(str(exported)).graph.initializer}
    assert all(entry["initializer"] in initializers for entry in names.values())
    assert onnx_format.NAMES_KEY not in modelkit.load(exported).metadata   # structural keys are not metadata
    assert b"stack_trace" not in exported.read_bytes()                       # no tracebacks with local paths


def test_float16_checkpoint_exports_as_float16(tmp_path):
    model = build("mlp", seed=0).half().eval()
    path = modelkit.save(Checkpoint.from_module(model), tmp_path / "half.onnx")
    back = modelkit.load(path).materialize()
    for name, tensor in model.state_dict().items():
        assert back[name].dtype == torch.float16 and torch.equal(_bits(back[name]), _bits(tensor)), name
    x = load_model_module("mlp").example_inputs(17).half()
    modelkit.assert_same_outputs(model, onnx_format.runnable(path), x, atol=2e-3)   # measured 2.4e-04 on 2026-11-21


def test_export_prints_nothing(tmp_path, capfd):
    modelkit.save(Checkpoint.from_module(build("mlp", seed=0)), tmp_path / "m.onnx")
    out, err = capfd.readouterr()
    assert out == "" and err == ""


# ---------------------------------------------------------------- a user's own module


class TiedNet(nn.Module):
    """Not from the zoo: a tied embedding/head, a parameter the optimizer folds away, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.proj = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.register_buffer("offset", torch.arange(16.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.emb(ids)) * (self.gain * 2.0 + 1.0)     # constant-folded into a new tensor
        return self.head(h) + self.offset


def _write(ckpt, final, *, threshold=onnx_format.EXTERNAL_DATA_THRESHOLD, **options):
    """Write as modelkit.save does (temporary name, rename), with write()'s own keyword arguments."""
    with atomic_path(final, companions=(".data",)) as tmp:
        onnx_format.write(ckpt, tmp, WriteOptions(final_path=final, **options), external_data_threshold=threshold)
    return final


def test_user_module_exports_with_its_own_inputs(tmp_path):
    torch.manual_seed(0)
    model = TiedNet().eval()
    ckpt = Checkpoint.from_module(model)
    path = _write(ckpt, tmp_path / "tied.onnx", module=model, example_inputs=(torch.randint(0, 16, (2, 5)),))
    onnx.checker.check_model(str(path), full_check=True)
    back = modelkit.load(path)
    assert back.arch is None and list(back.tensors) == list(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(_bits(back.tensors[name].load()), _bits(tensor)), name
    names = json.loads(_props(path)[onnx_format.NAMES_KEY])
    assert names["emb.weight"]["initializer"] == names["head.weight"]["initializer"]   # tied: stored once
    x = torch.randint(0, 16, (4, 5))
    run = onnx_format.runnable(path)
    modelkit.assert_same_outputs(model, run, x, atol=1e-5)   # measured 1.9e-06 (outputs up to 16) on 2026-11-21
    with pytest.raises(ConfigError, match="takes 1 inputs"):
        run(x, x)
    with pytest.raises(UnsupportedConversionError, match="--arch"):
        modelkit.load_module(path)


def test_user_module_without_example_inputs_is_refused(tmp_path):
    model = TiedNet().eval()
    with pytest.raises(UnsupportedConversionError, match="example inputs"):
        _write(Checkpoint.from_module(model), tmp_path / "t.onnx", module=model)
    assert list(tmp_path.iterdir()) == []


def test_quantized_tensor_without_a_dequantize_linear_form_is_refused_before_writing(tmp_path):
    # float "qdata" and no group_size: no DequantizeLinear computes it (real ones: tests/test_quantizers.py)
    ckpt = Checkpoint.from_module(build("mlp", seed=0))
    part = ckpt.tensors["net.0.weight"]
    tensors = dict(ckpt.tensors)
    tensors["net.0.weight"] = QuantizedTensor("int8", "affine", part.shape, part.dtype, {"qdata": part, "scale": part})
    with pytest.raises(UnsupportedConversionError, match="quantized"):
        modelkit.save(Checkpoint(tensors, ckpt.metadata, ckpt.arch), tmp_path / "q.onnx")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- external data


def test_external_data_round_trip(tmp_path):
    model = build("cnn", {"channels": [4, 8], "hidden": 16}, seed=0).eval()
    final = _write(Checkpoint.from_module(model), tmp_path / "cnn.onnx", threshold=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cnn.onnx", "cnn.onnx.data"]
    proto = onnx.load(str(final), load_external_data=False)
    external = [t for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert external and {e.value for t in external for e in t.external_data if e.key == "location"} == {"cnn.onnx.data"}
    onnx.checker.check_model(str(final), full_check=True)
    back = modelkit.load(final)
    for name, tensor in model.state_dict().items():
        assert torch.equal(_bits(back.tensors[name].load()), _bits(tensor)), name
    x = load_model_module("cnn").example_inputs(3)
    modelkit.assert_same_outputs(model, onnx_format.runnable(final), x, atol=ATOL["cnn"])


def test_failed_external_write_leaves_no_data_file(tmp_path, monkeypatch):
    def refuse(path):
        raise UnsupportedConversionError("the exported graph", "onnx", "checker says no")

    monkeypatch.setattr(onnx_format, "_check", refuse)
    with pytest.raises(UnsupportedConversionError, match="checker says no"):
        _write(Checkpoint.from_module(build("mlp", seed=0)), tmp_path / "m.onnx", threshold=0)
    assert list(tmp_path.iterdir()) == []


def test_failed_verification_after_an_external_write_leaves_nothing(tmp_path):
    """The data file is staged with the model: a check failing after write() removes both."""
    final = tmp_path / "m.onnx"
    with pytest.raises(RuntimeError, match="outputs differ"), atomic_path(final, companions=(".data",)) as tmp:
        onnx_format.write(Checkpoint.from_module(build("mlp", seed=0)), tmp, WriteOptions(final_path=final),
                          external_data_threshold=0)
        assert (tmp.parent / "m.onnx.data").is_file()
        raise RuntimeError("outputs differ")        # what a failed verification does
    assert list(tmp_path.iterdir()) == []


def test_replacing_a_model_replaces_or_removes_its_data_file(tmp_path):
    final = _write(Checkpoint.from_module(build("mlp", seed=0)), tmp_path / "m.onnx", threshold=0)
    first = (tmp_path / "m.onnx.data").read_bytes()
    with atomic_path(final, force=True, companions=(".data",)) as tmp:
        onnx_format.write(Checkpoint.from_module(build("mlp", seed=1)), tmp, WriteOptions(final_path=final),
                          external_data_threshold=0)
    assert (tmp_path / "m.onnx.data").read_bytes() != first        # the new model's weights
    assert torch.equal(modelkit.load(final).tensors["net.0.weight"].load(), build("mlp", seed=1).net[0].weight)
    with atomic_path(final, force=True, companions=(".data",)) as tmp:                 # now small: inline
        onnx_format.write(Checkpoint.from_module(build("mlp", seed=2)), tmp, WriteOptions(final_path=final))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_stray_data_file_is_not_overwritten(tmp_path):
    (tmp_path / "m.onnx.data").write_bytes(b"someone else's weights")
    with pytest.raises(ConfigError, match="m.onnx.data exists"):
        _write(Checkpoint.from_module(build("mlp", seed=0)), tmp_path / "m.onnx", threshold=0)
    assert (tmp_path / "m.onnx.data").read_bytes() == b"someone else's weights"


# ---------------------------------------------------------------- files modelkit did not write


def _handmade(path, *, location=None, offset=0, length=None, constant_location=None, extra_props=None):
    """A MatMul model with one (3, 4) float initializer "w", inline or external, plus an int64 one."""
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    weight = numpy_helper.from_array(w, "w")
    if location is not None:
        weight.ClearField("raw_data")
        weight.data_location = TensorProto.EXTERNAL
        entries = {"location": location, "offset": str(offset), "length": str(length or w.nbytes)}
        for key, value in entries.items():
            weight.external_data.add(key=key, value=value)
    steps = helper.make_tensor("steps", TensorProto.INT64, [2], [7, -3])          # typed int64_data, no raw bytes
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    if constant_location is not None:
        const = numpy_helper.from_array(w, "c")
        const.ClearField("raw_data")
        const.data_location = TensorProto.EXTERNAL
        const.external_data.add(key="location", value=constant_location)
        nodes = [helper.make_node("Constant", [], ["w2"], value=const), helper.make_node("MatMul", ["x", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])],
                              [weight, steps] if constant_location is None else [steps])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    helper.set_model_props(model, extra_props or {})
    path.write_bytes(model.SerializeToString())
    return path, w


def test_foreign_file_reads_with_its_initializer_names(tmp_path):
    path, w = _handmade(tmp_path / "foreign.onnx", extra_props={"author": "someone"})
    assert detect_format(path) == "onnx"
    ckpt = modelkit.load(path)
    assert list(ckpt.tensors) == ["w", "steps"] and ckpt.arch is None
    assert ckpt.metadata == {"author": "someone"}
    tensors = ckpt.materialize()
    assert torch.equal(tensors["w"], torch.from_numpy(w)) and tensors["steps"].tolist() == [7, -3]
    assert onnx_format.runnable(path)(torch.ones(2, 3)).tolist() == [[12, 15, 18, 21]] * 2


def test_foreign_external_data_inside_the_folder_is_read(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"\0" * 8 + np.arange(12, dtype=np.float32).tobytes())
    path, w = _handmade(tmp_path / "m.onnx", location="w.bin", offset=8)
    assert torch.equal(modelkit.load(path).tensors["w"].load(), torch.from_numpy(w))
    assert onnx_format.runnable(path)(torch.ones(1, 3)).tolist() == [[12, 15, 18, 21]]


@pytest.fixture
def outside(tmp_path):
    """A secret beside the model's folder, and the folder itself."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(12, dtype=np.float32).tobytes())
    folder = tmp_path / "model"
    folder.mkdir()
    return folder, secret


@pytest.mark.parametrize("location", ["../secret.bin", "sub/../../secret.bin", "..\\secret.bin", "/etc/passwd",
                                      "ABSOLUTE", "link.bin", "linked-folder/secret.bin"])
def test_external_data_outside_the_folder_is_refused(outside, location, monkeypatch):
    folder, secret = outside
    os.symlink(secret, folder / "link.bin")
    os.symlink(secret.parent, folder / "linked-folder")
    location = str(secret) if location == "ABSOLUTE" else location
    path, _ = _handmade(folder / "m.onnx", location=location)
    with pytest.raises(FormatError, match=r"model's folder|links outside") as info:
        modelkit.load(path)
    assert str(path) in str(info.value)

    import onnxruntime

    def never(*args, **kwargs):
        raise AssertionError("onnxruntime was handed a model whose external data escapes")

    monkeypatch.setattr(onnxruntime, "InferenceSession", never)
    with pytest.raises(FormatError, match="refusing to run"):
        onnx_format.runnable(path)


def test_escaping_constant_node_is_refused_before_onnxruntime(outside, monkeypatch):
    folder, _ = outside
    path, _ = _handmade(folder / "m.onnx", constant_location="../secret.bin")
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: pytest.fail("onnxruntime was called"))
    with pytest.raises(FormatError, match="refusing to run"):
        onnx_format.runnable(path)


@pytest.mark.parametrize(("offset", "length"), [(40, None), (0, 44), (-4, None), (2**62, None)])
def test_external_offsets_are_checked_against_the_file_size(tmp_path, offset, length):
    (tmp_path / "w.bin").write_bytes(np.arange(12, dtype=np.float32).tobytes())
    path, _ = _handmade(tmp_path / "m.onnx", location="w.bin", offset=offset, length=length)
    with pytest.raises(FormatError, match="w.bin"):
        modelkit.load(path)
    with pytest.raises(FormatError, match="refusing to run"):
        onnx_format.runnable(path)


def test_missing_external_file_is_a_format_error(tmp_path):
    path, _ = _handmade(tmp_path / "m.onnx", location="gone.bin")
    with pytest.raises(FormatError, match="missing"):
        modelkit.load(path)


def test_names_entry_pointing_nowhere_is_a_format_error(tmp_path):
    path, _ = _handmade(tmp_path / "m.onnx", extra_props={onnx_format.NAMES_KEY: '{"a": {"initializer": "nope"}}'})
    with pytest.raises(FormatError, match="not an initializer"):
        modelkit.load(path)


# ---------------------------------------------------------------- detection and fuzzing


def test_detect_claims_onnx_only(tmp_path):
    mlp = build("mlp", seed=0)
    safetensors = modelkit.save(Checkpoint.from_module(mlp), tmp_path / "m.safetensors")
    others = {
        "safetensors": safetensors.read_bytes(),
        "zip": b"PK\x03\x04" + bytes(60),
        "pickle": b"\x80\x04\x95" + bytes(40),
        "gguf": b"GGUF\x03\x00\x00\x00" + bytes(40),
        "hdf5": b"\x89HDF\r\n\x1a\n" + bytes(40),
        "text": b"hello world, this is text\n" * 4,
        "json": b'{"ir_version": 8, "graph": {}}',
        "varint-only": b"\x08\x0a",
        "ir_version-as-bytes": b"\x0a\x02ab\x3a\x00",
        "empty": b"",
    }
    for kind, data in others.items():
        path = tmp_path / f"other-{kind}.onnx"
        path.write_bytes(data)
        assert not onnx_format.detect(path), kind
    assert not onnx_format.detect(tmp_path)
    onnx_path, _ = _handmade(tmp_path / "weights.bin")
    assert onnx_format.detect(onnx_path)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


@pytest.mark.parametrize(("claimed", "expected"), [(0, True), (1, False)])
def test_detect_reads_headers_only(tmp_path, claimed, expected):
    """An 8 GiB sparse file whose graph field spans it: detect answers from the field headers alone,
    and refuses a graph that claims one byte more than the file has."""
    size = 8 * 2**30
    head = b"\x08\x0a\x3a"                               # ir_version 10, then field 7 (graph), LEN
    length = size - len(head) - len(_varint(size))
    path = tmp_path / "huge.onnx"
    with path.open("wb") as f:
        f.write(head + _varint(length + claimed) + b"\x0a\x00")   # the graph opens with an empty node
        f.truncate(size)
    assert onnx_format.detect(path) is expected
