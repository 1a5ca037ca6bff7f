"""TorchScript: scripted or traced archives that run like eager, and weights read without running code."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import warnings
import zipfile

import pytest
import torch

import modelkit
from modelkit.checkpoint import Checkpoint
from modelkit.errors import ConfigError, FormatError, UnsafeFileError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions, detect_format, load_format
from modelkit.models import build, load_model_module

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


def _zip_archive(path, data_pkl: bytes) -> None:
    """A TorchScript-shaped zip around a given data.pkl."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/constants.pkl", pickle.dumps((), protocol=2))
        zf.writestr("archive/code/__torch__/m.py", "class M(Module):\n  pass\n")
        zf.writestr("archive/version", "3\n")


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
    with pytest.raises(UnsupportedConversionError, match="pass example_inputs"):
        ts.write(ckpt, tmp_path / "u.ts", WriteOptions(module=_Unscriptable()))


def test_weights_that_do_not_fit_the_arch_are_refused(tmp_path):
    ckpt = Checkpoint.from_module(build("mlp", seed=0))
    wrong = Checkpoint(dict(ckpt.tensors), {}, modelkit.ArchSpec("mlp", {"hidden": [5]}))
    with pytest.raises(ConfigError, match="do not fit"):
        modelkit.save(wrong, tmp_path / "m.ts")
    assert list(tmp_path.iterdir()) == []
