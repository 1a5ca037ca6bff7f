"""The format table, detection, and each format's round trip (parametrized from FORMATS)."""
from __future__ import annotations

import struct

import pytest
import torch

import modelkit
from modelkit.checkpoint import ArchSpec, Checkpoint, LazyTensor
from modelkit.errors import (
    ConfigError,
    FormatError,
    OutputExistsError,
    UnknownFormatError,
    UnsupportedConversionError,
)
from modelkit.formats import FORMATS, detect_format, format_for_output
from modelkit.models import build


def _write(tmp_path, fmt, ckpt, name="m"):
    return modelkit.save(ckpt, tmp_path / f"{name}{FORMATS[fmt].suffixes[0]}", format=fmt)


def _refused_without_keras_layout(fmt, small_model, tmp_path) -> bool:
    """A Keras-model format (.keras) given a model Keras cannot express (tinylm): refused before writing, naming
    the first layer without a Keras counterpart."""
    if not FORMATS[fmt].keras_model or type(small_model).arch != "tinylm":
        return False
    with pytest.raises(UnsupportedConversionError, match=r"layer model\.layers\.0\.input_layernorm \(RMSNorm\)"):
        _write(tmp_path, fmt, Checkpoint.from_module(small_model))
    assert list(tmp_path.iterdir()) == []
    return True


# (format, model) pairs left to a run by hand: converting tinylm to OpenVINO IR takes about 3 s (OpenVINO traces
# the model; measured 2026-11-25: weights bit-exact, outputs 8.9e-8 from torch's), a quarter of a helper's budget.
SLOW = {("openvino", "tinylm")}


def _skip_slow(fmt, small_model) -> None:
    if (fmt, type(small_model).arch) in SLOW:
        pytest.skip(f"{type(small_model).arch} as {fmt} is slow to write (test_formats.SLOW); mlp and cnn cover the format")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """written(fmt, small_model) -> (checkpoint, path): the small model with metadata {"note": "hello"} saved
    once per (format, model) in this module; the round-trip and rebuild tests read the same file (a graph
    format's exporter takes seconds a model). One xdist group, so one worker holds both tests' files."""
    cache: dict[tuple[str, str], tuple[Checkpoint, object]] = {}

    def write(fmt: str, model: torch.nn.Module):
        key = (fmt, type(model).arch)
        if key not in cache:
            ckpt = Checkpoint.from_module(model, metadata={"note": "hello"})
            cache[key] = ckpt, _write(tmp_path_factory.mktemp(f"{fmt}-{key[1]}"), fmt, ckpt)
        return cache[key]
    return write


written_group = pytest.mark.xdist_group("format-files")


@written_group
def test_round_trip_is_bit_exact(fmt, small_model, tmp_path, written):
    if _refused_without_keras_layout(fmt, small_model, tmp_path):
        return
    _skip_slow(fmt, small_model)
    ckpt, path = written(fmt, small_model)
    assert detect_format(path) == fmt
    back = modelkit.load(path)
    assert back.arch == ckpt.arch
    assert back.metadata["note"] == "hello"
    original, loaded = ckpt.materialize(), back.materialize()
    assert list(loaded) == list(original) or sorted(loaded) == sorted(original)
    for name, tensor in original.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool])
def test_round_trip_keeps_dtypes(fmt, dtype, tmp_path):
    tensor = (torch.arange(24).reshape(2, 3, 4) % 7).to(dtype)
    ckpt = Checkpoint.from_state_dict({"t": tensor, "scalar": torch.tensor(3.5).to(dtype)})
    if FORMATS[fmt].has_graph or FORMATS[fmt].keras_model:  # plain tensors with no ArchSpec are no graph, no Keras model
        with pytest.raises(UnsupportedConversionError, match="--arch"):
            _write(tmp_path, fmt, ckpt)
        assert list(tmp_path.iterdir()) == []
        return
    path = _write(tmp_path, fmt, ckpt)
    back = modelkit.load(path).materialize()
    assert back["t"].dtype == dtype and torch.equal(back["t"], tensor)
    assert back["scalar"].shape == ()


@written_group
def test_load_module_rebuilds_the_model(fmt, small_model, tmp_path, written):
    if _refused_without_keras_layout(fmt, small_model, tmp_path):
        return
    _skip_slow(fmt, small_model)
    _, path = written(fmt, small_model)
    rebuilt = modelkit.load_module(path)
    from modelkit.models import load_model_module

    inputs = load_model_module(type(small_model).arch).example_inputs(3)
    modelkit.assert_same_outputs(small_model, rebuilt, inputs)          # atol 0: identical


def test_safetensors_files_load_in_the_reference_library(small_model, tmp_path):
    from safetensors.torch import load_file, safe_open

    ckpt = Checkpoint.from_module(small_model)
    path = _write(tmp_path, "safetensors", ckpt)
    loaded = load_file(path)
    for name, tensor in ckpt.materialize().items():
        assert torch.equal(loaded[name], tensor)
    with safe_open(path, framework="pt") as f:
        assert f.metadata()["format"] == "pt"
        assert ArchSpec.from_json(f.metadata()["modelkit.arch"]) == ckpt.arch


def test_safetensors_read_is_lazy(tmp_path):
    """Opening reads only the header: bytes changed after opening show up when a tensor is loaded."""
    path = _write(tmp_path, "safetensors", Checkpoint.from_state_dict({"w": torch.zeros(4)}))
    ckpt = modelkit.load(path)
    data = bytearray(path.read_bytes())
    data[-16:] = struct.pack("<4f", 1, 2, 3, 4)
    path.write_bytes(bytes(data))
    assert ckpt.tensors["w"].load().tolist() == [1, 2, 3, 4]


def test_save_refuses_existing_output_without_force(fmt, tmp_path):
    ckpt = Checkpoint.from_module(build("mlp", seed=0))
    path = _write(tmp_path, fmt, ckpt)
    with pytest.raises(OutputExistsError, match="--force"):
        _write(tmp_path, fmt, ckpt)
    zeros = {k: torch.zeros_like(v) for k, v in ckpt.materialize().items()}
    modelkit.save(Checkpoint.from_state_dict(zeros, arch=ckpt.arch), path, force=True)
    assert all(torch.equal(v, zeros[k]) for k, v in modelkit.load(path).materialize().items())


def _failing(ckpt: Checkpoint, message: str) -> Checkpoint:
    """`ckpt` with its last tensor raising when read, as a failing disk would."""
    def boom():
        raise RuntimeError(message)

    tensors = dict(ckpt.tensors)
    name = list(tensors)[-1]
    tensors[name] = LazyTensor(tensors[name].dtype, tensors[name].shape, boom)
    return Checkpoint(tensors, dict(ckpt.metadata), ckpt.arch)


def test_failed_write_leaves_no_file(fmt, tmp_path):
    ckpt = _failing(Checkpoint.from_module(build("mlp", seed=0)), "disk full")
    target = tmp_path / f"out{FORMATS[fmt].suffixes[0]}"
    with pytest.raises(RuntimeError, match="disk full"):
        modelkit.save(ckpt, target)
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_old_file(fmt, tmp_path):
    ckpt = Checkpoint.from_module(build("mlp", seed=0))
    path = _write(tmp_path, fmt, ckpt)
    before, files = path.read_bytes(), sorted(p.name for p in tmp_path.iterdir())     # the output and its sidecars
    with pytest.raises(RuntimeError):
        modelkit.save(_failing(ckpt, "interrupted"), path, force=True)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == files


def test_output_format_from_suffix_or_to():
    assert format_for_output("x.safetensors") == "safetensors"
    with pytest.raises(UnknownFormatError, match="did you mean 'safetensors'"):
        format_for_output("x.bin", "safetensor")
    with pytest.raises(ConfigError, match="pass --to"):
        format_for_output("x.weird")


def _zip_of(members: dict[str, bytes]) -> bytes:
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return out.getvalue()


@pytest.mark.parametrize("head, seen", [
    (b"", "an empty file"),
    (b"GGUF\x03\x00\x00\x00", "a GGUF file"),
    (_zip_of({"notes.txt": b"hello"}), "a zip archive"),
    (b"\x80\x02}q\x00.", "a pickle (protocol 2)"),
    (b"\x89HDF\r\n\x1a\nxx", "an HDF5 file"),
    (b"hello world\n", "text"),
])
def test_unknown_input_names_what_was_seen_and_the_known_formats(tmp_path, head, seen):
    path = tmp_path / "mystery.bin"
    path.write_bytes(head)
    with pytest.raises(FormatError) as info:
        detect_format(path)
    message = str(info.value)
    assert seen in message and "known formats: " + ", ".join(FORMATS) in message
    assert "\n" not in message


@pytest.mark.parametrize("name, members", [("model.pt", {"archive/data.pkl": b"\x80\x02}q\x00." * 40}),
                                           ("model.pt2", {"archive/models/model.json": b"{}" * 80})])
def test_a_cut_zip_says_its_directory_is_unreadable_and_what_to_do(tmp_path, name, members):
    path = tmp_path / name
    path.write_bytes(_zip_of(members)[:120])
    with pytest.raises(FormatError, match=r"its zip directory cannot be read \(.*truncated\); copy or export the file"):
        detect_format(path)


def test_missing_file_is_a_one_line_error(tmp_path):
    with pytest.raises(FormatError, match="no such file"):
        modelkit.load(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("blob", [
    struct.pack("<Q", 10**12) + b"{}",                                     # header longer than the file
    struct.pack("<Q", 2) + b"{]",                                          # not JSON
    struct.pack("<Q", 60) + b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}    ',  # data missing
])
def test_malformed_safetensors_is_a_format_error(tmp_path, blob):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(FormatError):
        modelkit.load(path, format="safetensors").materialize()


def test_detect_does_not_trust_the_suffix(tmp_path, small_model):
    path = _write(tmp_path, "safetensors", Checkpoint.from_module(small_model))
    renamed = path.rename(tmp_path / "weights.bin")
    assert detect_format(renamed) == "safetensors"
    assert modelkit.load(renamed).arch == Checkpoint.from_module(small_model).arch


def test_build_from_file_spec_only_names_registered_models(tmp_path):
    ckpt = Checkpoint.from_module(build("mlp", seed=0))
    path = _write(tmp_path, "safetensors", ckpt)
    raw = path.read_bytes().replace(b'\\"name\\":\\"mlp\\"', b'\\"name\\":\\"os.\\"')  # same length
    assert raw != path.read_bytes()
    path.write_bytes(raw)
    with pytest.raises(FormatError, match="not a registered model"):
        modelkit.load(path)
