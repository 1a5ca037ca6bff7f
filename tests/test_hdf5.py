"""The HDF5 converter: lossless `modelkit` group, Keras layouts judged by Keras 3, hostile files refused."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import h5py
import numpy as np
import pytest
import torch

import modelkit
from modelkit.checkpoint import ARCH_KEY, ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.converters import hdf5
from modelkit.errors import FormatError, UnsupportedConversionError
from modelkit.formats import detect_format
from modelkit.models import build, config_from_dict, config_to_dict, load_model_module

# Largest |Keras - torch| on the same inputs after `load_weights` of our file. Measured 2026-11-21
# (Keras 3.15.1 on its torch backend, torch 2.13.0 CPU, 16 example inputs, the same under the
# .weights.h5 and the legacy .h5 reader): mlp 1.5e-08 (bf16 weights 3.0e-08), mlp hidden=[16]
# 6.0e-08 (3.0e-08), cnn default 3.7e-08 (3.7e-08), cnn small 1.5e-08 (1.7e-08). The weights are
# bit-identical; only float32 summation order differs. Pinned at about 15x the largest.
KERAS_ATOL = 1e-6

SMALL_CNN = {"channels": [4, 8], "hidden": 16}

# Keras 3.15 on numpy 2 warns from its own torch backend (np.array(x) without copy=); not ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn.t accept a copy keyword:DeprecationWarning")


def _save(tmp_path, ckpt, name="m.h5"):
    return modelkit.save(ckpt, tmp_path / name, format="hdf5")


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# --- lossless modelkit group -------------------------------------------------------------------

def test_every_reference_model_round_trips_bit_exact(small_model, tmp_path):
    ckpt = Checkpoint.from_module(small_model, metadata={"note": "héllo", "empty": ""})
    back = modelkit.load(_save(tmp_path, ckpt))
    assert back.arch == ckpt.arch and back.metadata == ckpt.metadata
    original, loaded = ckpt.materialize(), back.materialize()
    assert list(loaded) == list(original)                          # state_dict order too
    assert all(_equal_bits(loaded[k], original[k]) for k in original)


def _sample(dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.arange(24).reshape(2, 3, 4) % 3 == 0
    if dtype.itemsize == 1:                                        # 1-byte types: raw bit patterns
        return torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4).view(dtype)
    if dtype.is_complex:
        return torch.randn(2, 3, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(0)).to(dtype)
    return (torch.arange(24).reshape(2, 3, 4) % 7 - 3).to(dtype)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("code", sorted(hdf5.DTYPES))
def test_every_dtype_round_trips_bit_exact_with_scalars_and_empty_tensors(code, tmp_path):
    tensor = _sample(hdf5.DTYPES[code].dtype.torch)
    state = {"t": tensor, "scalar": tensor.reshape(-1)[5].clone(), "empty": tensor[:0].clone()}
    back = modelkit.load(_save(tmp_path, Checkpoint.from_state_dict(state))).materialize()
    for name, want in state.items():
        assert _equal_bits(back[name], want), name
    assert back["scalar"].shape == () and back["empty"].shape == (0, 3, 4)


def test_h5py_reads_the_modelkit_group_by_state_dict_name(tmp_path):
    model = build("cnn", SMALL_CNN, seed=0)
    path = _save(tmp_path, Checkpoint.from_module(model, metadata={"origin": "test"}))
    with h5py.File(path, "r") as f:
        tensors = f["modelkit/tensors"]
        assert list(tensors) == list(model.state_dict())
        for name, tensor in model.state_dict().items():
            assert tensors[name].attrs["dtype"] == b"float32"
            np.testing.assert_array_equal(tensors[name][()], tensor.numpy())
        meta = f["modelkit/metadata"].attrs
        assert meta["origin"] == b"test"
        assert ArchSpec.from_json(meta[ARCH_KEY].decode()) == ArchSpec("cnn", config_to_dict(model.config))


def test_bfloat16_is_a_uint16_view_with_a_dtype_attribute(tmp_path):
    tensor = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    path = _save(tmp_path, Checkpoint.from_state_dict({"w": tensor}))
    with h5py.File(path, "r") as f:
        stored = f["modelkit/tensors/w"]
        assert stored.dtype == np.uint16 and stored.attrs["dtype"] == b"bfloat16"
        np.testing.assert_array_equal(stored[()], tensor.view(torch.uint16).numpy())
    assert _equal_bits(modelkit.load(path).tensors["w"].load(), tensor)


def test_names_hdf5_would_split_or_misread_round_trip(tmp_path):
    state = {name: torch.full((2,), float(i)) for i, name in enumerate(["a/b", ".", "..", "%2F", "x%y", " sp ", "ü"])}
    path = _save(tmp_path, Checkpoint.from_state_dict(state))
    back = modelkit.load(path).materialize()
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)
    with h5py.File(path, "r") as f:
        assert "a%2Fb" in f["modelkit/tensors"] and "%2E" in f["modelkit/tensors"]


def test_tied_tensors_are_stored_once_as_hard_links(tmp_path):
    shared = torch.randn(4, 3)
    ckpt = Checkpoint.from_state_dict({"embed.weight": shared, "head.weight": shared, "bias": torch.zeros(3)})
    path = _save(tmp_path, ckpt)
    with h5py.File(path, "r") as f:
        tensors = f["modelkit/tensors"]
        assert tensors["head.weight"] == tensors["embed.weight"]   # one object, two names
    back = modelkit.load(path)
    assert back.metadata == ckpt.metadata
    assert torch.equal(back.tensors["head.weight"].load(), shared)


def test_read_is_lazy(tmp_path):
    """Opening reads no tensor data: bytes changed after opening show up when the tensor is loaded."""
    path = _save(tmp_path, Checkpoint.from_state_dict({"w": torch.zeros(4)}))
    ckpt = modelkit.load(path)
    with h5py.File(path, "r+") as f:
        f["modelkit/tensors/w"][...] = [1, 2, 3, 4]
    assert ckpt.tensors["w"].load().tolist() == [1, 2, 3, 4]


def test_write_streams_loading_each_tensor_once(tmp_path):
    """The Keras copy is made from the same load as the modelkit dataset: one read per tensor."""
    ckpt = Checkpoint.from_module(build("cnn", SMALL_CNN, seed=0))
    loads = Counter()

    def counted(name, entry):
        def read():
            loads[name] += 1
            return entry.load()
        return LazyTensor(entry.dtype, entry.shape, read)

    modelkit.save(Checkpoint({n: counted(n, e) for n, e in ckpt.tensors.items()}, ckpt.metadata, ckpt.arch),
                  tmp_path / "m.h5", format="hdf5", verify=False)          # the writer alone (verifying reads again)
    assert loads == Counter(dict.fromkeys(ckpt.tensors, 1))


def test_what_hdf5_cannot_hold_is_refused_before_writing(tmp_path):
    part = LazyTensor.of(torch.zeros(2, 2, dtype=torch.int8))
    quantized = QuantizedTensor("int8", "affine", (2, 2), torch.float32, {"qdata": part, "scale": LazyTensor.of(torch.ones(1, 1))})
    cases = [
        Checkpoint({"w": quantized}),
        Checkpoint.from_state_dict({"w": torch.zeros(2)}, metadata={"bad": "nul\x00inside"}),
        Checkpoint.from_state_dict({"": torch.zeros(2)}),
    ]
    for ckpt in cases:
        with pytest.raises(UnsupportedConversionError):
            _save(tmp_path, ckpt)
        assert list(tmp_path.iterdir()) == []


# --- Keras layouts -----------------------------------------------------------------------------

def keras_model(keras, name, config):
    """The Keras model equivalent to reference model `name`, written from the model code, not
    from the converter: channels_last, as Keras users build it."""
    cfg = config_to_dict(config_from_dict(name, config))
    layers = keras.layers
    if name == "mlp":
        return keras.Sequential([keras.Input((cfg["in_features"],)),
                                 *[layers.Dense(width, activation="relu") for width in cfg["hidden"]],
                                 layers.Dense(cfg["num_classes"])])
    c1, c2 = cfg["channels"]
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        layers.Conv2D(c1, 3, padding="same", activation="relu"),
        layers.Conv2D(c2, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(2),
        layers.Flatten(),
        layers.Dense(cfg["hidden"], activation="relu"),
        layers.Dense(cfg["num_classes"]),
    ])


KERAS_CASES = [("mlp", {}), ("mlp", {"hidden": [16]}), ("cnn", {}), ("cnn", SMALL_CNN)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("suffix", [".weights.h5", ".h5"], ids=["keras3", "legacy"])
@pytest.mark.parametrize(("name", "config"), KERAS_CASES, ids=["mlp", "mlp-small", "cnn", "cnn-small"])
def test_keras_load_weights_reproduces_torch(keras, name, config, suffix, dtype, tmp_path):
    """Keras picks its reader by file name (.weights.h5: Keras 3, .h5: Keras 2 legacy); both work."""
    model = build(name, config, seed=0).eval().to(dtype)
    path = modelkit.save(Checkpoint.from_module(model), tmp_path / f"{name}{suffix}")
    net = keras_model(keras, name, config)
    net.load_weights(str(path))
    inputs = load_model_module(name).example_inputs(16)
    with torch.no_grad():
        expected = model.float()(inputs).numpy()
    keras_inputs = inputs.permute(0, 2, 3, 1) if name == "cnn" else inputs     # (B, C, H, W) -> (B, H, W, C)
    got = keras.ops.convert_to_numpy(net(keras_inputs.numpy(), training=False))
    assert np.abs(got - expected).max() <= KERAS_ATOL


def test_convert_to_weights_h5_gives_keras_its_file(keras, tmp_path):
    model = build("cnn", SMALL_CNN, seed=0).eval()
    source = modelkit.save(Checkpoint.from_module(model), tmp_path / "model.safetensors")
    report = modelkit.convert(source, tmp_path / "cnn.weights.h5")
    assert report.verify["passed"]
    net = keras_model(keras, "cnn", SMALL_CNN)
    net.load_weights(str(tmp_path / "cnn.weights.h5"))
    with h5py.File(tmp_path / "cnn.weights.h5", "r") as f:
        assert f.attrs[hdf5.LAYOUT_ATTR] == "keras" and "Conv2D(4, 3" in f.attrs[hdf5.NOTE_ATTR]
    kernel = keras.ops.convert_to_numpy(net.layers[0].kernel)
    np.testing.assert_array_equal(kernel, model.conv1.weight.detach().permute(2, 3, 1, 0).numpy())


def test_keras_written_weights_file_reads_lazily_by_variable_path(keras, tmp_path):
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                            keras.layers.Dense(2, dtype="bfloat16")])
    path = tmp_path / "theirs.weights.h5"
    net.save_weights(str(path))
    ckpt = modelkit.load(path)
    assert ckpt.arch is None and ckpt.metadata == {}
    assert sorted(ckpt.tensors) == [f"layers/{layer}/vars/{i}" for layer in ("dense", "dense_1") for i in (0, 1)]
    assert ckpt.tensors["layers/dense_1/vars/0"].dtype == torch.bfloat16
    for layer, key in zip(net.layers, ("dense", "dense_1"), strict=True):
        for i, variable in enumerate((layer.kernel, layer.bias)):
            want = torch.as_tensor(keras.ops.convert_to_numpy(keras.ops.cast(variable, "float32")))
            assert torch.equal(ckpt.tensors[f"layers/{key}/vars/{i}"].load().float(), want)
    with h5py.File(path, "r+") as f:                             # lazy: later changes are what load() sees
        f["layers/dense/vars/1"][...] = np.ones(4, np.float32)
    assert ckpt.tensors["layers/dense/vars/1"].load().tolist() == [1, 1, 1, 1]


SMALL_TINYLM = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16}


def test_model_without_keras_equivalent_gets_the_modelkit_group_and_a_note(tmp_path, caplog):
    ckpt = Checkpoint.from_module(build("tinylm", SMALL_TINYLM, seed=0))
    with caplog.at_level("INFO", logger=hdf5.__name__):
        path = _save(tmp_path, ckpt, "tinylm.h5")
    assert "no Keras layout" in caplog.text
    with h5py.File(path, "r") as f:
        assert f.attrs[hdf5.LAYOUT_ATTR] == "none"
        assert "no standard Keras equivalent" in f.attrs[hdf5.NOTE_ATTR]
        assert set(f) == {"modelkit"} and "layer_names" not in f.attrs     # nothing Keras could misread
    assert modelkit.load(path).arch == ckpt.arch


def _as_int(ckpt: Checkpoint) -> Checkpoint:
    return Checkpoint.from_state_dict({k: v.to(torch.int32) for k, v in ckpt.materialize().items()}, arch=ckpt.arch)


def _with_extra_tensor(ckpt: Checkpoint) -> Checkpoint:
    return Checkpoint({**ckpt.tensors, "extra.weight": LazyTensor.of(torch.ones(3))}, ckpt.metadata, ckpt.arch)


@pytest.mark.parametrize("make, reason", [
    (lambda: Checkpoint.from_module(build("tinylm", SMALL_TINYLM, seed=0)), "no standard Keras equivalent"),
    (lambda: Checkpoint.from_state_dict(build("mlp", seed=0).state_dict()), "pass --arch"),
    (lambda: _with_extra_tensor(Checkpoint.from_module(build("mlp", seed=0))), "'extra.weight' has no Keras mapping"),
    (lambda: _as_int(Checkpoint.from_module(build("mlp", seed=0))), "Keras weights are floating point"),
], ids=["tinylm", "no-arch", "extra-layer", "int-weights"])
def test_weights_h5_name_asks_for_the_keras_layout(make, reason, tmp_path):
    """`.weights.h5` is the name Keras 3 requires for its layout: without one, refuse and say why."""
    ckpt = make()
    with pytest.raises(UnsupportedConversionError, match=reason) as info:
        _save(tmp_path, ckpt, "m.weights.h5")
    assert "m.h5" in str(info.value) and list(tmp_path.iterdir()) == []
    path = _save(tmp_path, ckpt, "m.h5")                              # any other name: modelkit group only
    with h5py.File(path, "r") as f:
        assert f.attrs[hdf5.LAYOUT_ATTR] == "none" and reason in f.attrs[hdf5.NOTE_ATTR]
    assert sorted(modelkit.load(path).tensors) == sorted(ckpt.tensors)


def test_library_does_not_import_keras():
    code = "import modelkit.converters.hdf5, sys; assert 'keras' not in sys.modules, 'keras imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# --- detection and hostile files ---------------------------------------------------------------

def test_detect_wants_the_signature_at_offset_zero_and_a_plausible_superblock(tmp_path):
    ours = _save(tmp_path, Checkpoint.from_state_dict({"w": torch.ones(2)}))
    assert hdf5.detect(ours) and detect_format(ours) == "hdf5"
    blocked = tmp_path / "userblock.h5"
    with h5py.File(blocked, "w", userblock_size=512) as f:          # signature at 512, as MATLAB v7.3 writes
        f["w"] = np.ones(2, np.float32)
    assert not hdf5.detect(blocked)
    assert modelkit.load(blocked, format="hdf5").tensors["w"].load().tolist() == [1, 1]   # --from hdf5 reads it
    for name, data in [("empty.h5", b""), ("short.h5", b"\x89HD"), ("text.h5", b"hello world\n"),
                       ("bad-superblock.h5", hdf5.SIGNATURE + b"\x07" * 8)]:
        (tmp_path / name).write_bytes(data)
        assert not hdf5.detect(tmp_path / name)
    assert not hdf5.detect(tmp_path / "missing.h5") and not hdf5.detect(tmp_path)


def _ours(tmp_path):
    with h5py.File(tmp_path / "elsewhere.h5", "w") as f:             # what an external link would reach
        f["secret"] = np.full(2, 7, np.float32)
        f["secret"].attrs.create("dtype", np.bytes_(b"float32"))
    return _save(tmp_path, Checkpoint.from_state_dict({"w": torch.ones(2), "v": torch.zeros(3)}))


def _tamper_external_link(f, tmp_path):
    del f["modelkit/tensors/w"]
    f["modelkit/tensors/w"] = h5py.ExternalLink(str(tmp_path / "elsewhere.h5"), "/secret")


def _tamper_soft_link(f, tmp_path):
    del f["modelkit/tensors/w"]
    f["modelkit/tensors/w"] = h5py.SoftLink("/modelkit/tensors/v")


def _tamper_external_storage(f, tmp_path):
    (tmp_path / "raw.bin").write_bytes(b"\0" * 8)
    del f["modelkit/tensors/w"]
    f["modelkit/tensors"].create_dataset("w", shape=(2,), dtype="<f4", external=[(str(tmp_path / "raw.bin"), 0, 8)])
    f["modelkit/tensors/w"].attrs.create("dtype", np.bytes_(b"float32"))


def _tamper_group_link(f, tmp_path):
    f["modelkit/tensors/w2"] = h5py.ExternalLink(str(tmp_path / "elsewhere.h5"), "/secret")


def _tamper_shape_bomb(f, tmp_path):
    del f["modelkit/tensors/w"]
    f["modelkit/tensors"].create_dataset("w", shape=(1 << 20, 1 << 20), dtype="<f4", chunks=(1, 1024),
                                         compression="gzip")
    f["modelkit/tensors/w"].attrs.create("dtype", np.bytes_(b"float32"))


def _tamper_dtype_mismatch(f, tmp_path):
    f["modelkit/tensors/w"].attrs.create("dtype", np.bytes_(b"int64"))


def _tamper_unknown_dtype(f, tmp_path):
    f["modelkit/tensors/w"].attrs.create("dtype", np.bytes_(b"os.system"))


def _tamper_vlen_string(f, tmp_path):
    f["modelkit/tensors/w"].attrs["dtype"] = "float32"                 # a variable-length string


def _tamper_newer_version(f, tmp_path):
    f["modelkit"].attrs["version"] = 99


def _tamper_not_a_group(f, tmp_path):
    del f["modelkit/tensors"]
    f["modelkit/tensors"] = np.zeros(3)


def _tamper_foreign_arch(f, tmp_path):
    f["modelkit/metadata"].attrs.create(ARCH_KEY, np.bytes_(b'{"name": "os.system", "config": {}}'))


@pytest.mark.parametrize("tamper, message", [
    (_tamper_external_link, "ExternalLink"),
    (_tamper_soft_link, "SoftLink"),
    (_tamper_external_storage, "another file"),
    (_tamper_group_link, "ExternalLink"),
    (_tamper_shape_bomb, "refusing to allocate"),
    (_tamper_dtype_mismatch, "stored as float32, expected int64"),
    (_tamper_unknown_dtype, "dtype 'os.system'"),
    (_tamper_vlen_string, "not a fixed-length string"),
    (_tamper_newer_version, "newer modelkit"),
    (_tamper_not_a_group, "expected a Group"),
    (_tamper_foreign_arch, "not a registered model"),
], ids=lambda v: getattr(v, "__name__", "")[len("_tamper_"):] if callable(v) else None)
def test_hostile_or_broken_files_are_refused_with_one_line(tamper, message, tmp_path):
    path = _ours(tmp_path)
    with h5py.File(path, "r+") as f:
        tamper(f, tmp_path)
    with pytest.raises(FormatError, match=message) as info:
        modelkit.load(path, format="hdf5").materialize()
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_links_out_of_a_plain_file_are_refused(tmp_path):
    path = _ours(tmp_path).with_name("plain.h5")
    with h5py.File(path, "w") as f:
        f["layers/dense/vars/0"] = np.ones((2, 2), np.float32)
        f["layers/dense/vars/1"] = h5py.ExternalLink(str(tmp_path / "elsewhere.h5"), "/secret")
    with pytest.raises(FormatError, match="ExternalLink"):
        modelkit.load(path)


def _plain_keras_like_file(path):
    with h5py.File(path, "w") as f:
        f.create_group("vars").attrs["name"] = "sequential"
        f["layers/dense/vars/0"] = np.arange(6, dtype=np.float32).reshape(2, 3)
        f["layers/dense/vars/1"] = np.zeros(3, np.float32)
        f["layers/dense_1/vars/0"] = np.arange(6, dtype=">f8").reshape(3, 2)    # big-endian: converted on read
    return path


def test_plain_file_reads_converted_to_native_byte_order(tmp_path):
    ckpt = modelkit.load(_plain_keras_like_file(tmp_path / "plain.h5"))
    assert ckpt.tensors["layers/dense_1/vars/0"].load().tolist() == [[0, 1], [2, 3], [4, 5]]
    assert ckpt.tensors["layers/dense_1/vars/0"].dtype == torch.float64


@pytest.mark.parametrize(("name", "config"), KERAS_CASES, ids=["mlp", "mlp-small", "cnn", "cnn-small"])
def test_the_models_keras_json_loads_in_keras_with_our_weights(keras, name, config, tmp_path):
    """KerasLayout.keras_json() is the architecture Keras's own model_from_json builds; modelkit writes it
    beside the .weights.h5 (m.weights.h5 -> m.json, as Keras users pair them), and the pair loaded the way
    a Keras user loads it predicts what torch does (the layout HDF5 and TF.js share)."""
    model = build(name, config, seed=0).eval()
    path = modelkit.save(Checkpoint.from_module(model), tmp_path / f"{name}.weights.h5")
    layout = load_model_module(name).keras_layers(config_from_dict(name, config))
    with h5py.File(path, "r") as f:            # the file carries the architecture too
        assert json.loads(f.attrs[hdf5.JSON_ATTR]) == layout.keras_json()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.json", f"{name}.weights.h5"]
    assert json.loads((tmp_path / f"{name}.json").read_text()) == layout.keras_json()
    net = keras.models.model_from_json((tmp_path / f"{name}.json").read_text())
    assert len(net.layers) == len(layout.layers)
    net.load_weights(str(path))
    inputs = load_model_module(name).example_inputs(8)
    with torch.no_grad():
        expected = model(inputs).numpy()
    keras_inputs = inputs.permute(0, 2, 3, 1) if name == "cnn" else inputs
    got = keras.ops.convert_to_numpy(net(keras_inputs.numpy(), training=False))
    assert np.abs(got - expected).max() <= KERAS_ATOL
