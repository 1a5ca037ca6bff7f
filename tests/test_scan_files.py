"""Real files written by real libraries scan without a DANGEROUS finding; crafted containers are flagged; fuzzing.

Benign files come from torch.save, torch.jit.save, numpy, safetensors, torch.onnx.export, gguf's
GGUFWriter, h5py and Keras. Malicious containers are built from bytes here and only ever scanned.
"""
from __future__ import annotations

import io
import json
import os
import pickle
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
from modelkit.testing.payloads import Reduce, onnx_external_model, safetensors_bytes, zip_bytes

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
