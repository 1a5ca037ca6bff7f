"""The scanner on TensorFlow.js model.json files and Keras configs however wrapped: hostile files built by
modelkit.testing.payloads are found with their rule and severity; hand-made benign models scan clean.

TF.js is not installed here: the benign files are written by hand in the layout tfjs-core's io/types.ts
and tensorflowjs_converter define. Nothing built here is ever loaded.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
from click.testing import CliRunner

from modelkit.cli import EXIT_OK, EXIT_UNSAFE, main
from modelkit.errors import ParseError
from modelkit.parse import keras, tfjs
from modelkit.scan import Severity, scan
from modelkit.testing import payloads

_DENSE = {"class_name": "Dense", "config": {"name": "dense", "trainable": True, "dtype": "float32", "units": 2,
                                            "activation": "relu", "use_bias": True,
                                            "kernel_initializer": {"class_name": "GlorotUniform",
                                                                   "config": {"seed": None}}}}


def _rules(report) -> dict[str, Severity]:
    return {f.rule: f.severity for f in report.findings}


def _clean(report) -> None:
    assert not report.errors, report.errors
    assert report.worst == Severity.SAFE, [(f.rule, f.detail) for f in report.findings]


def _layers_model(folder, *, shards: dict[str, bytes] | None = None, wrapped: bool = False) -> str:
    """A Dense(3 -> 2) Layers model as TF.js writes it: kernel and bias, float32, in `shards` (one 24+8 byte
    shard by default)."""
    shards = shards if shards is not None else {"group1-shard1of1.bin": struct.pack("<8f", *range(8))}
    for name, data in shards.items():
        (folder / name).write_bytes(data)
    topology = payloads.keras_sequential([_DENSE])
    topology["keras_version"], topology["backend"] = "tfjs-layers 4.22.0", "tensor_flow.js"
    manifest = [payloads.tfjs_group(list(shards), [("dense/kernel", [3, 2], "float32"), ("dense/bias", [2], "float32")])]
    (folder / "model.json").write_bytes(payloads.tfjs_model_json({"model_config": topology} if wrapped else topology,
                                                                 manifest))
    return str(folder / "model.json")


# ---------------------------------------------------------------------------------------------
# Benign files scan clean.

@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "model_config"])
def test_layers_model_with_matching_shards_is_clean(tmp_path, wrapped):
    report = scan(_layers_model(tmp_path, wrapped=wrapped))
    _clean(report)
    assert report.files[0].format == "tfjs"
    assert "TF.js layers-model, 2 weights in 1 shards, shard sizes checked" in report.files[0].examined[0]


def test_layers_model_split_across_shards_with_quantized_and_half_weights_is_clean(tmp_path):
    (tmp_path / "group1-shard1of2.bin").write_bytes(bytes(10))
    (tmp_path / "group1-shard2of2.bin").write_bytes(bytes(4))
    weights = [{"name": "dense/kernel", "shape": [3, 2], "dtype": "float32",
                "quantization": {"dtype": "uint8", "min": -1.0, "scale": 0.01, "original_dtype": "float32"}},
               {"name": "dense/bias", "shape": [2], "dtype": "float32", "quantization": {"dtype": "float16"}},
               {"name": "emb", "shape": [2], "dtype": "float16"}]
    (tmp_path / "model.json").write_bytes(payloads.tfjs_model_json(
        payloads.keras_sequential([_DENSE]),
        [{"paths": ["group1-shard1of2.bin", "group1-shard2of2.bin"], "weights": weights}]))
    _clean(scan(tmp_path / "model.json"))                  # 6 x 1 + 2 x 2 + 2 x 2 = 14 bytes


def test_graph_model_is_clean(tmp_path):
    nodes = [{"name": "x", "op": "Placeholder", "attr": {"dtype": {"type": "DT_FLOAT"}}},
             {"name": "w", "op": "Const", "attr": {"dtype": {"type": "DT_FLOAT"}}},
             {"name": "y", "op": "MatMul", "input": ["x", "w"]},
             {"name": "Identity", "op": "Identity", "input": ["y"]}]
    (tmp_path / "group1-shard1of1.bin").write_bytes(bytes(24))
    (tmp_path / "model.json").write_bytes(payloads.tfjs_model_json(
        {"node": nodes, "library": {}, "versions": {"producer": 1482}},
        [payloads.tfjs_group(["group1-shard1of1.bin"], [("w", [3, 2], "float32")])], fmt="graph-model",
        signature={"inputs": {"x:0": {"name": "x:0"}}}, userDefinedMetadata={"note": "benign"}))
    report = scan(tmp_path / "model.json")
    _clean(report)
    assert "graph-model, 4 graph nodes" in report.files[0].examined[0]


def test_plain_json_is_not_taken_for_a_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], "hidden_size": 8}))
    report = scan(tmp_path / "config.json")
    _clean(report)
    assert report.files[0].format == "json"


# ---------------------------------------------------------------------------------------------
# Hostile files: the rule and the severity.

@pytest.mark.parametrize(("name", "rule"), [
    ("lambda-tfjs.json", "keras.lambda"),
    ("lambda-wrapped-tfjs.json", "keras.lambda"),
    ("escape-tfjs.json", "tfjs.path.escape"),
    ("absolute-tfjs.json", "tfjs.path.escape"),
    ("pyfunc-tfjs.json", "tfjs.graph.op"),
])
def test_hostile_model_json_is_dangerous(tmp_path, name, rule):
    path = tmp_path / "model.json"
    path.write_bytes(payloads.hostile_corpus()[name])
    report = scan(path)
    assert _rules(report).get(rule) == Severity.DANGEROUS, report.findings
    assert report.files[0].format == "tfjs"


def test_escape_is_reported_without_touching_the_target(tmp_path, monkeypatch):
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(tfjs.os, "stat", lambda p, *a, **k: stats.append(p) or real_stat(p, *a, **k))
    path = tmp_path / "model.json"
    path.write_bytes(payloads.tfjs_shard_path("../../../../etc/shadow"))
    report = scan(path)
    assert _rules(report) == {"tfjs.path.escape": Severity.DANGEROUS}
    assert "climbs out of the model's folder" in report.findings[0].detail
    assert not [p for p in stats if "shadow" in str(p)]


def test_symlinked_shard_pointing_outside_is_dangerous(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(bytes(32))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "group1-shard1of1.bin").symlink_to(outside)
    report = scan(_model_with_shard(folder, "group1-shard1of1.bin"))
    assert _rules(report).get("tfjs.path.escape") == Severity.DANGEROUS
    assert "symlink" in next(f.detail for f in report.findings if f.rule == "tfjs.path.escape")


def _model_with_shard(folder, shard: str) -> str:
    topology = payloads.keras_sequential([_DENSE])
    manifest = [payloads.tfjs_group([shard], [("dense/kernel", [3, 2], "float32"), ("dense/bias", [2], "float32")])]
    (folder / "model.json").write_bytes(payloads.tfjs_model_json(topology, manifest))
    return str(folder / "model.json")


@pytest.mark.parametrize(("size", "words"), [(31, "1 bytes short"), (40, "8 bytes more than the weights need"),
                                             (0, "32 bytes short")])
def test_short_or_long_shard_is_suspicious(tmp_path, size, words):
    report = scan(_layers_model(tmp_path, shards={"group1-shard1of1.bin": bytes(size)}))
    assert _rules(report) == {"tfjs.shard.size": Severity.SUSPICIOUS}
    assert words in report.findings[0].detail and "need 32" in report.findings[0].detail


def test_shards_are_sized_never_read(tmp_path, monkeypatch):
    import builtins

    opened = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
    path = _layers_model(tmp_path, shards={"group1-shard1of1.bin": bytes(1 << 20)})
    opened.clear()
    assert "tfjs.shard.size" in _rules(scan(path))
    assert not any(p.endswith(".bin") for p in opened), opened


def test_missing_shard_is_reported(tmp_path):
    report = scan(_model_with_shard(tmp_path, "group1-shard1of1.bin"))
    assert _rules(report) == {"tfjs.shard.missing": Severity.SUSPICIOUS}
    assert "does not exist" in report.findings[0].detail


def test_malformed_manifest_is_suspicious_and_its_paths_are_still_checked(tmp_path):
    doc = json.loads(payloads.tfjs_shard_path("/etc/shadow"))
    doc["weightsManifest"][0]["weights"][0]["dtype"] = "float128"
    (tmp_path / "model.json").write_text(json.dumps(doc))
    rules = _rules(scan(tmp_path / "model.json"))
    assert rules == {"tfjs.path.escape": Severity.DANGEROUS, "tfjs.malformed": Severity.SUSPICIOUS}


# ---------------------------------------------------------------------------------------------
# Code in Keras configs, however the config is wrapped.

def _renamed_lambda() -> dict:
    layer = payloads.keras_marshal_lambda()
    return dict(layer, class_name="Innocent")


def _marshal_in_a_custom_field() -> dict:
    code = payloads.keras_marshal_lambda()["config"]["function"][0]
    return {"class_name": "Dense", "config": {"name": "d", "units": 1, "activation": {"fn": code}}}


@pytest.mark.parametrize("layer", [payloads.keras_marshal_lambda(), _renamed_lambda(), _marshal_in_a_custom_field()],
                         ids=["Lambda", "function_type-lambda", "marshal-string"])
@pytest.mark.parametrize("wrap", ["to_json", "model_config", "tfjs", "tfjs-model_config", "keras-archive", "tfjs-nested"])
def test_code_in_a_keras_config_is_dangerous_however_wrapped(tmp_path, layer, wrap):
    config = payloads.keras_sequential([_DENSE, layer])
    if wrap == "tfjs-nested":                       # inside a Sequential nested in the model (keras_graph builds those)
        config = payloads.keras_sequential([_DENSE, config])
    if wrap == "to_json":
        data, name = json.dumps(config).encode(), "model.json"
    elif wrap == "model_config":
        data, name = json.dumps({"model_config": config, "training_config": None}).encode(), "model.json"
    elif wrap == "keras-archive":
        data, name = payloads.keras_zip(json.dumps(config).encode()), "m.keras"
    else:
        data, name = payloads.tfjs_model_json({"model_config": config} if wrap.endswith("model_config") else config), \
            "model.json"
    (tmp_path / name).write_bytes(data)
    report = scan(tmp_path / name)
    assert [(f.severity, f.rule) for f in report.findings] == [(Severity.DANGEROUS, "keras.lambda")]


def test_model_config_unwraps_every_keras_shape():
    config = payloads.keras_sequential([_DENSE])
    assert keras.model_config(config) is config
    assert keras.model_config({"model_config": config, "training_config": {}}) is config
    assert keras.model_config({"architectures": []}) is None and keras.model_config([config]) is None


def test_marshalled_code_tells_bytecode_from_text():
    code = payloads.keras_marshal_lambda()["config"]["function"][0]
    assert "\n" in code and keras.marshalled_code(code)
    assert not keras.marshalled_code("Yw that is just text") and not keras.marshalled_code("4w")
    assert not keras.marshalled_code("dense/kernel") and not keras.marshalled_code("YWJjZGVmZ2hpamts")


# ---------------------------------------------------------------------------------------------
# parse.tfjs

def test_read_model_returns_its_parts():
    doc = payloads.tfjs_model_json({"model_config": payloads.keras_sequential([_DENSE])}, [
        {"paths": ["a.bin", "b.bin"], "weights": [
            {"name": "k", "shape": [3, 2], "dtype": "float32"},
            {"name": "q", "shape": [4], "dtype": "float32", "quantization": {"dtype": "uint16", "min": 0, "scale": 1}},
            {"name": "s", "shape": [1], "dtype": "string"}]}])
    model = tfjs.read_model(doc)
    assert model.format == "layers-model" and model.config["class_name"] == "Sequential" and model.nodes == []
    (group,) = model.groups
    assert group.paths == ("a.bin", "b.bin")
    assert [(w.name, w.shape, w.nbytes) for w in group.weights] == [("k", (3, 2), 24), ("q", (4,), 8), ("s", (1,), None)]
    assert group.nbytes is None                    # a string weight's size is only known from the data


def test_graph_nodes_include_the_library_functions():
    doc = {"format": "graph-model", "modelTopology": {"node": [{"name": "x", "op": "Placeholder"}],
                                                      "library": {"function": [{"nodeDef": [{"name": "r", "op": "ReadFile"}]}]}}}
    assert [n["op"] for n in tfjs.from_document(doc).nodes] == ["Placeholder", "ReadFile"]
    doc.pop("format")
    assert tfjs.from_document(doc).format == "graph-model"        # told from the topology when not declared


@pytest.mark.parametrize(("doc", "message"), [
    ({"x": 1}, "not a TensorFlow.js model.json (no modelTopology or weightsManifest)"),
    ({"format": "saved-model", "modelTopology": {}}, "format 'saved-model' is not a TensorFlow.js model format"),
    ({"format": "layers-model", "modelTopology": {"a": 1}}, "modelTopology of a layers-model is not a Keras model config"),
    ({"format": "graph-model", "modelTopology": {"node": [{"name": "x"}]}}, "modelTopology.node[0] is not a node with an op"),
    ({"weightsManifest": {}}, "weightsManifest is not a list of groups"),
    ({"weightsManifest": [{"paths": [1], "weights": []}]}, "weightsManifest[0].paths is not a list of file names"),
    ({"weightsManifest": [{"paths": [], "weights": [{"name": "w", "shape": [-1], "dtype": "float32"}]}]},
     "weight 'w' has shape [-1]"),
    ({"weightsManifest": [{"paths": [], "weights": [{"name": "w", "shape": [2**40, 2**40], "dtype": "float32"}]}]},
     "more than 2**62 elements"),
    ({"weightsManifest": [{"paths": [], "weights": [{"name": "w", "shape": [1], "dtype": "float64"}]}]},
     "weight 'w' has dtype 'float64'"),
    ({"weightsManifest": [{"paths": [], "weights": [{"name": "w", "shape": [1], "dtype": "float32",
                                                     "quantization": {"dtype": "int4"}}]}]},
     "known quantized dtypes: uint8, uint16, float16"),
])
def test_bad_model_json_is_one_clear_line(doc, message):
    with pytest.raises(ParseError) as info:
        tfjs.from_document(doc)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_read_model_caps_size_and_depth():
    with pytest.raises(ParseError, match="not valid JSON"):
        tfjs.read_model(b"[" * 100_000)
    with pytest.raises(ParseError, match="JSON larger than"):
        tfjs.read_model(memoryview(b" " * 16), 0, keras.MAX_JSON + 1)


def test_resolve_shards_checks_before_returning(tmp_path):
    path = _layers_model(tmp_path)
    model = tfjs.read_model(open(path, "rb").read())
    assert tfjs.resolve_shards(model, str(tmp_path)) == [[os.path.realpath(tmp_path / "group1-shard1of1.bin")]]
    (tmp_path / "group1-shard1of1.bin").write_bytes(bytes(3))
    with pytest.raises(ParseError, match="29 bytes short"):
        tfjs.resolve_shards(model, str(tmp_path))


# ---------------------------------------------------------------------------------------------
# The CLI, and start-up.

def test_cli_reports_tfjs_findings_and_exit_codes(tmp_path):
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "model.json").write_bytes(payloads.tfjs_lambda(wrapped=True))
    result = CliRunner().invoke(main, ["scan", str(evil / "model.json")])
    assert result.exit_code == EXIT_UNSAFE and "keras.lambda" in result.stdout and "DANGEROUS" in result.stdout
    result = CliRunner().invoke(main, ["scan", "--json", str(evil / "model.json")])
    doc = json.loads(result.stdout)
    assert result.exit_code == EXIT_UNSAFE and doc["files"][0]["format"] == "tfjs"
    assert [(f["rule"], f["severity"]) for f in doc["findings"]] == [("keras.lambda", "dangerous")]
    good = tmp_path / "good"
    good.mkdir()
    assert CliRunner().invoke(main, ["scan", _layers_model(good)]).exit_code == EXIT_OK


def test_scanning_model_json_imports_neither_torch_nor_numpy(tmp_path):
    path = _layers_model(tmp_path)
    code = (f"import sys\nfrom modelkit.scan import scan\nr = scan({path!r})\nassert r.files[0].format == 'tfjs'\n"
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_large_graph_model_is_not_a_limit_finding(tmp_path):
    nodes = [{"name": f"n{i}", "op": "Identity", "input": [f"n{i - 1}"], "attr": {"T": {"type": "DT_FLOAT"}}}
             for i in range(250_000)]                              # > 1M JSON values: the Keras walk's limit
    (tmp_path / "model.json").write_bytes(payloads.tfjs_model_json({"node": nodes}, fmt="graph-model"))
    _clean(scan(tmp_path / "model.json"))


def test_a_folder_with_its_shards_scans_clean(tmp_path):
    """Scanning the folder: the shards are raw bytes, accepted because model.json names them; a raw
    file nobody names is still an error, and a pickle posing as a shard is still judged as one."""
    _layers_model(tmp_path)
    report = scan(tmp_path)
    assert report.errors == [] and report.worst == Severity.SAFE
    assert {f.format for f in report.files} == {"tfjs", "tensor data"}
    (tmp_path / "stray.bin").write_bytes(bytes(range(256)) * 4)
    assert [os.path.basename(e.path) for e in scan(tmp_path).errors] == ["stray.bin"]
    (tmp_path / "stray.bin").unlink()
    (tmp_path / "group1-shard1of1.bin").write_bytes(payloads.system_pickle("echo pwned"))
    assert scan(tmp_path).worst == Severity.DANGEROUS
