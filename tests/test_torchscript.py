"""TorchScript: scripted or traced archives that run like eager, and weights read without running code."""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import subprocess
import sys
import types
import warnings
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch

import modelkit
from modelkit.checkpoint import Checkpoint
from modelkit.errors import ConfigError, FormatError, UnsafeFileError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions, detect_format, load_format
from modelkit.models import build, load_model_module
from modelkit.storage.dtypes import to_numpy

ts = load_format("torchscript")     # modelkit.converters.torchscript
pth = load_format("pth")

# Largest |eager - ScriptModule| on the reference models (float32, CPU), pinned as measured:
# 2026-11-21, torch 2.13.0+cpu, 1 and 2 threads, mlp/cnn/tinylm in the small test configs and the
# defaults, 6 seeds x batch 1/3/8, three calls each: 0.0 for all three (scripted or traced, the
# archive runs the same ATen kernels in the same order as eager).
ATOL = 0.0
EXPECTED_EXPORT = {"mlp": "script", "cnn": "script", "tinylm": "trace"}   # tinylm keeps a config dataclass


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_round_trip_is_bit_exact_and_keeps_arch_and_metadata(small_model, model_name, tmp_path):
    ckpt = Checkpoint.from_module(small_model, metadata={"note": "hello"})
    path = modelkit.save(ckpt, tmp_path / "m.ts")
    before = _digest(path)
    assert detect_format(path) == "torchscript" and not pth.detect(path)
    renamed = path.rename(tmp_path / "m.pt")                          # .pt is claimed by pth too
    assert detect_format(renamed) == "torchscript"
    back = modelkit.load(renamed)
    assert back.arch == ckpt.arch
    assert back.metadata["note"] == "hello"
    assert back.metadata[ts.EXPORT_KEY] == EXPECTED_EXPORT[model_name]
    state = back.materialize()
    assert list(state) == list(small_model.state_dict())
    for name, tensor in small_model.state_dict().items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    assert _digest(renamed) == before                                 # reading never writes


def test_scripted_or_traced_is_reported(small_model, model_name, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="modelkit"):
        path = modelkit.save(Checkpoint.from_module(small_model), tmp_path / "m.ts")
    how = EXPECTED_EXPORT[model_name]
    with zipfile.ZipFile(path) as zf:
        info = json.loads(zf.read(f"archive/extra/{ts.EXTRA_NAME}"))
    assert info["export"] == how and info["format"] == "modelkit.torchscript/1"
    assert info["state_dict"] == list(small_model.state_dict())
    if how == "script":
        assert "scripted with torch.jit.script" in caplog.text
    else:
        assert "torch.jit.script failed" in caplog.text and "traced it with example inputs" in caplog.text


def test_outputs_match_eager_within_the_pinned_tolerance(small_model, model_name, tmp_path):
    path = modelkit.save(Checkpoint.from_module(small_model), tmp_path / "m.ts")
    scripted = ts.runnable(path, ReadOptions(trust=True))
    assert isinstance(scripted, torch.jit.ScriptModule)
    make = load_model_module(model_name).example_inputs
    for seed, batch in ((0, 1), (1, 3), (2, 5)):
        err = modelkit.assert_same_outputs(small_model, scripted, make(batch, seed=seed), atol=ATOL)
        assert err <= ATOL


def test_convert_verifies_by_running_the_archive(tmp_path):
    model = build("cnn", {"channels": [4, 8], "hidden": 16}, seed=0)
    source = modelkit.save(Checkpoint.from_module(model), tmp_path / "cnn.safetensors")
    report = modelkit.convert(source, tmp_path / "cnn.ts", to="torchscript")
    assert report.verify["method"] == "outputs" and report.verify["max_abs_err"] <= ATOL
    back = modelkit.convert(tmp_path / "cnn.ts", tmp_path / "back.safetensors")  # weights only: no trust needed
    assert back.verify["passed"]


def test_weights_read_without_trust_and_without_torch_jit(small_model, tmp_path, monkeypatch):
    path = modelkit.save(Checkpoint.from_module(small_model), tmp_path / "m.ts")

    def refuse(*args, **kwargs):
        raise AssertionError("reading weights must not load TorchScript code")

    monkeypatch.setattr(torch.jit, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    state = modelkit.load(path).materialize()                         # trust=False
    assert all(torch.equal(state[k], v) for k, v in small_model.state_dict().items())
    rebuilt = modelkit.load_module(path)                              # eager, from the ArchSpec
    inputs = load_model_module(type(small_model).arch).example_inputs(2)
    modelkit.assert_same_outputs(small_model, rebuilt, inputs)


def test_runnable_needs_trust(tmp_path):
    path = modelkit.save(Checkpoint.from_module(build("mlp", seed=0)), tmp_path / "m.ts")
    with pytest.raises(UnsupportedConversionError, match="executes the code inside it; pass --trust"):
        ts.runnable(path)
    assert callable(ts.runnable(path, ReadOptions(trust=True)))


def test_archives_from_plain_torch_jit_save_read_by_attribute_names(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    net.register_buffer("scale", torch.tensor(2.0))
    path = tmp_path / "foreign.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(net), str(path))
    back = modelkit.load(path)
    assert back.arch is None and ts.EXPORT_KEY not in back.metadata
    state = back.materialize()
    assert sorted(state) == sorted(net.state_dict())
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())


def test_tied_weights_come_back_as_aliases(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    net[1].weight = net[0].weight
    path = tmp_path / "tied.ts"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(net), str(path))
    assert json.loads(modelkit.load(path).metadata["modelkit.aliases"]) == {"1.weight": "0.weight"}


def _zip_archive(path, data_pkl: bytes, records: dict[str, bytes] | None = None) -> None:
    """A TorchScript-shaped zip around a given data.pkl (and storage records data/<key>)."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/constants.pkl", pickle.dumps((), protocol=2))
        zf.writestr("archive/code/__torch__/m.py", "class M(Module):\n  pass\n")
        zf.writestr("archive/version", "3\n")
        for key, data in (records or {}).items():
            zf.writestr(f"archive/data/{key}", data)


class _Payload:
    """Pickles as a call to os.getpid (harmless, and never called: dumping is safe, loading is not)."""

    def __reduce__(self):
        return (os.getpid, ())


def test_data_pkl_calling_the_os_is_refused_by_the_scanner_gate_even_with_trust(tmp_path):
    path = tmp_path / "odd.pt"
    _zip_archive(path, pickle.dumps({"x": _Payload()}, protocol=2))
    assert ts.detect(path)
    with pytest.raises(UnsafeFileError, match=r"refused: pickle.global.denied posix\.getpid"):
        modelkit.load(path, trust=True)


class _Unusual:
    """Pickles as a call to a harmless standard-library function the scanner does not know."""

    def __reduce__(self):
        import colorsys

        return (colorsys.rgb_to_hsv, (0.1, 0.2, 0.3))


def test_data_pkl_globals_outside_the_allowlist_are_refused_by_the_weights_only_reader(tmp_path):
    path = tmp_path / "odd.pt"
    _zip_archive(path, pickle.dumps({"x": _Unusual()}, protocol=2))
    with pytest.raises(FormatError, match=r"data.pkl names colorsys\.rgb_to_hsv, which the weights-only reader does not accept"):
        modelkit.load(path, trust=True)                              # and then the restricted reader refuses it


def test_shared_submodule_trees_are_walked_in_bounded_time(tmp_path):
    """Each level holds the previous one twice: 2**30 module paths from a 1 KB data.pkl."""
    new_object = b"c__torch__.m\nM\n)\x81"                           # GLOBAL, EMPTY_TUPLE, NEWOBJ
    data = b"\x80\x02" + new_object + b"}bq\x00"                       # level 0: empty state, memo 0
    for level in range(1, 31):
        prev = bytes([0x68, level - 1])                                  # BINGET level-1
        state = b"}(X\x01\x00\x00\x00a" + prev + b"X\x01\x00\x00\x00b" + prev + b"u"
        data += new_object + state + b"b" + bytes([0x71, level])          # BUILD, BINPUT level
    path = tmp_path / "dag.pt"
    _zip_archive(path, data + b".")
    with pytest.raises(FormatError, match="module paths"):
        modelkit.load(path)


def test_written_file_does_not_warn_about_deprecation(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)           # torch 2.13 deprecates torch.jit.*
        path = modelkit.save(Checkpoint.from_module(build("mlp", seed=0)), tmp_path / "m.ts")
        ts.runnable(path, ReadOptions(trust=True))


def test_extra_file_is_readable_by_torch_jit_load(tmp_path):
    path = modelkit.save(Checkpoint.from_module(build("mlp", seed=0), metadata={"note": "x"}), tmp_path / "m.ts")
    extra = {ts.EXTRA_NAME: ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.load(str(path), _extra_files=extra)                  # our own benign file
    info = json.loads(extra[ts.EXTRA_NAME])
    assert info["metadata"] == {"note": "x"} and json.loads(info["arch"])["name"] == "mlp"


class _Unscriptable(torch.nn.Module):
    """Keeps a plain Python object on self, which torch.jit.script cannot compile."""

    def __init__(self):
        super().__init__()
        self.settings = {"scale": 2.0, "names": object()}
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.linear(x) * self.settings["scale"]


def test_unscriptable_module_traces_with_given_inputs(tmp_path):
    module = _Unscriptable().eval()
    report = modelkit.export(module, tmp_path / "u.ts", example_inputs=torch.randn(2, 3))
    assert report.verify["passed"]
    assert modelkit.load(tmp_path / "u.ts").metadata[ts.EXPORT_KEY] == "trace"


def test_unscriptable_module_without_inputs_says_what_to_pass(tmp_path):
    ckpt = Checkpoint.from_module(_Unscriptable())
    with pytest.raises(UnsupportedConversionError, match="example_inputs="):
        ts.write(ckpt, tmp_path / "u.ts", WriteOptions(module=_Unscriptable()))


def test_weights_that_do_not_fit_the_arch_are_refused(tmp_path):
    ckpt = Checkpoint.from_module(build("mlp", seed=0))
    wrong = Checkpoint(dict(ckpt.tensors), {}, modelkit.ArchSpec("mlp", {"hidden": [5]}))
    with pytest.raises(ConfigError, match="do not fit"):
        modelkit.save(wrong, tmp_path / "m.ts")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# The weights reader (modelkit.parse.torch_format.read_script) against torch.jit.load, and without torch.

class _Tied(torch.nn.Module):
    """float32 and bf16 parameters, a strided buffer and a tied weight."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6, 4, bias=False)
        self.head.weight = torch.nn.Parameter(torch.randn(4, 6, generator=g))
        self.tail = torch.nn.Linear(6, 4, bias=False)
        self.tail.weight = self.head.weight                                    # tied
        self.norm = torch.nn.LayerNorm(4).to(torch.bfloat16)
        self.register_buffer("mix", torch.randn(3, 5, generator=g).t())       # a strided view

    def forward(self, x):
        h = self.embed(x)
        return self.norm((self.head(h) + self.tail(h)).to(torch.bfloat16)).float() + self.mix.sum()


def _jit_archive(path, how: str):
    module = _Tied().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = torch.jit.script(module) if how == "script" else torch.jit.trace(module, torch.randn(2, 4))
        torch.jit.save(compiled, str(path))
        loaded = torch.jit.load(str(path)).state_dict()                  # our own benign archive
    return loaded


@pytest.mark.parametrize("how", ["script", "trace"])
def test_weights_equal_torch_jit_load_bit_for_bit(tmp_path, how):
    path = tmp_path / f"{how}.pt"
    expected = _jit_archive(path, how)
    ckpt = ts.read(path)
    assert sorted(ckpt.tensors) == sorted(expected)
    for name, tensor in expected.items():
        got = ckpt.tensors[name]
        assert got.dtype.torch == tensor.dtype and got.shape == tuple(tensor.shape), name
        assert np.array_equal(got.array(), to_numpy(tensor.contiguous())), name
        assert torch.equal(got.load(), tensor), name
    assert {n for n in expected if expected[n].dtype == torch.bfloat16} == {"norm.weight", "norm.bias"}
    assert json.loads(ckpt.metadata["modelkit.aliases"]) == {"tail.weight": "head.weight"}
    assert ckpt.tensors["mix"].span is None and ckpt.tensors["embed.weight"].span is not None
    span = ckpt.tensors["embed.weight"].span                              # the bytes as they lie in the file
    with open(path, "rb") as f:
        f.seek(span.offset)
        assert f.read(span.nbytes) == to_numpy(expected["embed.weight"]).tobytes()


_READ_WITHOUT_TORCH = """
import hashlib, json, sys
sys.modules["torch"] = None
from pathlib import Path
import modelkit.converters.torchscript as ts
ckpt = ts.read(Path(sys.argv[1]))
assert "torch" not in sys.modules or sys.modules["torch"] is None
print(json.dumps({name: hashlib.sha256(t.array().tobytes()).hexdigest() for name, t in ckpt.tensors.items()}))
"""


def test_read_needs_no_torch(tmp_path):
    path = tmp_path / "m.pt"
    expected = _jit_archive(path, "script")
    result = subprocess.run([sys.executable, "-c", _READ_WITHOUT_TORCH, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {name: hashlib.sha256(to_numpy(t.contiguous()).tobytes()).hexdigest()
                                         for name, t in expected.items()}


# Crafted data.pkl: objects of `__torch__.m` classes (importable only while a test pickles them, never
# unpickled) with tensors pickled as torch writes them.

class _Module:
    """Pickles as TorchScript writes a module: NEWOBJ of __torch__.m.Module, BUILD with its attributes."""

    __module__ = "__torch__.m"
    __qualname__ = "Module"

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


class _Stateful(_Module):
    """A TorchScript class with its own __getstate__: its BUILD state is a tuple."""

    __module__ = "__torch__.m"
    __qualname__ = "Stateful"

    def __getstate__(self):
        return tuple(self.__dict__.values())


class _Storage:
    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Tensor:
    def __init__(self, storage: _Storage, size: tuple, stride: tuple) -> None:
        self.args = (storage, 0, size, stride, False, OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel) if isinstance(obj, _Storage) else None


@pytest.fixture
def crafted(tmp_path, monkeypatch):
    """Writes a TorchScript-shaped archive around a crafted module tree and returns its path."""
    package, module = types.ModuleType("__torch__"), types.ModuleType("__torch__.m")
    module.Module, module.Stateful = _Module, _Stateful
    monkeypatch.setitem(sys.modules, "__torch__", package)
    monkeypatch.setitem(sys.modules, "__torch__.m", module)

    def write(root, records):
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=2).dump(root)
        path = tmp_path / "crafted.pt"
        _zip_archive(path, buffer.getvalue(), records)
        return path

    return write


_SIX = np.arange(6, dtype="<f4").tobytes()


def test_crafted_module_tree_reads(crafted):
    path = crafted(_Module(w=_Tensor(_Storage("0", 6), (2, 3), (3, 1)), sub=_Module(b=_Tensor(_Storage("0", 6),
                                                                                              (3,), (2,)))), {"0": _SIX})
    state = ts.read(path).materialize()
    assert list(state) == ["w", "sub.b"]
    assert state["w"].tolist() == [[0, 1, 2], [3, 4, 5]] and state["sub.b"].tolist() == [0, 2, 4]


@pytest.mark.parametrize(("root", "records", "message"), [
    (_Stateful(w=_Tensor(_Storage("0", 6), (6,), (1,))), {"0": _SIX}, "data.pkl does not hold a module"),
    (_Module(sub=_Stateful(w=_Tensor(_Storage("0", 6), (6,), (1,)))), {"0": _SIX},
     r"module 'sub' \(__torch__.m.Stateful\) keeps its tensors in a tuple state"),
    (_Module(w=_Tensor(_Storage("0", 8), (8,), (1,))), {"0": _SIX},
     r"storage '0' claims 8 float32 elements \(32 bytes\) but its record holds 24 bytes"),
    (_Module(w=_Tensor(_Storage("0", 6), (4,), (2,))), {"0": _SIX}, r"reaches element 6 of storage '0'"),
    (_Module(w=_Tensor(_Storage("0", 6), (2, 3), (3,))), {"0": _SIX}, r"size \[2, 3\] and stride \[3\] differ"),
    (_Module(w=_Tensor(_Storage("1", 6), (6,), (1,))), {"0": _SIX}, r"storage '1' has no record archive/data/1"),
])
def test_crafted_archives_are_format_errors_naming_the_file(crafted, root, records, message):
    path = crafted(root, records)
    with pytest.raises(FormatError, match=message) as error:
        ts.read(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
