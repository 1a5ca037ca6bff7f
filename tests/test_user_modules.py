"""Users' own modules (issue 14): `--arch module:function` found in the current folder, example inputs on
the command line (`--input-shape`, `--dynamic`) and in the API, and a torch Sequential's Keras layers.

Judges: onnxruntime runs the ONNX file at sizes other than the example's (the named axes are free);
torch.jit.load runs the TorchScript file; Keras 3 (torch backend) builds the model from the layout's
JSON with keras.models.model_from_json, loads our .weights.h5 with load_weights, and must give the torch
module's outputs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner
from torch import nn

import modelkit
from modelkit.cli import main
from modelkit.converters import hdf5
from modelkit.errors import ConfigError, UnsupportedConversionError
from modelkit.models import load_factory
from modelkit.pipeline.inputs import INT_HIGH, InputSpec, example_inputs, make_inputs, parse_dynamic

# Largest |Keras - torch| on the Sequentials below: measured 6.0e-08 (conv1d), 6.0e-08 (conv2d), 1.2e-07 (mlp),
# 7.5e-08 (text) on 2026-11-25 (float32, Keras 3 on torch's CPU kernels); pinned with headroom, as test_hdf5's.
KERAS_ATOL = 1e-6

USER_MODEL = textwrap.dedent('''
    """A user's model file, as users write them: next to their weights, not installed."""
    import torch
    from torch import nn


    def make():
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(4 * 4 * 4, 5))


    class Tagger(nn.Module):
        """Token ids and a float weight per sequence: two inputs of two dtypes."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(30, 8)
            self.head = nn.Linear(8, 3)

        def forward(self, ids, scale):
            return self.head(self.embed(ids)) * scale[:, None, None]
''')


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """The current directory holds user_model.py (and nothing on sys.path points at it); the weights of
    make() and Tagger() are saved beside it. The module is forgotten afterwards, so each test imports it."""
    (tmp_path / "user_model.py").write_text(USER_MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "user_model", raising=False)
    torch.manual_seed(0)
    for name in ("make", "Tagger"):
        module = load_factory(f"user_model:{name}")()
        safetensors.torch.save_file(module.state_dict(), tmp_path / f"{name}.safetensors")
    yield tmp_path
    sys.modules.pop("user_model", None)


def _modelkit(*args):
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _weights_module(folder, name):
    module = load_factory(f"user_model:{name}")()
    module.load_state_dict(safetensors.torch.load_file(folder / f"{name}.safetensors"))
    return module.eval()


def _dims(path):
    graph = onnx.load(path).graph
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}


# --- the bar: module:make in the current folder -> ONNX and TorchScript with --input-shape ----------------

def test_console_script_finds_the_module_in_the_current_folder(user_folder):
    """The installed `modelkit` script, whose sys.path[0] is its own folder, not the current one."""
    script = shutil.which("modelkit", path=os.path.dirname(sys.executable))
    assert script is not None, "the modelkit console script is not installed beside this interpreter"
    result = subprocess.run([script, "convert", "make.safetensors", "m.ts", "--arch", "user_model:make",
                             "--input-shape", "input=1x3x8x8:float32", "--json"],
                            cwd=user_folder, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verify"]["passed"]
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(torch.jit.load(str(user_folder / "m.ts"))(x), _weights_module(user_folder, "make")(x))


def test_onnx_of_a_user_module_runs_at_other_batch_sizes(user_folder):
    report = _modelkit("convert", "make.safetensors", "m.onnx", "--arch", "user_model:make",
                       "--input-shape", "input=2x3x8x8", "--dynamic", "input:0")
    assert report["verify"]["passed"] and report["verify"]["inputs"] == 1
    assert _dims(user_folder / "m.onnx") == {"input": ["input_0", 3, 8, 8]}
    session = ort.InferenceSession(str(user_folder / "m.onnx"), providers=["CPUExecutionProvider"])
    for batch in (1, 5):
        x = torch.randn(batch, 3, 8, 8)
        (got,) = session.run(None, {"input": x.numpy()})
        with torch.no_grad():
            want = _weights_module(user_folder, "make")(x).numpy()
        assert np.abs(got - want).max() <= 1e-5


def test_onnx_with_two_named_inputs_and_dtypes_has_their_dynamic_axes(user_folder):
    _modelkit("convert", "Tagger.safetensors", "t.onnx", "--arch", "user_model:Tagger",
              "--example-input", "ids=2x7:int64", "--example-input", "scale=2:float32",
              "--dynamic", "ids:0", "--dynamic", "ids:1", "--dynamic", "scale:0")
    assert _dims(user_folder / "t.onnx") == {"ids": ["ids_0", "ids_1"], "scale": ["ids_0"]}
    ids, scale = torch.randint(0, 30, (3, 11)), torch.rand(3)
    session = ort.InferenceSession(str(user_folder / "t.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"ids": ids.numpy(), "scale": scale.numpy()})
    with torch.no_grad():
        want = _weights_module(user_folder, "Tagger")(ids, scale).numpy()
    assert got.shape == (3, 11, 3) and np.abs(got - want).max() <= 1e-5


def test_torchscript_of_a_user_module(user_folder):
    report = _modelkit("convert", "Tagger.safetensors", "t.ts", "--arch", "user_model:Tagger",
                       "--input-shape", "ids=2x7:int64", "--input-shape", "scale=2")
    assert report["verify"]["passed"] and report["verify"]["max_abs_err"] <= 1e-5
    scripted = torch.jit.load(str(user_folder / "t.ts"))
    ids, scale = torch.randint(0, 30, (4, 3)), torch.rand(4)
    with torch.no_grad():
        assert torch.equal(scripted(ids, scale), _weights_module(user_folder, "Tagger")(ids, scale))


def test_a_graph_of_a_user_module_without_inputs_says_which_option_gives_them(user_folder):
    result = CliRunner().invoke(main, ["convert", "make.safetensors", "m.onnx", "--arch", "user_model:make"])
    assert result.exit_code == 2 and "--input-shape" in result.stderr


def test_dynamic_naming_no_input_is_refused_with_the_inputs(user_folder):
    result = CliRunner().invoke(main, ["convert", "Tagger.safetensors", "t.onnx", "--arch", "user_model:Tagger",
                                       "--input-shape", "ids=2x7:int64", "--input-shape", "scale=2",
                                       "--dynamic", "idz:1"])
    assert result.exit_code == 2
    assert "no input named 'idz'" in result.stderr and "ids" in result.stderr


def test_the_factory_may_not_return_something_else(user_folder):
    (user_folder / "odd.py").write_text("def make():\n    return 3\n")
    with pytest.raises(ConfigError, match="returned a int, not a torch.nn.Module"):
        modelkit.convert("make.safetensors", "m.onnx", arch="odd:make", example_inputs="1x3x8x8")
    sys.modules.pop("odd", None)


def test_the_current_folder_leaves_sys_path_after_the_import(user_folder):
    before = list(sys.path)
    load_factory("user_model:make")
    assert sys.path == before


# --- the API: tensors and dynamic axes ---------------------------------------------------------------

def test_export_takes_named_tensors_and_dynamic_axes(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 4)).eval()
    report = modelkit.export(net, tmp_path / "n.onnx", example_inputs={"tokens": torch.randint(0, 50, (2, 5))},
                             dynamic={"tokens": [0, 1]})
    assert report.verify["passed"]
    assert _dims(tmp_path / "n.onnx") == {"tokens": ["tokens_0", "tokens_1"]}
    tokens = torch.randint(0, 50, (4, 9))
    (got,) = ort.InferenceSession(str(tmp_path / "n.onnx")).run(None, {"tokens": tokens.numpy()})
    with torch.no_grad():
        assert np.abs(got - net(tokens).numpy()).max() <= 1e-5


# --- the grammar and the values ------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "spec"), [
    ("input=1x3x224x224:float32", InputSpec("input", (1, 3, 224, 224), "float32")),
    ("ids=1x16:int64", InputSpec("ids", (1, 16), "int64")),
    ("2x8", InputSpec(None, (2, 8), "float32")),
    ("mask=1x16:bool", InputSpec("mask", (1, 16), "bool")),
    ("ids=2x4:int32:5..9", InputSpec("ids", (2, 4), "int32", 5, 9)),
])
def test_input_spec_grammar(text, spec):
    assert InputSpec.parse(text) == spec


@pytest.mark.parametrize(("text", "message"), [
    ("input=1x3:float33", "unknown dtype 'float33'"),
    ("input=1x0", "at least 1"),
    ("input=1,3", "expected"),
    ("x=2x2:float32:0..4", "integer inputs only"),
    ("ids=2:int64:9..9", "integer inputs only"),
])
def test_bad_input_specs_say_what_is_wrong(text, message):
    with pytest.raises(ConfigError, match=message):
        InputSpec.parse(text)


@pytest.mark.parametrize(("module", "spec", "low", "high"), [
    (nn.Sequential(nn.Embedding(7, 2), nn.Embedding(40, 2)), "ids=64x64:int64", 0, 7),   # every table's ids
    (nn.Linear(2, 2), "n=64x64:int32", 0, INT_HIGH),
    (nn.Linear(2, 2), "n=64x64:int16:-3..4", -3, 4),
    (nn.Linear(2, 2), "m=64x64:bool", 0, 2),
])
def test_integer_inputs_fall_in_the_documented_range(module, spec, low, high):
    (x,) = make_inputs(module, [InputSpec.parse(spec)])
    assert x.dtype == getattr(torch, InputSpec.parse(spec).dtype)
    assert int(x.min()) == low and int(x.max()) == high - 1           # 4096 draws reach both ends


def test_inputs_are_seeded():
    first, second = (make_inputs(None, [InputSpec.parse("x=3x4")])[0] for _ in range(2))
    assert torch.equal(first, second)


def test_unnamed_inputs_take_forward_parameter_names():
    inputs = example_inputs(_Tagger(), ["2x3:int64", "2"])
    assert inputs.names == ("ids", "scale") and inputs.dynamic is None


@pytest.mark.parametrize(("given", "expected"), [
    (["input:0", "ids:1", "ids:0"], {"input": (0,), "ids": (0, 1)}),
    ({"ids": 1}, {"ids": (1,)}),
    ((), None),
])
def test_dynamic_grammar(given, expected):
    assert parse_dynamic(given) == expected


def test_dynamic_axis_beyond_the_input_is_refused():
    with pytest.raises(ConfigError, match="has 2 axes"):
        example_inputs(_Tagger(), ["ids=2x3:int64", "scale=2"], ["ids:2"])


class _Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, 8)

    def forward(self, ids, scale):
        return self.embed(ids) * scale.unsqueeze(-1).unsqueeze(-1)


# --- Keras: a Sequential's layers, judged by Keras itself ---------------------------------------------------

def _conv2d():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Sequential(nn.Conv2d(4, 6, 3), nn.GELU()), nn.AvgPool2d(1), nn.Flatten(), nn.Dropout(0.1),
                         nn.Linear(6 * 2 * 2, 5), nn.Tanh(), nn.LayerNorm(5), nn.Softmax(dim=-1))


def _conv1d():
    return nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.BatchNorm1d(4), nn.ReLU(), nn.MaxPool1d(2),
                         nn.Conv1d(4, 4, 1), nn.AvgPool1d(5), nn.Flatten(), nn.Linear(4, 3), nn.Sigmoid())


def _text():
    return nn.Sequential(nn.Embedding(40, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Sigmoid(), nn.Flatten(),
                         nn.Linear(8 * 6, 3))


def _mlp():
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 2))


KERAS_CASES = {"conv2d": (_conv2d, "4x3x8x8"), "conv1d": (_conv1d, "4x2x10"), "text": (_text, "4x6:int64"),
               "mlp": (_mlp, None)}


def _randomized(make):
    """Weights and running statistics far from their initial values, so every one of them counts."""
    torch.manual_seed(0)
    module = make().eval()
    for layer in module.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.running_mean.uniform_(-1, 1)
            layer.running_var.uniform_(0.5, 2)
            layer.weight.data.uniform_(0.5, 1.5)
            layer.bias.data.uniform_(-0.5, 0.5)
    return module


def _keras_model(keras, path):
    """The file alone: its keras_json attribute built by Keras's model_from_json, its weights by load_weights."""
    with h5py.File(path, "r") as f:
        assert f.attrs[hdf5.LAYOUT_ATTR] == "keras"
        architecture = f.attrs[hdf5.JSON_ATTR]
    net = keras.models.model_from_json(architecture)
    net.load_weights(str(path))
    return net


@pytest.mark.parametrize("case", sorted(KERAS_CASES))
def test_keras_builds_the_mapped_sequential_and_matches_torch(keras, case, tmp_path):
    make, spec = KERAS_CASES[case]
    module = _randomized(make)
    given = [spec] if spec else None
    report = modelkit.export(module, tmp_path / "m.weights.h5", example_inputs=given)
    assert report.verify["passed"]
    net = _keras_model(keras, tmp_path / "m.weights.h5")
    x = make_inputs(module, [InputSpec.parse(spec or "8x4")], seed=1)[0]
    with torch.no_grad():
        want = module(x).numpy()
    channels_last = x.dim() >= 3 and x.is_floating_point()        # (B, C, *S) -> (B, *S, C)
    keras_x = x.permute(0, *range(2, x.dim()), 1) if channels_last else x
    got = keras.ops.convert_to_numpy(net(keras_x.numpy(), training=False))
    assert got.shape == want.shape and np.abs(got - want).max() <= KERAS_ATOL


def test_convert_with_a_factory_writes_the_keras_layout(keras, user_folder):
    """The bar of the issue: a plain Sequential from the current folder, safetensors -> .weights.h5."""
    _modelkit("convert", "make.safetensors", "m.weights.h5", "--arch", "user_model:make", "--input-shape", "1x3x8x8")
    module = _weights_module(user_folder, "make")
    net = _keras_model(keras, user_folder / "m.weights.h5")
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        want = module(x).numpy()
    got = keras.ops.convert_to_numpy(net(x.permute(0, 2, 3, 1).numpy(), training=False))
    assert np.abs(got - want).max() <= KERAS_ATOL


@pytest.mark.parametrize(("module", "message"), [
    (nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Upsample(scale_factor=2)), r"layer 2 \(Upsample\) has no Keras"),
    (nn.Sequential(nn.Linear(4, 4), nn.GELU(approximate="tanh")), r"layer 1 \(GELU\).*approximate='tanh'"),
    (nn.Sequential(nn.Conv2d(1, 2, 3, stride=2, padding=1)), r"layer 0 \(Conv2d\).*padding=\(1, 1\)"),
    (nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.PReLU())), r"layer 1\.1 \(PReLU\)"),
    (_Tagger(), r"_Tagger is not an nn.Sequential"),
])
def test_the_first_layer_without_keras_counterpart_is_named(module, message, tmp_path):
    given = ["1x1x6x6"] if isinstance(module[0] if isinstance(module, nn.Sequential) else None, nn.Conv2d) else None
    with pytest.raises(UnsupportedConversionError, match=message) as caught:
        modelkit.export(module, tmp_path / "m.weights.h5", example_inputs=given)
    assert "\n" not in str(caught.value) and not (tmp_path / "m.weights.h5").exists()


def test_without_keras_name_an_unmapped_module_keeps_the_modelkit_group(tmp_path):
    net = nn.Sequential(nn.Linear(4, 4), nn.PReLU())
    assert modelkit.export(net, tmp_path / "m.h5").verify["passed"]
    assert set(modelkit.load(tmp_path / "m.h5").tensors) == set(net.state_dict())


def test_a_module_that_fails_on_its_example_inputs_says_so_in_one_line(user_folder):
    result = CliRunner().invoke(main, ["convert", "Tagger.safetensors", "t.onnx", "--arch", "user_model:Tagger",
                                       "--input-shape", "ids=2x7:int64", "--input-shape", "scale=3"])
    assert result.exit_code == 2
    assert "Tagger fails on the example inputs (ids=2x7:int64, scale=3:float32)" in result.stderr
    assert not (user_folder / "t.onnx").exists()


class _FixedBatch(nn.Module):
    def forward(self, x):
        return x.reshape(2, 3).sum(1)           # pins axis 0 to 2


def test_a_named_axis_the_exporter_fixes_is_an_error(tmp_path):
    with pytest.raises(UnsupportedConversionError, match="torch.onnx.export failed|fixed axes"):
        modelkit.export(_FixedBatch(), tmp_path / "f.onnx", example_inputs="x=2x3", dynamic=["x:0"])
    assert not (tmp_path / "f.onnx").exists()


@pytest.mark.parametrize(("reference", "message"), [
    ("no_such_module_here:make", "cannot import it .*current directory"),
    ("user_model:nothing", "cannot import it"),
    ("user_model", "expected a registered model"),
])
def test_a_factory_that_is_not_there_says_where_it_was_looked_for(user_folder, reference, message):
    with pytest.raises(ConfigError, match=message):
        load_factory(reference)
