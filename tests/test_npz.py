"""npz (converters/npz.py): what numpy writes reads bit-exact, what modelkit writes np.load reads bit-exact,
and hostile or broken archives end in one-line errors without unpickling anything."""
from __future__ import annotations

import builtins
import io
import json
import struct
import subprocess
import sys
import warnings
import zipfile
import zlib

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import modelkit
from modelkit.checkpoint import ALIASES_KEY, ArchSpec, Checkpoint, LazyTensor
from modelkit.cli import EXIT_ERROR, EXIT_OK, main
from modelkit.converters import npz
from modelkit.errors import FormatError, ParseError, UnsupportedConversionError
from modelkit.formats import detect_format
from modelkit.models import build
from modelkit.parse import zipdir

# Every kind of array numpy writes that is a tensor: orders, byte orders, 0-d, empty, each dtype.
_G = np.random.default_rng(0)
NUMPY_ARRAYS = {
    "model.embed.weight": _G.standard_normal((16, 8)).astype(np.float32),
    "fortran": np.asfortranarray(_G.standard_normal((5, 7))),
    "fortran.3d": np.asfortranarray(np.arange(24, dtype=np.int16).reshape(2, 3, 4)),
    "big.f4": np.array([1.5, -0.0, np.inf, np.nan], dtype=">f4"),
    "big.i8": np.arange(-3, 3, dtype=">i8").reshape(2, 3),
    "big.fortran": np.asfortranarray(np.arange(12, dtype=">u4").reshape(3, 4)),
    "scalar": np.float64(3.25),
    "empty": np.zeros((0, 3), dtype=np.int64),
    "mask": np.array([True, False, True]),
    "steps": np.arange(7, dtype=np.int64),
    "half": _G.standard_normal(9).astype(np.float16),
    "bytes": np.arange(250, 256, dtype=np.uint8),
    "int8": np.array([-128, 0, 127], dtype=np.int8),
    "complex": np.array([1 + 2j, -3j], dtype=np.complex64),
}


def _little_c(array: np.ndarray) -> np.ndarray:
    """What modelkit gives for a numpy array: little-endian, C order, same values and bits."""
    return np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"))).reshape(array.shape)


def _same_bits(ours: np.ndarray, expected: np.ndarray) -> bool:
    return ours.shape == expected.shape and ours.dtype == expected.dtype and ours.tobytes() == expected.tobytes()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A torch tensor's bytes, whatever its dtype, shape and strides."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed], ids=["savez", "savez_compressed"])
def test_files_numpy_writes_read_bit_exact(tmp_path, save):
    path = tmp_path / "arrays.npz"
    save(path, **NUMPY_ARRAYS)
    assert detect_format(path) == "npz"
    ckpt = modelkit.load(path)
    assert list(ckpt.tensors) == list(NUMPY_ARRAYS)
    for name, array in NUMPY_ARRAYS.items():
        entry = ckpt.tensors[name]
        expected = _little_c(array)
        assert entry.shape == array.shape and entry.dtype.numpy == expected.dtype, name
        ours = entry.array()
        assert _same_bits(ours, expected), name
        assert ours.flags.c_contiguous and ours.flags.writeable, name
        if array.dtype != np.complex64:
            assert torch.equal(_bits(entry.load()), _bits(torch.from_numpy(expected))), name
        # Stored little-endian C-order members are views of the file, with a span for file-to-file copies.
        mapped = save is np.savez and array.dtype.byteorder != ">" and (array.flags.c_contiguous or array.ndim < 2)
        assert (entry.span is not None) == mapped, name


def test_compressed_members_are_read_into_aligned_arrays(tmp_path):
    np.savez_compressed(tmp_path / "c.npz", w=np.arange(1000, dtype=np.float64))
    array = modelkit.load(tmp_path / "c.npz").tensors["w"].array()
    assert array.ctypes.data % 64 == 0 and np.array_equal(array, np.arange(1000, dtype=np.float64))


def _every_dtype_checkpoint() -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(4, 8, generator=g), "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "f16": torch.randn(5, 2, generator=g).half(), "bf16": torch.randn(6, 3, generator=g).to(torch.bfloat16),
        "e4m3": torch.randn(16, generator=g).to(torch.float8_e4m3fn), "e5m2": torch.randn(4, 4, generator=g).to(torch.float8_e5m2),
        "i64": torch.arange(-5, 5), "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "i16": torch.tensor([-7, 7], dtype=torch.int16), "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8), "bool": torch.tensor([[True, False], [False, True]]),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "strided": torch.randn(8, 6, generator=g).t(),
    }
    return Checkpoint.from_state_dict(tensors), tensors


def _raw(tensor: torch.Tensor) -> np.ndarray:
    """The stored bits numpy should see: the value for dtypes numpy has, the raw uint bits for the others."""
    tensor = tensor.contiguous()
    if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        return tensor.view(torch.uint16 if tensor.dtype == torch.bfloat16 else torch.uint8).numpy()
    return tensor.numpy()


def test_np_load_reads_every_array_modelkit_writes(tmp_path):
    ckpt, tensors = _every_dtype_checkpoint()
    path = modelkit.save(ckpt, tmp_path / "all.npz")
    with np.load(path) as arrays:                         # allow_pickle=False: numpy's safe default
        assert arrays.files == [*tensors, npz.MEMBER]     # modelkit.json: the true dtypes of bf16 and float8
        for name, tensor in tensors.items():
            assert _same_bits(arrays[name], _raw(tensor)), name
        document = json.loads(arrays[npz.MEMBER])         # np.load gives a non-.npy member's raw bytes
    assert document == {"layout": "modelkit.npz/1", "metadata": {},
                        "dtypes": {"bf16": "bfloat16", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}}
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None                  # every CRC-32 right
        for info in archive.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            if info.filename.endswith(".npy"):
                expected = io.BytesIO()
                np.save(expected, _raw(tensors[info.filename[:-4]]))
                assert archive.read(info) == expected.getvalue(), info.filename     # byte for byte numpy's .npy


def test_elements_start_64_byte_aligned_in_the_file(tmp_path):
    ckpt, _ = _every_dtype_checkpoint()
    path = modelkit.save(ckpt, tmp_path / "all.npz")
    for entry in modelkit.load(path).tensors.values():
        assert entry.span is not None and entry.span.offset % 64 == 0


def test_modelkit_dtypes_round_trip_bit_exact(tmp_path):
    ckpt, tensors = _every_dtype_checkpoint()
    back = modelkit.load(modelkit.save(ckpt, tmp_path / "all.npz")).materialize()
    assert list(back) == list(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(_bits(back[name]), _bits(tensor)), name


def test_plain_arrays_get_no_json_member(tmp_path):
    ckpt = Checkpoint({"w": LazyTensor.of_array(np.ones(3, np.float32), "float32")})
    path = modelkit.save(ckpt, tmp_path / "plain.npz")
    with zipfile.ZipFile(path) as archive:
        assert archive.namelist() == ["w.npy"]
    assert detect_format(path) == "npz"


def test_metadata_arch_and_tied_tensors_round_trip(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    arch = ArchSpec("mlp", {"hidden": [3]})
    ckpt = Checkpoint.from_module(model, metadata={"note": "héllo", "empty": ""}, arch=arch)
    path = modelkit.save(ckpt, tmp_path / "tied.npz")
    with np.load(path) as arrays:
        assert arrays.files == ["0.weight", npz.MEMBER]                      # stored once
    back = modelkit.load(path)
    assert back.arch == arch and back.metadata["note"] == "héllo" and back.metadata["empty"] == ""
    assert json.loads(back.metadata[ALIASES_KEY]) == {"1.weight": "0.weight"}
    assert back.tensors["1.weight"] is back.tensors["0.weight"]
    assert torch.equal(back.materialize()["1.weight"], model[0].weight)


def test_reference_model_rebuilds_and_writes_the_same_bytes_twice(tmp_path):
    model = build("mlp", seed=0)
    first = modelkit.save(Checkpoint.from_module(model), tmp_path / "a.npz")
    second = modelkit.save(Checkpoint.from_module(model), tmp_path / "b.npz")
    assert first.read_bytes() == second.read_bytes()                       # fixed timestamps, nothing random
    rebuilt = modelkit.load_module(first)
    from modelkit.models import load_model_module

    modelkit.assert_same_outputs(model, rebuilt, load_model_module("mlp").example_inputs(3))


def test_quantized_weights_round_trip(tmp_path):
    source = modelkit.save(Checkpoint.from_module(build("mlp", seed=0)), tmp_path / "m.safetensors")
    modelkit.quantize(source, tmp_path / "q.safetensors", scheme="int8")
    report = modelkit.convert(tmp_path / "q.safetensors", tmp_path / "q.npz")
    assert report.verify["passed"]
    quantized = modelkit.load(tmp_path / "q.npz")
    original = modelkit.load(tmp_path / "q.safetensors")
    assert {n: type(t).__name__ for n, t in quantized.tensors.items()} == \
           {n: type(t).__name__ for n, t in original.tensors.items()}
    assert any(type(t).__name__ == "QuantizedTensor" for t in quantized.tensors.values())


# ---------------------------------------------------------------------------------------------
# zip64

def test_zip64_fields_when_sizes_offsets_and_counts_pass_the_limits(tmp_path, monkeypatch):
    """A > 4 GiB test would take minutes: the limits are lowered so every member, offset and the
    directory take the zip64 path, which numpy (through zipfile) and modelkit both read."""
    arrays = {f"t{i}": np.arange(10 * i + 1, dtype=np.float32) for i in range(5)}
    ckpt = Checkpoint({k: LazyTensor.of_array(v, "float32") for k, v in arrays.items()}, {"k": "v"})
    plain = modelkit.save(ckpt, tmp_path / "plain.npz").read_bytes()
    assert b"PK\x06\x06" not in plain                                       # small files need no zip64
    monkeypatch.setattr(npz, "_ZIP64_LIMIT", 0)
    monkeypatch.setattr(npz, "_COUNT_LIMIT", 0)
    path = modelkit.save(ckpt, tmp_path / "zip64.npz")
    raw = path.read_bytes()
    assert b"PK\x06\x06" in raw and b"PK\x06\x07" in raw                    # zip64 end record and locator
    assert raw[-22:] == b"PK\x05\x06" + bytes(4) + b"\xff" * 12 + bytes(2)  # every end-record field deferred
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
        infos = archive.infolist()
        assert all(struct.unpack_from("<H", info.extra)[0] == 1 for info in infos)      # zip64 extra fields
        assert [info.header_offset for info in infos] == sorted(info.header_offset for info in infos)
    with np.load(path) as loaded:
        assert all(np.array_equal(loaded[k], v) for k, v in arrays.items())
    back = modelkit.load(path)
    assert all(np.array_equal(back.tensors[k].array(), v) for k, v in arrays.items()) and back.metadata == {"k": "v"}


def test_numpy_zip64_members_read(tmp_path):
    """numpy writes every member with a zip64 extra field (force_zip64): those are the files above."""
    np.savez(tmp_path / "n.npz", a=np.arange(3))
    local = (tmp_path / "n.npz").read_bytes()[:64]
    assert struct.unpack_from("<H", local, 30 + len("a.npy"))[0] == 1       # the local zip64 extra
    assert modelkit.load(tmp_path / "n.npz").tensors["a"].array().tolist() == [0, 1, 2]


# ---------------------------------------------------------------------------------------------
# Detection

def test_detect_claims_npz_and_nothing_else(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.ones(2))
    assert npz.detect(tmp_path / "a.npz")
    torch.save({"w": torch.ones(2)}, tmp_path / "t.pt")
    assert not npz.detect(tmp_path / "t.pt") and detect_format(tmp_path / "t.pt") == "pth"
    renamed = tmp_path / "t.npz"
    renamed.write_bytes((tmp_path / "t.pt").read_bytes())
    assert detect_format(renamed) == "pth"                                   # content, not the suffix
    with zipfile.ZipFile(tmp_path / "other.npz", "w") as archive:
        archive.writestr("x.npy", b"")
        archive.writestr("readme.txt", b"hi")
    np.savez(tmp_path / "empty.npz")                                         # no members at all
    for path in (tmp_path / "other.npz", tmp_path / "empty.npz", tmp_path / "missing.npz", tmp_path):
        assert not npz.detect(path)


# ---------------------------------------------------------------------------------------------
# Hostile and broken files

class _TouchesAFile:
    """Unpickling this runs `open(path, "w")`: a harmless stand-in for code a pickle can run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return builtins.exec, (f"open({self.path!r}, 'w').close()",)


def test_object_arrays_are_refused_without_unpickling(tmp_path):
    marker = tmp_path / "pwned"
    np.savez(tmp_path / "evil.npz", w=np.ones(3), payload=np.array([_TouchesAFile(str(marker))], dtype=object))
    # The payload is live: numpy with allow_pickle=True runs it (in a child process, on a copy with another marker).
    live = tmp_path / "live"
    np.savez(tmp_path / "live.npz", payload=np.array([_TouchesAFile(str(live))], dtype=object))
    subprocess.run([sys.executable, "-c", f"import numpy as np; np.load({str(tmp_path / 'live.npz')!r}, "
                                          "allow_pickle=True)['payload']"], check=True)
    assert live.exists()
    assert detect_format(tmp_path / "evil.npz") == "npz"
    with pytest.raises(FormatError, match="pickled Python objects.*never unpickles") as info:
        modelkit.load(tmp_path / "evil.npz")
    assert str(tmp_path / "evil.npz") in str(info.value) and "'payload'" in str(info.value)
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "evil.npz"), str(tmp_path / "out.safetensors")])
    assert result.exit_code == EXIT_ERROR and "never unpickles" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def _write_zip(path, members: list[tuple[str, bytes]], *, compress: bool = False):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as archive, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")                   # zipfile warns of the duplicate names some tests want
        for name, data in members:
            archive.writestr(name, data)
    return path


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def _declare_size(path, name: str, size: int, crc: int | None = None) -> None:
    """Rewrite a member's uncompressed size (and CRC-32) in its local header and central directory entry."""
    raw = bytearray(path.read_bytes())
    entry = next(e for e in zipdir.read_directory(bytes(raw)) if e.filename == name)
    struct.pack_into("<I", raw, entry.header_offset + 22, size)
    struct.pack_into("<I", raw, entry.directory_offset + 24, size)
    if crc is not None:
        struct.pack_into("<I", raw, entry.header_offset + 14, crc)
        struct.pack_into("<I", raw, entry.directory_offset + 16, crc)
    path.write_bytes(bytes(raw))


def test_a_member_shorter_than_its_header_says_is_refused_on_opening(tmp_path):
    whole = _npy(np.arange(100, dtype=np.float32))
    path = _write_zip(tmp_path / "short.npz", [("w.npy", whole[:-16])])
    with pytest.raises(FormatError, match=r"header describes 400 bytes of elements .* the member holds 384") as info:
        modelkit.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("cut", [10, 200, -30, -1])
def test_truncated_archives_are_one_line_format_errors(tmp_path, cut):
    path = modelkit.save(Checkpoint({"w": LazyTensor.of_array(np.arange(64, dtype=np.float32), "float32")},
                                    {"note": "x"}), tmp_path / "m.npz")
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(FormatError) as info:
        modelkit.load(path, format="npz").materialize()
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_changed_byte_fails_the_crc_when_loaded(tmp_path):
    path = modelkit.save(Checkpoint({"w": LazyTensor.of_array(np.arange(64, dtype=np.float32), "float32")}),
                         tmp_path / "m.npz")
    ckpt = modelkit.load(path)
    raw = bytearray(path.read_bytes())
    raw[ckpt.tensors["w"].span.offset + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="does not match its CRC-32"):
        modelkit.load(path).tensors["w"].array()


@pytest.mark.parametrize("elements", [4, 10_000])
def test_a_member_that_expands_past_its_declared_size_stops_there(tmp_path, elements):
    """A deflate stream of 64 MiB behind a header and directory that say `elements` float32s: found
    while reading the header (a small member) or the elements (a larger one), never decompressed whole."""
    small = _npy(np.zeros(elements, dtype=np.float32))
    path = _write_zip(tmp_path / "bomb.npz", [("w.npy", small + bytes(64 << 20))], compress=True)
    _declare_size(path, "w.npy", len(small), zlib.crc32(small))
    assert path.stat().st_size < 200_000
    with pytest.raises(FormatError, match="expands past its declared size 40128|expands past its declared size 144") \
            as info:
        modelkit.load(path).tensors["w"].array()
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_directory_claiming_more_than_deflate_can_is_refused_before_decompressing(tmp_path):
    header = npz.npy_header("<f4", (125_000_000,))                      # 500 MB of elements, as numpy writes it
    path = _write_zip(tmp_path / "claim.npz", [("w.npy", header + bytes(16))], compress=True)
    _declare_size(path, "w.npy", len(header) + 500_000_000)
    with pytest.raises(FormatError, match="claims to expand .* to 500000128, more than deflate can") as info:
        modelkit.load(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(("members", "message"), [
    ([("w.npy", _npy(np.ones(2))), ("w.npy", _npy(np.zeros(2)))], "holds 'w.npy' twice"),
    ([("w.npy", _npy(np.ones(2))), ("notes.txt", b"hello")], "'notes.txt' is not a .npy array"),
    ([("w.npy", b"not an array at all, no magic")], "no \\\\x93NUMPY magic"),
    ([("w.npy", _npy(np.array(["a", "bc"])))], "not a tensor dtype"),
    ([("w.npy", _npy(np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")])))], "structured array"),
    ([("w.npy", _npy(np.ones(2))), (npz.MEMBER, b"[1, 2]")], "not in modelkit's layout"),
    ([("w.npy", _npy(np.ones(2, np.float32))),
      (npz.MEMBER, json.dumps({"layout": "modelkit.npz/1", "dtypes": {"w": "bfloat16"}}).encode())],
     "says 'w' is bfloat16, stored as uint16, but the array is float32"),
    ([("w.npy", _npy(np.ones(2, np.float32))),
      (npz.MEMBER, json.dumps({"layout": "modelkit.npz/1", "dtypes": {"v": "bfloat16"}}).encode())],
     "dtype of 'v', which the archive does not hold"),
    ([("w.npy", _npy(np.ones(2))), (npz.MEMBER, b"[" * 100_000 + b"]" * 100_000)], "not valid UTF-8 JSON"),
    *[([("w.npy", _npy(np.ones(2))), (npz.MEMBER, json.dumps({"layout": "modelkit.npz/1", "metadata": {
        key: "[" * 100_000 + "]" * 100_000}}).encode())], f"the {key} entry is not valid JSON")
      for key in ("modelkit.arch", "modelkit.aliases", "modelkit.quantized")],
])
def test_malformed_archives_say_what_is_wrong(tmp_path, members, message):
    path = _write_zip(tmp_path / "bad.npz", members)
    with pytest.raises(FormatError, match=message) as info:
        modelkit.load(path, format="npz")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("name", "message"), [
    ("../escape", "climbs out"), ("/abs", "absolute path"), ("w.npy", "ambiguous in np.load"),
    (npz.MEMBER, "ambiguous in np.load"), ("bad\ud800", "not valid Unicode"),
])
def test_names_a_zip_cannot_hold_safely_are_refused_before_writing(tmp_path, name, message):
    ckpt = Checkpoint({name: LazyTensor.of_array(np.ones(2, np.float32), "float32")})
    with pytest.raises(UnsupportedConversionError, match=message):
        modelkit.save(ckpt, tmp_path / "x.npz")
    assert list(tmp_path.iterdir()) == []


def test_names_with_dots_slashes_and_unicode_round_trip(tmp_path):
    names = ["model.layers.0.weight", "a/b", "ünïcode.wéight", ""]
    ckpt = Checkpoint({n: LazyTensor.of_array(np.full(2, i, np.int32), "int32") for i, n in enumerate(names)})
    path = modelkit.save(ckpt, tmp_path / "names.npz")
    with np.load(path) as arrays:
        assert arrays.files == names and [arrays[n].tolist() for n in names] == [[i, i] for i in range(len(names))]
    assert list(modelkit.load(path).tensors) == names


# ---------------------------------------------------------------------------------------------
# The parse layer underneath: bounded reads of members

def test_read_start_decompresses_only_the_start(tmp_path):
    data = _npy(np.arange(10_000, dtype=np.int64))
    path = _write_zip(tmp_path / "c.npz", [("a.npy", data)], compress=True)
    buf = path.read_bytes()
    (entry,) = zipdir.read_directory(buf)
    assert zipdir.read_start(buf, entry, 128) == data[:128]
    out = bytearray(entry.file_size)
    zipdir.read_into(buf, entry, out)
    assert out == data
    with pytest.raises(ValueError):
        zipdir.read_into(buf, entry, bytearray(10))
    broken = buf.replace(struct.pack("<I", entry.CRC), struct.pack("<I", entry.CRC ^ 1))
    (entry,) = zipdir.read_directory(broken)
    with pytest.raises(ParseError, match="CRC-32"):
        zipdir.read_into(broken, entry, out)


# ---------------------------------------------------------------------------------------------
# The command line

def test_cli_converts_safetensors_to_npz_and_back_bit_exact(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt, tensors = _every_dtype_checkpoint()
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(tmp_path / "w.safetensors"), metadata={"format": "pt"})
    runner = CliRunner()
    for src, dst in (("w.safetensors", "w.npz"), ("w.npz", "back.safetensors")):
        result = runner.invoke(main, ["convert", str(tmp_path / src), str(tmp_path / dst)])
        assert result.exit_code == EXIT_OK, result.output
        assert "verified: weights bit-exact" in result.stdout
    back = load_file(str(tmp_path / "back.safetensors"))
    assert sorted(back) == sorted(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(_bits(back[name]), _bits(tensor)), name
    inspected = runner.invoke(main, ["inspect", str(tmp_path / "w.npz"), "--json"])
    doc = json.loads(inspected.stdout)
    assert {t["name"]: t["dtype"] for t in doc["tensors"]}["bf16"] == "bfloat16"
