"""Keras's architecture JSON beside its weights: modelkit writes `m.json` next to every `m.weights.h5` (the pair
Keras's model_from_json + load_weights loads; judged in tests/test_hdf5.py), and reads such a pair, whoever
wrote it, as the weights with the architecture's layers listed."""
from __future__ import annotations

import json

import numpy as np
import pytest

import modelkit
from modelkit.checkpoint import Checkpoint
from modelkit.errors import FormatError, OutputExistsError, UnsafeFileError
from modelkit.formats import detect_format
from modelkit.models import build


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keras-json")
    model = build("mlp", seed=0)
    modelkit.save(Checkpoint.from_module(model), folder / "mlp.weights.h5")
    return folder, model


def test_our_pair_reads_back_as_the_torch_weights(ours, tmp_path):
    folder, model = ours
    assert detect_format(folder / "mlp.json") == "hdf5"
    ckpt = modelkit.load(folder / "mlp.json")
    assert ckpt.arch.name == "mlp"
    assert all(np.array_equal(ckpt.tensors[k].array(), v.numpy()) for k, v in model.state_dict().items())
    info = modelkit.inspect(folder / "mlp.json")
    assert [(lay["name"], lay["class"]) for lay in info.layers] == [
        ("input_layer", "InputLayer"), ("dense", "Dense"), ("dense_1", "Dense"), ("dense_2", "Dense")]
    report = modelkit.convert(folder / "mlp.json", tmp_path / "m.safetensors")
    assert report.verify["method"] == "bit-exact" and report.tensors == len(model.state_dict())


def test_the_sidecar_is_part_of_the_output(ours, tmp_path):
    src = ours[0] / "mlp.weights.h5"
    (tmp_path / "m.json").write_text("{}")             # someone else's file where the architecture would go
    with pytest.raises(OutputExistsError, match="m.json"):
        modelkit.convert(src, tmp_path / "m.weights.h5")
    assert not (tmp_path / "m.weights.h5").exists() and (tmp_path / "m.json").read_text() == "{}"
    modelkit.convert(src, tmp_path / "m.weights.h5", force=True)
    assert json.loads((tmp_path / "m.json").read_text())["class_name"] == "Sequential"
    modelkit.convert(src, tmp_path / "plain.h5")           # only the Keras weights name gets the architecture
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "m.weights.h5", "plain.h5"]


def test_a_pair_keras_wrote_reads_with_its_layers(keras, tmp_path):
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu", name="hidden"),
                            keras.layers.Dense(2, name="out")])
    (tmp_path / "k.json").write_text(net.to_json())
    net.save_weights(str(tmp_path / "k.weights.h5"))
    info = modelkit.inspect(tmp_path / "k.json")
    assert [lay["class"] for lay in info.layers] == ["InputLayer", "Dense", "Dense"]
    assert "units=3" in info.layers[1]["config"]
    ckpt = modelkit.load(tmp_path / "k.json")
    kernel = keras.ops.convert_to_numpy(net.layers[0].kernel)
    assert np.array_equal(ckpt.tensors["layers/dense/vars/0"].array(), kernel)
    assert modelkit.convert(tmp_path / "k.json", tmp_path / "k.safetensors").verify["method"] == "bit-exact"


def test_an_architecture_carrying_code_is_refused_and_a_lone_json_is_not_claimed(ours, tmp_path):
    layer = {"class_name": "Lambda", "config": {"name": "l", "function": {"class_name": "__lambda__", "config": {
        "code": "4wEAAAAAAAAAAAAAAAEAAAADAAAAQwAAAHMEAAAAfABTAKkBTqkAqQHaAXhyAgAAAHICAAAA+gFmcgMAAAABAAAAcwAAAAA=",
        "defaults": None, "closure": None}}}}
    (tmp_path / "evil.json").write_text(json.dumps({"class_name": "Sequential", "config": {"layers": [layer]}}))
    (tmp_path / "evil.weights.h5").write_bytes((ours[0] / "mlp.weights.h5").read_bytes())
    with pytest.raises(UnsafeFileError):
        modelkit.load(tmp_path / "evil.json")
    (tmp_path / "alone.json").write_text(json.dumps({"class_name": "Sequential", "config": {"layers": []}}))
    with pytest.raises(FormatError, match="not a model file"):
        modelkit.load(tmp_path / "alone.json")
