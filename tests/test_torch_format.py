"""modelkit's own reader of torch.save files (modelkit.parse.torch_format) and the pth converter on top of it:
the bytes it gives are torch.load's, bit for bit, without torch; every claim of the file is checked first."""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import pickle
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from modelkit.checkpoint import ALIASES_KEY
from modelkit.errors import FormatError, ParseError
from modelkit.formats import ReadOptions, load_format
from modelkit.parse import torch_format
from modelkit.storage.dtypes import DTYPES, LEGACY_STORAGE_DTYPES, to_numpy
from modelkit.testing import payloads

pth = load_format("pth")     # modelkit.converters.pth
ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ["zip", "legacy"]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "float32": torch.randn(5, 7, generator=g),
        "float16": torch.randn(33, generator=g).half(),
        "bfloat16": torch.randn(4, 9, generator=g).bfloat16(),
        "float8_e4m3fn": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "int64": torch.arange(-5, 20),
        "bool": torch.rand(3, 5, generator=g) > 0.5,
        "uint8": torch.randint(0, 255, (2, 3, 4), dtype=torch.uint8, generator=g),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(3, 5, generator=g).t(),
        "strided": base[:, ::3],
        "offset_slice": base[2:4],
        "expanded": torch.arange(3.0).expand(4, 3),
        "parameter": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
    }


CASES = sorted(_tensors())


def _save(obj, path: Path, layout: str) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=layout == "zip")
    return path


def _bits(tensor: torch.Tensor) -> bytes:
    return to_numpy(tensor.detach().contiguous()).tobytes()


@pytest.fixture(scope="module", params=LAYOUTS)
def saved(request, tmp_path_factory):
    """(layout, path, what torch.load gives) for one file holding every case."""
    layout = request.param
    tensors = _tensors()
    path = _save(tensors, tmp_path_factory.mktemp("torch-format") / f"cases-{layout}.pt", layout)
    try:
        reference = torch.load(path, weights_only=True)
    except AttributeError:
        # torch 2.13's legacy loader cannot read UntypedStorage (float8 and uint16-64 are saved as one):
        # `storage_type.dtype` does not exist. Its values are the saved tensors themselves.
        assert layout == "legacy"
        reference = tensors
    return layout, path, reference


@pytest.mark.parametrize("name", CASES)
def test_tensor_bits_equal_torch_load(saved, name):
    layout, path, reference = saved
    parsed = torch_format.read(path)
    record = parsed.value[name]
    assert isinstance(record, torch_format.TensorRecord)
    array = parsed.array(record)
    expected = reference[name]
    assert array.shape == tuple(expected.shape)
    assert array.dtype == DTYPES[str(expected.dtype).removeprefix("torch.")].numpy
    assert array.tobytes() == _bits(expected)
    assert record.parameter == isinstance(expected, torch.nn.Parameter)


@pytest.mark.parametrize("name", CASES)
def test_converter_gives_the_same_tensors_with_spans_where_bytes_lie_in_the_file(saved, name):
    layout, path, reference = saved
    entry = pth.read(path, ReadOptions()).tensors[name]
    expected = reference[name]
    loaded = entry.load()
    assert loaded.dtype == expected.dtype and loaded.shape == expected.shape
    assert _bits(loaded) == _bits(expected)
    contiguous = expected.is_contiguous() and expected.numel() > 0
    assert (entry.span is not None) == contiguous
    if entry.span is not None:
        with path.open("rb") as f:
            f.seek(entry.span.offset)
            assert f.read(entry.span.nbytes) == _bits(expected)


def test_contiguous_tensors_are_views_of_a_private_mapping(tmp_path):
    path = _save({"w": torch.ones(1000)}, tmp_path / "w.pt", "zip")
    before = path.read_bytes()
    array = torch_format.read(path).array(torch_format.read(path).value["w"])
    assert array.base is not None and array.flags.writeable
    array += 1                                                         # copy-on-write: the file keeps its bytes
    assert path.read_bytes() == before


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tied_weights_come_back_as_aliases(tmp_path, layout):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    path = _save(model.state_dict(), tmp_path / "tied.pt", layout)
    ckpt = pth.read(path)
    assert ckpt.metadata[ALIASES_KEY] == '{"1.weight": "0.weight"}'
    assert list(ckpt.tensors) == ["0.weight", "1.weight"]
    assert torch.equal(ckpt.tensors["1.weight"].load(), model[0].weight)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nested_training_checkpoint_with_key(tmp_path, layout):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    args = {"lr": 0.01, "name": "run-1", "layers": [3, 4, 2], "betas": (0.9, 0.999), "flag": True, "none": None}
    path = _save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3, "args": args},
                 tmp_path / "train.ckpt", layout)
    parsed = torch_format.read(path).value
    assert parsed["epoch"] == 3 and parsed["args"] == args
    state = optimizer.state_dict()
    assert parsed["optimizer"]["param_groups"] == state["param_groups"]
    assert isinstance(parsed["optimizer"]["state"][0]["exp_avg"], torch_format.TensorRecord)
    ckpt = pth.read(path, ReadOptions(key="model"))
    assert ckpt.metadata[pth.SOURCE_KEY] == "model"
    for name, tensor in model.state_dict().items():
        assert _bits(ckpt.tensors[name].load()) == _bits(tensor)
    with pytest.raises(FormatError, match=r"--key 'modle' names no state_dict here; top-level entries: "
                                          r"model \(OrderedDict\), optimizer \(dict\), epoch \(int\), args \(dict\)"):
        pth.read(path, ReadOptions(key="modle"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ordered_dict_keeps_its_metadata(tmp_path, layout):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    path = _save(model.state_dict(), tmp_path / "sd.pt", layout)
    parsed = torch_format.read(path).value
    assert isinstance(parsed, OrderedDict)
    assert parsed._metadata == torch.load(path, weights_only=True)._metadata
    assert parsed._metadata["1"] == {"version": 2}


def test_other_values_are_plain_python_or_opaque(tmp_path):
    path = _save({"size": torch.Size([2, 3]), "device": torch.device("cuda", 1), "bytes": b"\x00\xff",
                  "set": {1, 2}, "namespace": argparse.Namespace(lr=0.1), "dtype": torch.float16}, tmp_path / "x.pt",
                 "zip")
    value = torch_format.read(path).value
    assert value["size"] == (2, 3) and value["bytes"] == b"\x00\xff" and value["set"] == {1, 2}
    assert value["device"] == torch_format.Device("cuda", 1)
    assert isinstance(value["namespace"], torch_format.Opaque) and value["namespace"].what == "argparse.Namespace"
    assert isinstance(value["dtype"], torch_format.Opaque) and value["dtype"].what == "torch.float16"
    assert "argparse.Namespace" in torch_format.read(path).globals


def test_legacy_storage_tables_agree_with_storage_dtypes():
    for name, dtype in LEGACY_STORAGE_DTYPES.items():
        assert torch_format.STORAGE_DTYPES[name] == dtype.name
    for name, dtype in DTYPES.items():
        assert np.dtype(torch_format.DTYPE_BITS[name]) == dtype.numpy, name


# ---------------------------------------------------------------------------------------------
# Without torch: the reader runs in a process where `import torch` fails, and gives the same bytes.

_NO_TORCH = """
import hashlib, json, sys
sys.modules["torch"] = None
from modelkit.parse import torch_format
out = {}
for path in sys.argv[1:]:
    parsed = torch_format.read(path)
    out[path] = {name: hashlib.sha256(parsed.array(t).tobytes()).hexdigest()
                 for name, t in parsed.value.items() if isinstance(t, torch_format.TensorRecord)}
assert "torch" not in sys.modules or sys.modules["torch"] is None
print(json.dumps(out))
"""


def test_reader_needs_no_torch(tmp_path):
    tensors = _tensors()
    paths = [str(_save(tensors, tmp_path / f"{layout}.pt", layout)) for layout in LAYOUTS]
    result = subprocess.run([sys.executable, "-c", _NO_TORCH, *paths], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    expected = {name: hashlib.sha256(_bits(t)).hexdigest() for name, t in tensors.items()}
    assert json.loads(result.stdout) == {path: expected for path in paths}


def test_converter_read_needs_no_torch_once_its_layers_are_torch_free(tmp_path):
    probe = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; import modelkit.checkpoint, "
                            "modelkit.storage.tensors, modelkit.storage.quantized_layout"], capture_output=True)
    if probe.returncode:
        pytest.skip("modelkit.checkpoint / storage still import torch (issue 20's migration of those layers)")
    path = _save(_tensors(), tmp_path / "m.pt", "zip")
    code = ("import sys; sys.modules['torch'] = None\nfrom pathlib import Path\nfrom modelkit.formats import load_format\n"
            f"ckpt = load_format('pth').read(Path({str(path)!r}))\nprint(len([t.array() for t in ckpt.tensors.values()]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(len(_tensors()))


# ---------------------------------------------------------------------------------------------
# Bounds: hand-made archives whose pickles claim what their records do not hold.

class _Storage:
    """A storage for the crafted pickle: pickled as the persistent id ('storage', cls, key, 'cpu', numel)."""

    def __init__(self, key: str, numel: int, cls=None) -> None:
        self.key, self.numel, self.cls = key, numel, cls or torch.FloatStorage


class _Tensor:
    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple) -> None:
        self.args = (storage, offset, size, stride, False, OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", obj.cls, obj.key, "cpu", obj.numel)
        return None


def _crafted(tmp_path: Path, obj, records: dict[str, bytes], *, byteorder: bytes | None = b"little",
             compress: bool = False) -> Path:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(obj)
    path = tmp_path / "crafted.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", buffer.getvalue())
        zf.writestr("archive/version", b"3\n")
        if byteorder is not None:
            zf.writestr("archive/byteorder", byteorder)
        for key, data in records.items():
            zf.writestr(f"archive/data/{key}", data, zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED)
    return path


_FOUR = np.arange(4, dtype="<f4").tobytes()


def test_crafted_archive_reads_like_torch(tmp_path):
    path = _crafted(tmp_path, {"w": _Tensor(_Storage("0", 4), 1, (2,), (2,))}, {"0": _FOUR})
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.tensor([1.0, 3.0]))
    parsed = torch_format.read(path)
    assert parsed.array(parsed.value["w"]).tolist() == [1.0, 3.0]


class _TensorV1(_Tensor):
    """torch._utils._rebuild_tensor(storage, offset, size, stride): what torch before 1.0 wrote."""

    def __reduce__(self):
        return torch._utils._rebuild_tensor, self.args[:4]


def test_first_rebuild_function_reads_like_torch(tmp_path):
    path = _crafted(tmp_path, {"w": _TensorV1(_Storage("0", 4), 1, (3,), (1,))}, {"0": _FOUR})
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.tensor([1.0, 2.0, 3.0]))
    parsed = torch_format.read(path)
    assert parsed.array(parsed.value["w"]).tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(("tensor", "records", "message"), [
    (_Tensor(_Storage("0", 4), 0, (3,), (2,)), {"0": _FOUR}, r"reaches element 4 of storage '0', which holds 4"),
    (_Tensor(_Storage("0", 4), 3, (2,), (1,)), {"0": _FOUR}, r"at offset 3 reaches element 4 of storage '0'"),
    (_Tensor(_Storage("0", 8), 0, (8,), (1,)), {"0": _FOUR}, r"claims 8 float32 elements \(32 bytes\) but its record "
                                                            r"holds 16 bytes"),
    (_Tensor(_Storage("0", 4), 0, (-1, 2), (2, 1)), {"0": _FOUR}, r"size \[-1, 2\] has a negative entry"),
    (_Tensor(_Storage("0", 4), 0, (2, 2), (-2, 1)), {"0": _FOUR}, r"stride \[-2, 1\] has a negative entry"),
    (_Tensor(_Storage("0", 4), 0, (2, 2), (1,)), {"0": _FOUR}, r"size \[2, 2\] and stride \[1\] differ"),
    (_Tensor(_Storage("0", 4), -1, (2,), (1,)), {"0": _FOUR}, r"storage offset -1"),
    (_Tensor(_Storage("7", 4), 0, (4,), (1,)), {"0": _FOUR}, r"storage '7' has no record archive/data/7"),
    (_Tensor(_Storage("0", 1), 0, (2**31,), (0,)), {"0": _FOUR}, r"refusing to expand a view beyond"),
])
def test_claims_beyond_the_records_are_parse_errors(tmp_path, tensor, records, message):
    path = _crafted(tmp_path, {"w": tensor}, records)
    with pytest.raises(ParseError, match=message) as error:
        torch_format.read(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(FormatError, match=message):
        pth.read(path)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("keep", [0.3, 0.6, 0.95])
def test_truncated_files_are_parse_errors(tmp_path, layout, keep):
    path = _save({"w": torch.randn(64, 64), "b": torch.randn(64)}, tmp_path / "t.pt", layout)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ParseError) as error:
        torch_format.read(path)
    assert str(path) in str(error.value)


def test_big_endian_archives_are_byte_swapped(tmp_path):
    values = np.array([1.5, -2.0, 3.25, 1e-3], dtype="<f4")
    path = _crafted(tmp_path, {"w": _Tensor(_Storage("0", 4), 0, (4,), (1,))},
                    {"0": values.astype(">f4").tobytes()}, byteorder=b"big")
    parsed = torch_format.read(path)
    record = parsed.value["w"]
    assert parsed.array(record).tobytes() == values.tobytes() and parsed.span(record) is None
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.from_numpy(values))


def test_deflated_records_are_inflated_and_checked(tmp_path):
    path = _crafted(tmp_path, {"w": _Tensor(_Storage("0", 4), 0, (2, 2), (1, 2))}, {"0": _FOUR}, compress=True)
    parsed = torch_format.read(path)
    assert parsed.array(parsed.value["w"]).tolist() == [[0.0, 2.0], [1.0, 3.0]]
    assert parsed.span(parsed.value["w"]) is None


def test_unknown_byteorder_and_storage_classes_are_refused(tmp_path):
    tensor = _Tensor(_Storage("0", 4), 0, (4,), (1,))
    with pytest.raises(ParseError, match="byteorder record says b'middle'"):
        torch_format.read(_crafted(tmp_path, {"w": tensor}, {"0": _FOUR}, byteorder=b"middle"))
    odd = _Tensor(_Storage("0", 4, cls=argparse.Namespace), 0, (4,), (1,))
    with pytest.raises(ParseError, match="argparse.Namespace, which is not a torch storage class"):
        torch_format.read(_crafted(tmp_path, {"w": odd}, {"0": _FOUR}))


@pytest.mark.parametrize(("content", "message"), [
    (b"", "an empty file"),
    (b"not a model at all", "the pickle is malformed"),
    (b"\x80\x02K\x07.", "no magic number"),
    (payloads.torchscript_zip("x = 1\n"), "a TorchScript archive"),
    (payloads.zip_bytes({"a.npy": b"\x93NUMPY"}), "without <folder>/data.pkl"),
])
def test_other_files_are_parse_errors(tmp_path, content, message):
    path = tmp_path / "x.pt"
    path.write_bytes(content)
    with pytest.raises(ParseError, match=message):
        torch_format.read(path)


def test_a_zip_without_storages_is_just_its_value(tmp_path):
    path = tmp_path / "x.pt"
    path.write_bytes(payloads.torch_zip(pickle.dumps({"a": [1, 2.5, "x"]}, protocol=2)))
    assert torch_format.read(path).value == {"a": [1, 2.5, "x"]}


# ---------------------------------------------------------------------------------------------
# TorchScript archives (read_script): the module tree as ScriptObjects, nothing imported or called.

def _script_archive(path: Path) -> Path:
    import warnings

    class Holder(torch.nn.Module):     # attribute types inferred: List[int], Dict[str, Tensor], List[float]
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(2, 3)
            self.sizes, self.table, self.scale = [1, 2], {"a": torch.ones(2)}, [1.5]

        def forward(self, x):
            return self.inner(x) * self.sizes[0] * self.scale[0] + self.table["a"].sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(Holder()), str(path))
    return path


def test_script_archive_is_a_tree_of_script_objects(tmp_path):
    parsed = torch_format.read_script(_script_archive(tmp_path / "s.pt"))
    root = parsed.value
    assert parsed.layout == "torchscript" and isinstance(root, torch_format.ScriptObject)
    assert root.qualname.startswith("__torch__.") and root.qualname.endswith("Holder")
    assert root.state["sizes"] == [1, 2] and root.state["scale"] == [1.5] and root.state["training"] is True
    assert isinstance(root.state["table"]["a"], torch_format.TensorRecord)               # restore_type_tag's value
    inner = root.state["inner"]
    assert inner.qualname.startswith("__torch__.torch.nn.modules.linear.") and inner.qualname.endswith(".Linear")
    assert parsed.array(inner.state["weight"]).shape == (3, 2)
    assert "torch.jit._pickle.build_intlist" in parsed.globals


@pytest.mark.parametrize(("layout", "message"), [("zip", "not a TorchScript archive"), ("legacy", "not a zip archive")])
def test_read_script_refuses_torch_save_files(tmp_path, layout, message):
    path = _save({"w": torch.ones(2)}, tmp_path / "x.pt", layout)
    with pytest.raises(ParseError, match=message) as error:
        torch_format.read_script(path)
    assert str(path) in str(error.value)


def test_torch_save_reader_sees_script_classes_as_opaque():
    """Outside read_script a `__torch__` object is Opaque, as any other class."""
    data = b"\x80\x02c__torch__.m\nM\n)\x81}X\x01\x00\x00\x00aK\x01sb."    # NEWOBJ, BUILD {'a': 1}
    parsed = torch_format.parse(payloads.torch_zip(data))
    assert isinstance(parsed.value, torch_format.Opaque) and parsed.value.what == "__torch__.m.M"
    script = torch_format.parse_script(payloads.torchscript_zip("x = 1\n", data_pkl=data))
    assert script.value.qualname == "__torch__.m.M" and script.value.state == {"a": 1}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_long_string_referred_to_many_times_is_decoded_once(tmp_path, layout, monkeypatch):
    """2,000 memo references to one 1 MiB string: one decoded copy, not 2 GB; and the total of
    distinct long strings is capped."""
    meta = "x" * (1 << 20)
    path = _save({"w": torch.ones(2), "meta": [meta] * 2000}, tmp_path / "m.pt", layout)
    value = torch_format.read(path).value
    assert value["meta"][0] == meta and len({id(s) for s in value["meta"]}) == 1
    monkeypatch.setattr(torch_format, "_MAX_DECODED", 3 << 20)
    path = _save({"w": torch.ones(2), "meta": ["a" * (1 << 20), "b" * (1 << 20), "c" * (1 << 20), "d" * (1 << 20)]},
                 tmp_path / "n.pt", layout)
    with pytest.raises(ParseError, match="long strings add up to more than"):
        torch_format.read(path)


def test_huge_dimensions_of_an_empty_tensor_are_refused():
    with pytest.raises(ParseError, match="reaches past"):
        torch_format._ints((0, 2**62, 2**62), "size", 0)
    assert torch_format._ints((0, 2**20, 3), "size", 0) == (0, 2**20, 3)
