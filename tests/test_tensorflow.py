"""TensorFlow SavedModels and checkpoints: read without TensorFlow, bit-exact with what TensorFlow reads, scanned.

The files are TensorFlow 2.21's own (fixtures/tensorflow/generate.py, run in a separate venv): benign Keras
exports, a tf.Module, tf.train.Checkpoint files, and SavedModels whose graphs would read, write or list
files or call Python. reference.json holds the sha256 of every tensor as TensorFlow's reader returned it.
"""
from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

import modelkit
from modelkit.cli import main
from modelkit.errors import FormatError, UnsupportedConversionError
from modelkit.formats import detect_format
from modelkit.metadata import TF_KEYS_KEY, TF_SOURCE_KEY
from modelkit.scan import Severity, scan

BENIGN = ["dense_savedmodel", "conv_savedmodel", "module_savedmodel", "keras2_savedmodel", "module_ckpt", "keras_ckpt",
          "collide_ckpt", "tf1_ckpt"]
PREFIX = {"tf1_ckpt": "model.ckpt"}           # the others: ckpt-1
OP = "tensorflow.graph.op"
HOSTILE = {"py_function": ("EagerPyFunc", OP), "numpy_function": ("PyFunc", OP), "read_file": ("ReadFile", OP),
           "write_file": ("WriteFile", OP), "matching_files": ("MatchingFiles", OP), "nested_read": ("ReadFile", OP),
           "tf1_read_file": ("ReadFile", OP), "save_v2": ("SaveV2", OP), "print_to_file": ("PrintV2", OP),
           "keras2_lambda": ("Lambda", "keras.lambda")}


@pytest.fixture(scope="module")
def tf_dir(fixtures_dir):
    return fixtures_dir / "tensorflow"


def _source(tf_dir, name):
    folder = tf_dir / "benign" / name
    return folder if name.endswith("savedmodel") else folder / f"{PREFIX.get(name, 'ckpt-1')}.index"


def _prefix(name):
    return (f"benign/{name}/variables/variables" if name.endswith("savedmodel")
            else f"benign/{name}/{PREFIX.get(name, 'ckpt-1')}")


@pytest.mark.parametrize("name", BENIGN)
def test_tensors_are_bit_exact_with_what_tensorflow_reads(tf_dir, name):
    reference = json.loads((tf_dir / "reference.json").read_text())
    expected = reference["bundles"][_prefix(name)]
    ckpt = modelkit.load(_source(tf_dir, name))
    keys = json.loads(ckpt.metadata[TF_KEYS_KEY])["tensors"]
    covered = set()
    for tensor_name, tensor in ckpt.tensors.items():
        array = tensor.array()
        digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
        for key in [keys[tensor_name]["key"], *keys[tensor_name].get("also", [])]:
            assert expected[key]["sha256"] == digest, key
            assert expected[key]["shape"] == list(array.shape)
            covered.add(key)
    assert covered == set(expected)          # every tensor TensorFlow reads is there, under one name or another
    assert reference["tensorflow"] == "2.21.0"


def test_names_come_from_the_object_graph(tf_dir):
    dense = modelkit.load(tf_dir / "benign" / "dense_savedmodel")
    assert list(dense.tensors) == ["sequential/dense/kernel", "sequential/dense/bias",
                                   "sequential/dense_1/kernel", "sequential/dense_1/bias"]
    keys = json.loads(dense.metadata[TF_KEYS_KEY])["tensors"]
    assert keys["sequential/dense/kernel"]["key"] == "variables/0/.ATTRIBUTES/VARIABLE_VALUE"
    assert json.loads(dense.metadata[TF_SOURCE_KEY])[0]["tags"] == ["serve"]
    keras2 = modelkit.load(tf_dir / "benign" / "keras2_savedmodel")
    assert json.loads(keras2.metadata[TF_KEYS_KEY])["tensors"]["dense/kernel"]["key"] == \
        "layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE"
    collide = modelkit.load(tf_dir / "benign" / "collide_ckpt")     # two variables named "w": their object paths
    assert list(collide.tensors) == ["encoder/w", "decoder/w"]
    tf1 = modelkit.load(tf_dir / "benign" / "tf1_ckpt")             # no object graph: the keys are the names
    assert sorted(tf1.tensors) == ["global_step", "layer/kernel"]
    module = modelkit.load(tf_dir / "benign" / "module_ckpt")       # a folder holding one checkpoint
    assert {n: str(t.dtype) for n, t in module.tensors.items()} == {
        "w": "float32", "b": "float16", "bf": "bfloat16", "steps": "int64", "table": "float64"}


@pytest.mark.parametrize("path, fmt", [("benign/dense_savedmodel", "savedmodel"),
                                       ("benign/dense_savedmodel/saved_model.pb", "savedmodel"),
                                       ("benign/module_ckpt/ckpt-1.index", "tfcheckpoint"),
                                       ("benign/keras_ckpt", "tfcheckpoint")])
def test_detected_by_content(tf_dir, path, fmt):
    assert detect_format(tf_dir / path) == fmt


@pytest.mark.parametrize("name", BENIGN)
def test_benign_files_scan_clean(tf_dir, name):
    report = scan(tf_dir / "benign" / name, recursive=True)
    assert not report.errors and report.worst == Severity.SAFE, report.findings


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_savedmodels_are_dangerous_and_refused(tf_dir, name):
    report = scan(tf_dir / "hostile" / name / "saved_model.pb")     # the file the gate scans: it judges the folder
    flagged = [f for f in report.findings if f.severity == Severity.DANGEROUS]
    assert [(f.name, f.rule) for f in flagged] == [HOSTILE[name]]
    with pytest.raises(modelkit.errors.UnsafeFileError, match=HOSTILE[name][0]):
        modelkit.load(tf_dir / "hostile" / name)


def test_every_flagged_op_is_in_tensorflows_registry(tf_dir):
    from modelkit.scan import tf_ops

    ops = json.loads((tf_dir / "ops.json").read_text())
    ours = {*tf_ops.RISKY_OPS, *tf_ops.CHECKPOINT_OPS, *tf_ops.ATTR_CHECKS, *tf_ops.DEBUG_OPS}
    assert set(ops["in_registry"]) == ours and ops["not_in_registry"] == []
    assert ours <= tf_ops.known_ops()


@pytest.fixture
def module_copy(tf_dir, tmp_path):
    shutil.copytree(tf_dir / "benign" / "module_ckpt", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_a_damaged_tensor_fails_its_crc32c(module_copy):
    data = module_copy / "ckpt-1.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[3] ^= 0x40                                   # inside "w", the first tensor
    data.write_bytes(bytes(raw))
    ckpt = modelkit.load(module_copy)
    ckpt.tensors["b"].array()                        # the others are intact
    with pytest.raises(FormatError, match="crc32c"):
        ckpt.tensors["w"].array()


def test_a_cut_shard_is_one_line_at_read_and_suspicious_in_a_scan(module_copy):
    data = module_copy / "ckpt-1.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:60])
    with pytest.raises(FormatError, match="the shard has 60") as info:
        modelkit.load(module_copy)
    assert "\n" not in str(info.value)
    rules = {f.rule for f in scan(module_copy / "ckpt-1.index").findings}
    assert "tensorflow.shard.size" in rules


@pytest.mark.parametrize("name", ["dense_savedmodel", "module_ckpt"])
def test_converts_to_safetensors_and_gguf_bit_exact(tf_dir, name, tmp_path):
    source = _source(tf_dir, name)
    original = modelkit.load(source)
    for suffix in (".safetensors", ".gguf"):
        report = modelkit.convert(source, tmp_path / f"out{suffix}")
        assert report.verify["passed"]
        back = modelkit.load(tmp_path / f"out{suffix}")
        assert sorted(back.tensors) == sorted(original.tensors)
        for tensor_name, tensor in original.tensors.items():
            assert np.array_equal(back.tensors[tensor_name].array(), tensor.array())


@pytest.mark.parametrize("suffix, fmt", [("x.index", "tfcheckpoint"), ("sm/saved_model.pb", "savedmodel")])
def test_writing_tensorflow_formats_is_refused_before_any_work(tf_dir, tmp_path, suffix, fmt):
    with pytest.raises(UnsupportedConversionError, match="does not write"):
        modelkit.convert(tf_dir / "benign" / "module_ckpt", tmp_path / suffix, to=fmt)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_prefix_says_to_name_its_index(tf_dir):
    with pytest.raises(FormatError, match=r"name ckpt-1\.index"):
        modelkit.load(tf_dir / "benign" / "module_ckpt" / "ckpt-1")


def test_inspect_json(tf_dir):
    result = CliRunner().invoke(main, ["inspect", "--json", str(tf_dir / "benign" / "conv_savedmodel")])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["format"] == "savedmodel" and doc["parameters"] == 3 * 3 * 4 + 4 + 64 * 2 + 2
    assert {t["name"]: t["shape"] for t in doc["tensors"]}["sequential_1/conv2d/kernel"] == [3, 3, 1, 4]


@pytest.mark.parametrize("size", [0, 9, (1 << 15) + 3, 5 * 1024 + 1, 37 * 1024])
def test_vectorized_crc32c_equals_the_byte_loop(size):
    from modelkit.parse.tf_bundle import crc32c as byte_loop
    from modelkit.storage.checksums import crc32c

    data = b"123456789" if size == 9 else np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert crc32c(data) == byte_loop(data)
    if size == 9:
        assert crc32c(data) == 0xE3069283          # RFC 3720's check value


def test_an_op_tensorflow_does_not_register_is_a_custom_op(tf_dir, tmp_path):
    folder = tmp_path / "sm"
    shutil.copytree(tf_dir / "benign" / "module_savedmodel", folder)
    pb = folder / "saved_model.pb"
    pb.write_bytes(pb.read_bytes().replace(b"MatMul", b"MyMatX"))      # same length: the protobuf stays valid
    flagged = [(f.severity, f.rule, f.name) for f in scan(pb).findings if f.severity > Severity.SAFE]
    assert flagged and set(flagged) == {(Severity.SUSPICIOUS, "tensorflow.graph.custom_op", "MyMatX")}
