"""The keras converter: .keras archives written for Keras (judged by keras.saving.load_model with
safe_mode=True, against torch within the ONNX tolerance), read (ours and Keras's own), scanned clean, and
hostile archives refused."""
from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
import torch

import modelkit
from modelkit.checkpoint import Checkpoint
from modelkit.errors import FormatError, UnsafeFileError, UnsupportedConversionError
from modelkit.formats import detect_format
from modelkit.models import build, load_model_module
from modelkit.parse import keras as keras_json
from modelkit.pipeline.verify import GRAPH_ATOL
from modelkit.testing import payloads

ATOL = GRAPH_ATOL[("onnx", "float32")]       # the bar: the ONNX tolerance (measured: 6e-8, mlp, cnn and a Sequential)
SMALL_CNN = {"channels": [4, 8], "hidden": 16}


def _user_sequential() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                              torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh()), torch.nn.Linear(8, 3))
    return net.eval()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """name -> (torch module, its inputs, the .keras modelkit wrote)."""
    folder = tmp_path_factory.mktemp("keras")
    out = {}
    for name, config in (("mlp", {}), ("cnn", SMALL_CNN)):
        module = build(name, config, seed=0).eval()
        path = modelkit.save(Checkpoint.from_module(module, metadata={"note": "x"}), folder / f"{name}.keras")
        out[name] = (module, load_model_module(name).example_inputs(4), path)
    user = _user_sequential()
    x = torch.randn(4, 6)
    report = modelkit.export(user, folder / "user.keras", example_inputs=x)
    out["user"] = (user, x, folder / "user.keras")
    assert report.verify["passed"]
    return out


@pytest.mark.parametrize("name", ["mlp", "cnn", "user"])
def test_keras_loads_our_archive_in_safe_mode_with_torchs_outputs(keras, written, name):
    module, x, path = written[name]
    net = keras.saving.load_model(path, safe_mode=True)
    keras_x = x.permute(0, 2, 3, 1) if x.dim() == 4 else x            # (B, C, H, W) -> channels_last
    got = keras.ops.convert_to_numpy(net(keras_x.numpy(), training=False))
    with torch.no_grad():
        want = module(x).numpy()
    assert got.shape == want.shape and np.abs(got - want).max() <= ATOL


@pytest.mark.parametrize("name", ["mlp", "cnn", "user"])
def test_our_archives_scan_clean_and_read_back_bit_exact(written, name):
    module, _, path = written[name]
    assert detect_format(path) == "keras"
    report = modelkit.scan(path)
    assert report.findings == [] and report.files[0].format == "keras"
    back = modelkit.load(path)
    assert back.arch == (Checkpoint.from_module(module).arch)
    for key, tensor in module.state_dict().items():
        assert torch.equal(back.tensors[key].load(), tensor), key
    with zipfile.ZipFile(path) as z:                      # exactly Keras's three members, stored, dated 1980
        assert [i.filename for i in z.infolist()] == ["metadata.json", "config.json", "model.weights.h5"]
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
        assert json.loads(z.read("metadata.json"))["keras_version"].startswith("3.")


def test_the_same_checkpoint_gives_the_same_bytes(written, tmp_path):
    module, _, path = written["cnn"]
    again = modelkit.save(Checkpoint.from_module(module, metadata={"note": "x"}), tmp_path / "again.keras")
    assert again.read_bytes() == path.read_bytes()


def test_an_archive_keras_wrote_reads_by_keras_names_and_with_arch(keras, written, tmp_path):
    """Keras's own model.save: Keras's names as they are; `--arch cnn` gives the torch names, and the
    rebuilt module computes what Keras computes."""
    module, x, ours = written["cnn"]
    net = keras.saving.load_model(ours, safe_mode=True)
    theirs = tmp_path / "theirs.keras"
    net.save(theirs)
    ckpt = modelkit.load(theirs)
    assert "layers/conv2d/vars/0" in ckpt.tensors and ckpt.arch is None
    assert tuple(ckpt.tensors["layers/conv2d/vars/0"].shape) == (3, 3, 1, 4)
    target = tmp_path / "theirs.safetensors"
    modelkit.convert(theirs, target, arch=modelkit.ArchSpec("cnn", SMALL_CNN))
    with pytest.raises(UnsupportedConversionError, match="--arch"):       # the archive itself names no architecture
        modelkit.load_module(theirs)
    rebuilt = modelkit.load_module(target, arch=modelkit.ArchSpec("cnn", SMALL_CNN))
    modelkit.assert_same_outputs(module, rebuilt, x, atol=0)


def test_inspect_shows_the_layers_and_the_cli_converts(written, tmp_path):
    from click.testing import CliRunner

    from modelkit.cli import main

    _, _, path = written["cnn"]
    info = modelkit.inspect(path)
    assert [layer["class"] for layer in info.layers] == ["InputLayer", "Conv2D", "Conv2D", "MaxPooling2D", "Flatten",
                                                         "Dense", "Dense"]
    result = CliRunner().invoke(main, ["convert", str(path), str(tmp_path / "cnn.safetensors"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["verify"]["passed"]


def test_a_deflated_weights_member_reads_the_same(written, tmp_path):
    _, _, path = written["mlp"]
    deflated = tmp_path / "deflated.keras"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            out.writestr(info.filename, src.read(info.filename))
    want, got = modelkit.load(path).materialize(), modelkit.load(deflated).materialize()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_lambda_layer_is_refused_by_the_gate(tmp_path):
    path = tmp_path / "lambda.keras"
    path.write_bytes(payloads.keras_zip(payloads.keras_lambda_config()))
    with pytest.raises(UnsafeFileError, match="Lambda"):
        modelkit.load(path)


@pytest.mark.parametrize("members, message", [
    ({"config.json": b"{}", "metadata.json": b"{}"}, "no model.weights.h5"),
    ({"config.json": b"[1]", "model.weights.h5": b""}, "not a Keras model config"),
    ({"config.json": b'{"class_name": "Sequential"}', "model.weights.npz": b""}, "model.weights.npz"),
    ({"config.json": b'{"class_name": "Sequential"}', "metadata.json": b"[]", "model.weights.h5": b""},
     "metadata.json is not a JSON object"),
])
def test_malformed_archives_are_one_line_parse_errors(members, message):
    buf = payloads.zip_bytes(members)
    with pytest.raises(modelkit.errors.ParseError, match=message):
        keras_json.read_archive(buf)


def test_a_member_that_escapes_is_refused(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("config.json", b'{"class_name": "Sequential"}')
        z.writestr("model.weights.h5", b"")
        z.writestr("../evil", b"")
    with pytest.raises(modelkit.errors.ParseError, match="climbs out"):
        keras_json.read_archive(buf.getvalue())
    path = tmp_path / "evil.keras"
    path.write_bytes(buf.getvalue())
    with pytest.raises((FormatError, UnsafeFileError)) as e:
        modelkit.load(path, format="keras")
    assert "\n" not in str(e.value)


def test_the_weights_member_is_skipped_only_when_it_is_hdf5(written, tmp_path):
    """model.weights.h5 is tensor data Keras reads with h5py: skipped unread (as torch storages are) when its
    superblock is HDF5's; anything else posing as it is scanned by content."""
    _, _, path = written["mlp"]
    assert "1 tensor storages skipped unread" in " ".join(modelkit.scan(path).files[0].examined)
    posing = tmp_path / "posing.keras"
    posing.write_bytes(payloads.zip_bytes({"config.json": b'{"class_name": "Sequential", "config": {"layers": []}}',
                                           "metadata.json": b"{}", "model.weights.h5": payloads.system_pickle()}))
    assert modelkit.scan(posing).worst == modelkit.scan.Severity.DANGEROUS
