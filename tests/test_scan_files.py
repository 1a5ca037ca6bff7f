"""Real files written by real libraries scan without a DANGEROUS finding; crafted containers are flagged; fuzzing.

Benign files come from torch.save, torch.jit.save, numpy, safetensors, torch.onnx.export, gguf's
GGUFWriter, h5py and Keras. Malicious containers are built from bytes here and only ever scanned.
"""
from __future__ import annotations

import argparse
import enum
import http
import io
import json
import os
import pathlib
import pickle
import re
import struct
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from modelkit.models import build, load_model_module
from modelkit.scan import Severity, scan
from modelkit.testing import payloads
from modelkit.testing.payloads import Reduce, onnx_external_model, safetensors_bytes, zip_bytes

# The benign files are written with torch's own deprecated writers on purpose (TorchScript, the legacy ONNX
# exporter): what users hand around. Their deprecation notices are expected here, not news.
pytestmark = [pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:The feature will be removed:DeprecationWarning")]

SMALL = {"mlp": {}, "cnn": {"channels": [4, 8], "hidden": 16},
         "tinylm": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "max_position_embeddings": 64}}


def _no_danger(report, *, allowed_suspicious: set[str] = frozenset()) -> None:
    assert not report.errors, report.errors
    dangerous = [(f.rule, f.path, f.detail) for f in report.findings if f.severity == Severity.DANGEROUS]
    assert not dangerous, dangerous
    unexpected = {f.rule for f in report.findings if f.severity == Severity.SUSPICIOUS} - allowed_suspicious
    assert not unexpected, unexpected


@pytest.fixture(scope="module")
def benign(tmp_path_factory) -> Path:
    """One folder of benign files from real writers (built once for the module)."""
    out = tmp_path_factory.mktemp("benign")
    model = build("mlp", SMALL["mlp"], seed=0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 2)).sum().backward()
    opt.step()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    torch.save(model.state_dict(), out / "state_dict.pt")
    torch.save(opt.state_dict(), out / "adamw.pt")
    torch.save(sgd.state_dict(), out / "sgd.pth")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "epoch": 3, "step": np.int64(120), "loss": np.float32(0.25), "rng": torch.get_rng_state(),
                "np_rng": np.random.get_state(), "history": np.arange(5.0), "dtype": torch.bfloat16,
                "shape": torch.Size([2, 3]), "device": torch.device("cpu"), "extra": {"bf16": torch.ones(2).bfloat16(),
                                                                                     "i8": torch.ones(2, dtype=torch.int8)}},
               out / "training.ckpt")
    torch.save(model.state_dict(), out / "legacy.bin", _use_new_zipfile_serialization=False)
    for name, config in SMALL.items():
        module = build(name, config, seed=0).eval()
        torch.save(module.state_dict(), out / f"{name}.bin")
        try:
            scripted = torch.jit.script(module)
        except Exception:   # noqa: BLE001 - fall back to tracing models that do not script
            scripted = torch.jit.trace(module, load_model_module(name).example_inputs())
        torch.jit.save(scripted, out / f"{name}.ts.pt")
    np.save(out / "floats.npy", np.linspace(0, 1, 12).reshape(3, 4))
    np.save(out / "strings.npy", np.array(["a", "bc"]))
    np.savez(out / "arrays.npz", a=np.arange(3), b=np.ones((2, 2), dtype=np.float16))
    np.savez_compressed(out / "compressed.npz", a=np.arange(100))
    from safetensors.torch import save_file
    save_file(model.state_dict(), out / "model.safetensors", metadata={"format": "pt"})
    _write_gguf(out / "model.gguf", template=_LLAMA3_TEMPLATE)
    import h5py
    with h5py.File(out / "weights.h5", "w") as f:
        for key, value in model.state_dict().items():
            f.create_dataset(key, data=value.numpy())
        f.attrs["modelkit.arch"] = json.dumps({"name": "mlp"})
    return out


_LLAMA3_TEMPLATE = ("{% set loop_messages = messages %}{% set ns = namespace(found=false) %}"
                    "{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + "
                    "'<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def _write_gguf(path: Path, *, template: str | None = None, tensors: int = 2) -> None:
    import gguf
    writer = gguf.GGUFWriter(str(path), "llama")
    try:
        writer.add_block_count(1)
        writer.add_token_list(["<s>", "a", "b"])
        if template is not None:
            writer.add_chat_template(template)
        for i in range(tensors):
            writer.add_tensor(f"w{i}", np.arange(64, dtype=np.float32).reshape(8, 8))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def test_benign_files_have_no_dangerous_findings(benign):
    report = scan(benign)
    expected_files = sorted(p.name for p in benign.iterdir())
    assert sorted(Path(f.path).name for f in report.files) == expected_files
    _no_danger(report, allowed_suspicious={"torchscript.code"})
    formats = {Path(f.path).name: f.format for f in report.files}
    assert formats["state_dict.pt"] == "pth" and formats["legacy.bin"] == "pth" and formats["mlp.ts.pt"] == "torchscript"
    assert formats["model.gguf"] == "gguf" and formats["weights.h5"] == "hdf5" and formats["arrays.npz"] == "npz"
    no_pickle = {Path(f.path).name for f in report.findings if f.rule == "container.no_pickle"}
    assert {"model.safetensors", "model.gguf", "weights.h5"} <= no_pickle


def test_torchscript_archives_need_trust_but_are_not_dangerous(benign):
    for name in SMALL:
        report = scan(benign / f"{name}.ts.pt")
        assert {f.rule for f in report.findings if f.severity} == {"torchscript.code"}
        assert any("code files" in line for line in report.files[0].examined)


def test_onnx_export_is_clean(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = tmp_path / "linear.onnx"
    torch.onnx.export(model, (torch.randn(1, 3),), str(path), dynamo=False)
    report = scan(path)
    _no_danger(report)
    assert report.files[0].format == "onnx"
    import onnx
    loaded = onnx.load(str(path))
    onnx.save_model(loaded, str(tmp_path / "ext.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.data", size_threshold=0)
    report = scan(tmp_path / "ext.onnx")
    _no_danger(report)
    assert "with external data" in report.files[0].examined[0]


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_keras_without_lambda_is_clean_and_with_lambda_is_dangerous(tmp_path, suffix, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras")
    clean = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="relu"), keras.layers.Dense(1)])
    clean.save(tmp_path / f"clean{suffix}")
    _no_danger(scan(tmp_path / f"clean{suffix}"))
    evil = keras.Sequential([keras.Input((3,)), keras.layers.Lambda(lambda x: x * 2)])
    evil.save(tmp_path / f"evil{suffix}")
    report = scan(tmp_path / f"evil{suffix}")
    assert report.worst == Severity.DANGEROUS and "keras.lambda" in {f.rule for f in report.findings}


def test_joblib_dump_is_examined_through_its_inline_arrays(tmp_path):
    joblib = pytest.importorskip("joblib")
    joblib.dump({"a": np.arange(5.0), "s": np.array(["x", "yy"]), "o": np.array([{"k": 1}, None], dtype=object)},
                tmp_path / "m.joblib")
    _no_danger(scan(tmp_path / "m.joblib"))
    joblib.dump({"a": np.arange(50.0)}, tmp_path / "z.joblib", compress=3)
    _no_danger(scan(tmp_path / "z.joblib"))


# ---------------------------------------------------------------------------------------------
# Malicious containers.

def _scan_bytes(tmp_path: Path, data: bytes, name: str):
    path = tmp_path / name
    path.write_bytes(data)
    return scan(path)


def _rules(report, severity=Severity.DANGEROUS) -> set[str]:
    return {f.rule for f in report.findings if f.severity >= severity}


def test_zip_path_traversal(tmp_path):
    data = zip_bytes({"archive/data.pkl": pickle.dumps({}, protocol=2), "../../etc/cron.d/x": b"* * * * * id\n",
                 "/abs/path": b"x"})
    assert "zip.path_traversal" in _rules(_scan_bytes(tmp_path, data, "t.zip"))


def test_zip_bomb_is_not_expanded(tmp_path):
    data = zip_bytes({"archive/data.pkl": pickle.dumps({}, protocol=2), "bomb.bin": b"\0" * (200 << 20)},
                compression=zipfile.ZIP_DEFLATED)
    started = time.perf_counter()
    report = _scan_bytes(tmp_path, data, "bomb.pt")
    assert "zip.bomb" in _rules(report) and time.perf_counter() - started < 5


def test_nested_archive_is_scanned(tmp_path):
    inner = zip_bytes({"archive/data.pkl": pickle.dumps(Reduce(os.system, "true"), protocol=2)})
    report = _scan_bytes(tmp_path, zip_bytes({"inner.pt": inner}), "outer.zip")
    assert {"pickle.global.denied"} <= _rules(report)
    assert "zip.nested_archive" in _rules(report, Severity.SUSPICIOUS)


def test_tar_traversal_and_pickle_member(tmp_path):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in (("../escape.txt", b"x"), ("pickle", pickle.dumps(Reduce(os.system, "true"), protocol=2))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert {"tar.path_traversal", "pickle.global.denied"} <= _rules(_scan_bytes(tmp_path, out.getvalue(), "old.tar"))


def test_onnx_external_data_escape(tmp_path):
    import onnx
    from onnx import TensorProto, helper
    tensor = helper.make_tensor("w", TensorProto.FLOAT, [1], [0.0])
    for location, why in (("../../etc/passwd", "'..'"), ("/etc/passwd", "absolute")):
        tensor.ClearField("float_data")
        tensor.data_location = TensorProto.EXTERNAL
        del tensor.external_data[:]
        entry = tensor.external_data.add()
        entry.key, entry.value = "location", location
        graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], [tensor])
        path = tmp_path / "escape.onnx"
        path.write_bytes(helper.make_model(graph).SerializeToString())
        report = scan(path)
        assert "onnx.external_data.escape" in _rules(report), why
    (tmp_path / "outside").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"\0" * 4)
    os.symlink(tmp_path / "outside" / "secret", tmp_path / "model" / "weights.bin")
    entry.value = "weights.bin"
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], [tensor])
    (tmp_path / "model" / "m.onnx").write_bytes(helper.make_model(graph).SerializeToString())
    assert "onnx.external_data.escape" in _rules(scan(tmp_path / "model" / "m.onnx"))
    custom = helper.make_model(helper.make_graph([helper.make_node("Evil", ["x"], ["y"], domain="com.evil")], "g",
                                                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]),
                               opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.evil", 1)])
    onnx.save_model(custom, str(tmp_path / "custom.onnx"))
    assert "onnx.domain.custom" in _rules(scan(tmp_path / "custom.onnx"), Severity.SUSPICIOUS)


@pytest.mark.parametrize(("header", "data", "rule"), [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "safetensors.header.tensor"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8, "safetensors.header.tensor"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "safetensors.header.overlap"),
    ({"w": {"dtype": "EVIL", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "safetensors.header.tensor"),
], ids=["offsets-past-end", "dtype-x-shape", "overlap", "unknown-dtype"])
def test_malformedsafetensors_bytes(tmp_path, header, data, rule):
    assert rule in _rules(_scan_bytes(tmp_path, safetensors_bytes(header, data), "m.safetensors"))


def test_safetensors_length_larger_than_file_and_appended_pickle(tmp_path):
    lying = struct.pack("<Q", 1 << 40) + b'{"a":1}'
    report = _scan_bytes(tmp_path, lying + b" " * 16, "huge.safetensors")
    assert report.errors or "safetensors.header.length" in _rules(report)
    good = safetensors_bytes({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    report = _scan_bytes(tmp_path, good + pickle.dumps(Reduce(os.system, "true"), protocol=2), "poly.safetensors")
    assert {"polyglot.appended", "pickle.global.denied"} <= _rules(report)


def test_malformed_gguf_headers(tmp_path):
    path = tmp_path / "m.gguf"
    _write_gguf(path)
    good = path.read_bytes()
    huge_kv = good[:16] + struct.pack("<Q", 1 << 60) + good[24:]          # kv_count claims 2^60 entries
    assert "gguf.header.malformed" in _rules(_scan_bytes(tmp_path, huge_kv, "kv.gguf"))
    truncated = good[: len(good) - 64]                                    # last tensor runs past the end
    assert "gguf.header.malformed" in _rules(_scan_bytes(tmp_path, truncated, "cut.gguf"))
    bad_version = good[:4] + struct.pack("<I", 99) + good[8:]
    assert "gguf.header.malformed" in _rules(_scan_bytes(tmp_path, bad_version, "v.gguf"))


@pytest.mark.parametrize("template", [
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__['os'].system('id') }}",
    "{{ namespace.__init__.__globals__.os.system('id') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os }}",
    "{{ lipsum|attr('\\x5f\\x5fglobals\\x5f\\x5f') }}",
], ids=["cycler", "joiner", "namespace", "subclasses", "template-reference", "escaped-attr"])
def test_gguf_chat_template_injection(tmp_path, template):
    path = tmp_path / "t.gguf"
    _write_gguf(path, template=template)
    report = scan(path)
    assert "gguf.chat_template.injection" in _rules(report)


def test_tokenizer_config_chat_template_injection(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ cycler.__init__.__globals__ }}"}))
    assert "gguf.chat_template.injection" in _rules(scan(tmp_path / "tokenizer_config.json"))


def test_chat_template_jinja_is_read_as_a_template(tmp_path):
    """A Hugging Face folder's chat_template.jinja (transformers 5 keeps the template there): a benign one is
    clean, not malformed JSON although it starts with "{%"; an injection is dangerous."""
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    report = scan(tmp_path / "chat_template.jinja")
    assert report.findings == [] and report.files[0].format == "chat template"
    (tmp_path / "chat_template.jinja").write_text("{% if 1 %}{{ cycler.__init__.__globals__.os.popen('id') }}{% endif %}")
    assert "gguf.chat_template.injection" in _rules(scan(tmp_path / "chat_template.jinja"))


def test_polyglot_pickle_that_is_also_azip_bytes(tmp_path):
    zipped = zip_bytes({"archive/data.pkl": pickle.dumps({}, protocol=2)})
    report = _scan_bytes(tmp_path, pickle.dumps(Reduce(os.system, "true"), protocol=2) + zipped, "poly.pt")
    assert {"polyglot.zip", "pickle.global.denied"} <= _rules(report)


def test_npy_header_lies_about_size(tmp_path):
    buffer = io.BytesIO()
    np.save(buffer, np.arange(4.0))
    data = buffer.getvalue().replace(b"(4,)", b"(9,)")
    assert "npy.header.size_mismatch" in _rules(_scan_bytes(tmp_path, data, "a.npy"))


def test_unrecognised_and_empty_files_are_errors(tmp_path):
    for name, data in (("empty.bin", b""), ("random.bin", bytes(range(256)) * 8)):
        report = _scan_bytes(tmp_path, data, name)
        assert report.errors and not report.ok()


def test_tensor_data_is_never_read(tmp_path, monkeypatch):
    """Storages are skipped by name: a scan reads the pickle and directory, not the tensor bytes."""
    torch.save({"w": torch.zeros(1 << 20)}, tmp_path / "big.pt")    # 4 MiB of tensor data
    from modelkit.scan import containers
    read = []
    original = containers._read_member
    monkeypatch.setattr(containers, "_read_member", lambda buf, d, info, limit: read.append(info.filename)
                        or original(buf, d, info, limit))
    _no_danger(scan(tmp_path / "big.pt"))
    assert not any("/data/" in name for name in read), read


def test_a_folder_with_onnx_external_data_scans_clean(tmp_path):
    """The external data file is raw bytes the ONNX model names: part of a clean folder scan."""
    (tmp_path / "m.onnx").write_bytes(onnx_external_model("m.onnx.data", length=4))
    (tmp_path / "m.onnx.data").write_bytes(bytes(range(16)) * 4)
    report = scan(tmp_path)
    assert report.errors == [], report.errors
    assert {f.format for f in report.files} == {"onnx", "tensor data"}


# ---------------------------------------------------------------------------------------------
# PT2 archives, TorchScript of common layers, and the scanner gaps of issue 17.

def test_pt2_exports_of_the_zoo_scan_clean(zoo_pt2, monkeypatch):
    from modelkit.scan import containers
    read = []
    original = containers._read_member
    monkeypatch.setattr(containers, "_read_member", lambda buf, d, info, limit: read.append(info.filename)
                        or original(buf, d, info, limit))
    for name, (_, path) in zoo_pt2.items():
        report = scan(path)
        _no_danger(report)
        assert report.files[0].format == "pt2" and not report.findings, (name, report.findings)
        assert any("PT2 archive" in line and "tensor storages skipped unread" in line for line in report.files[0].examined)
    assert read and not any("/data/weights/weight_" in n or "/data/constants/tensor_" in n for n in read), read


_HOSTILE = payloads.hostile_corpus()
_DANGEROUS = {  # hostile files of issue 17 -> the rule that must flag each one DANGEROUS
    "aoti.pt2": "pt2.aotinductor", "shared-library.pt2": "archive.native_code",
    "pickled-constant.pt2": "pickle.global.denied", "opaque-object.pt2": "pickle.global.denied",
    "sample-inputs.pt2": "pickle.global.denied", "escape.pt2": "zip.path_traversal",
    "config-escape.pt2": "pt2.config.path", "target.pt2": "pt2.target.dangerous",
    "load-target.pt2": "pt2.target.dangerous", "file-op.pt2": "pt2.target.dangerous",
    "torch-and-pt2.pt": "pt2.target.dangerous", "nested-target.pt2": "pt2.target.dangerous",
    "raise-class.ts": "torchscript.code.dangerous", "model.7z.pt": "archive.unsupported",
    "rar-member.pt": "archive.unsupported",
}


@pytest.mark.parametrize("name", sorted(_DANGEROUS))
def test_hostile_pt2_and_archives_are_dangerous(tmp_path, name):
    report = _scan_bytes(tmp_path, _HOSTILE[name], name)
    assert _DANGEROUS[name] in _rules(report), (name, report.findings)


def test_pt2_pickled_members_are_walked_and_raw_ones_skipped(tmp_path):
    benign = payloads.pt2_zip(constants={"c": "tensor_0"}, pickled=frozenset({"c"}),
                              extra={"data/constants/tensor_0": pickle.dumps({"a": 1}, protocol=2)})
    report = _scan_bytes(tmp_path, benign, "pickled.pt2")
    assert not _rules(report, Severity.SUSPICIOUS) and any("pickle stream" in e for e in report.files[0].examined)
    # a raw member whose bytes happen to be a pickle is read raw by torch: never unpickled, so no finding
    raw = payloads.pt2_zip(extra={"data/weights/weight_0": payloads.system_pickle()})
    assert not _rules(_scan_bytes(tmp_path, raw, "raw.pt2"), Severity.SUSPICIOUS)
    # ... unless another entry names the same member as a pickle
    both = payloads.pt2_zip(weights={"w": "weight_0", "v": "weight_0"}, pickled=frozenset({"v"}),
                            extra={"data/weights/weight_0": payloads.system_pickle()})
    assert "pickle.global.denied" in _rules(_scan_bytes(tmp_path, both, "both.pt2"))


def test_pt2_custom_operators_and_objects_need_trust(tmp_path):
    report = _scan_bytes(tmp_path, payloads.pt2_zip(nodes=["torch.ops.mylib.fused.default"],
                                                    constants={"obj": "opaque_obj_0"},
                                                    extra={"data/constants/opaque_obj_0": pickle.dumps(1)}), "c.pt2")
    assert {"pt2.custom_op", "pt2.opaque_object"} <= _rules(report, Severity.SUSPICIOUS) and not _rules(report)
    from modelkit.scan import needs_trust
    assert all(needs_trust(f) for f in report.findings if f.severity == Severity.SUSPICIOUS)


def _layers() -> dict[str, tuple[torch.nn.Module, tuple]]:
    torch.manual_seed(0)
    return {
        "batchnorm": (torch.nn.BatchNorm2d(3), (torch.randn(2, 3, 4, 4),)),
        "layernorm": (torch.nn.LayerNorm(8), (torch.randn(2, 8),)),
        "dropout": (torch.nn.Dropout(0.1), (torch.randn(2, 8),)),
        "attention": (torch.nn.MultiheadAttention(8, 2, batch_first=True), (torch.randn(1, 3, 8),) * 3),
        "lstm": (torch.nn.LSTM(4, 8, batch_first=True), (torch.randn(2, 3, 4),)),
        "transformer": (torch.nn.Transformer(8, 2, 1, 1, 16, batch_first=True), (torch.randn(1, 3, 8),) * 2),
    }


@pytest.fixture(scope="module")
def layer_archives(tmp_path_factory) -> list[Path]:
    """Scripted and traced TorchScript archives of common layers, as torch writes them."""
    import warnings

    out = tmp_path_factory.mktemp("layers")
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # torch.jit's deprecation and the tracer's notes
        for name, (module, inputs) in _layers().items():
            module.eval()
            for how in ("script", "trace"):
                compiled = (torch.jit.script(module) if how == "script"
                            else torch.jit.trace(module, inputs, check_trace=False))
                paths.append(out / f"{name}-{how}.pt")
                torch.jit.save(compiled, paths[-1])
    return paths


def test_torchscript_of_common_layers_scans_clean(layer_archives):
    """The BatchNorm false alarm (prim::RaiseException(..., "builtins.ValueError")) and its kin."""
    assert len(layer_archives) == 12
    for path in layer_archives:
        report = scan(path)
        assert report.files[0].format == "torchscript"
        assert {f.rule for f in report.findings} == {"torchscript.code"}, (path.name, report.findings)


@pytest.mark.parametrize("code", [
    'def f(x):\n  return os.system("true")\n',
    'def f(x):\n  s = "ok"\n  return torch.ops.aten.save(x, "/tmp/x")\n',
    'def f(x):\n  ops.prim.RaiseException("x", "subprocess.Popen")\n',
    'def f(x):\n  return "builtins." + builtins.eval("1")\n',
    "import os\ndef f(x):\n  return x\n",
])
def test_malicious_torchscript_code_stays_dangerous(tmp_path, code):
    report = _scan_bytes(tmp_path, payloads.torchscript_zip(code), "evil.pt")
    assert "torchscript.code.dangerous" in _rules(report), report.findings


def test_string_literals_are_data_in_torchscript_code(tmp_path):
    code = ('def f(x):\n  msg = "os.system(\'x\') and builtins.eval and import os"  # not os.system(msg)\n'
            '  ops.prim.RaiseException(msg, "builtins.RuntimeError")\n  return x\n')
    report = _scan_bytes(tmp_path, payloads.torchscript_zip(code), "ok.pt")
    assert not _rules(report), report.findings


class _Color(enum.Enum):
    RED = 1


_BENIGN_VALUES = {
    "path": pathlib.PurePosixPath("runs/exp1/ckpt"), "local_path": pathlib.Path("data"),
    "namespace": argparse.Namespace(lr=0.1, name="x"), "f64": np.float64(1.5), "i32": np.int32(3),
    "dtype": np.dtype("float32"), "scalar_type": np.float32, "bool": np.bool_(True), "regex_flag": re.IGNORECASE,
    "status": http.HTTPStatus.OK,
}


@pytest.mark.parametrize("name", sorted(_BENIGN_VALUES))
def test_benign_checkpoint_values_are_not_alarms(tmp_path, name):
    for protocol in (2, 4):
        data = pickle.dumps({"epoch": 3, name: _BENIGN_VALUES[name]}, protocol=protocol)
        report = _scan_bytes(tmp_path, data, f"{name}.pkl")
        assert not report.findings, (name, protocol, report.findings)


def test_enum_of_the_training_script_needs_trust_only(tmp_path):
    report = _scan_bytes(tmp_path, pickle.dumps({"mode": _Color.RED}, protocol=2), "enum.pkl")
    assert not _rules(report) and _rules(report, Severity.SUSPICIOUS)


@pytest.mark.parametrize("target", [
    ("logging", "FileHandler"), ("logging.handlers", "SocketHandler"), ("socketserver", "TCPServer"),
    ("gzip", "open"), ("bz2", "BZ2File"), ("lzma", "open"), ("wave", "open"), ("mailbox", "mbox"),
    ("py_compile", "compile"), ("imaplib", "IMAP4"), ("smtpd", "SMTPServer"), ("wsgiref.simple_server", "make_server"),
    ("linecache", "getline"), ("pipes", "Template"), ("xml.dom.minidom", "parse"), ("uuid", "getnode"),
])
def test_stdlib_constructors_that_touch_files_sockets_or_processes_are_dangerous(tmp_path, target):
    module, name = target
    data = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"X\x04\x00\x00\x00/tmpq\x00\x85R."
    assert "pickle.global.denied" in _rules(_scan_bytes(tmp_path, data, "x.pkl")), target


def test_onnx_external_data_scanned_alone_is_data(tmp_path):
    (tmp_path / "m.onnx").write_bytes(onnx_external_model("m.onnx.data", length=4))
    (tmp_path / "m.onnx.data").write_bytes(bytes(range(16)) * 4)
    report = scan(tmp_path / "m.onnx.data")
    assert report.errors == [] and [f.format for f in report.files] == ["tensor data"], report
    assert "m.onnx" in report.files[0].examined[0]
    (tmp_path / "other.bin").write_bytes(bytes(range(16)) * 4)           # named by no model: still an error
    assert scan(tmp_path / "other.bin").errors
