"""Weight files never wait for torch: inspect, convert and scan of weight containers run with torch
unimportable, and write the same bytes as with torch."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

# Run the CLI with torch unimportable: `import torch` raises ModuleNotFoundError.
_NO_TORCH = "import sys\nsys.modules['torch'] = None\nfrom modelkit.cli import run\nrun(sys.argv[1:])\n"

def _modelkit(args: list[str], cwd: Path, *, torch_free: bool) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", _NO_TORCH, *args] if torch_free else [sys.executable, "-m", "modelkit", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A safetensors file of every kind of tensor a weight file holds, written by torch."""
    folder = tmp_path_factory.mktemp("torch-free")
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 32, generator=g)
    tensors = {
        "model.embed.weight": torch.randn(32, 64, generator=g),
        "model.proj.weight": base.t().contiguous(),                      # was a strided view
        "model.half": torch.randn(64, generator=g).half(),
        "model.bf16": torch.randn(4, 64, generator=g).to(torch.bfloat16),
        "model.steps": torch.arange(7, dtype=torch.int64),
        "model.mask": torch.tensor([True, False, True]),
        "model.scalar": torch.tensor(3.5),
    }
    save_file(tensors, str(folder / "w.safetensors"), metadata={"format": "pt"})
    return folder / "w.safetensors"


# (output name, extra options): each conversion run with and without torch must give the same bytes.
CONVERSIONS = [
    ("out.gguf", []),
    ("out.h5", []),
    ("out.npz", []),
    ("out-bf16.npz", ["--dtype", "bf16"]),
    ("out-bf16.safetensors", ["--dtype", "bf16"]),
    ("out-f16.gguf", ["--dtype", "f16"]),
    ("shards", ["--shard-size", "4KB"]),
]


@pytest.mark.parametrize(("name", "options"), CONVERSIONS, ids=[c[0] for c in CONVERSIONS])
def test_convert_without_torch_writes_the_same_bytes(weights, tmp_path, name, options):
    """Run a second apart, so a timestamp in the output would show (HDF5 object headers can hold them)."""
    with_torch, without = tmp_path / "torch", tmp_path / "none"
    with_torch.mkdir(), without.mkdir()
    for folder, torch_free in ((with_torch, False), (without, True)):
        result = _modelkit(["convert", str(weights), name, *options], folder, torch_free=torch_free)
        assert result.returncode == 0, result.stderr
        assert "verified: weights bit-exact" in result.stdout
        time.sleep(1.1 if not torch_free else 0)
    files = sorted(p.relative_to(with_torch) for p in with_torch.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(without) for p in without.rglob("*") if p.is_file())
    for relative in files:
        digest = [hashlib.sha256((root / relative).read_bytes()).hexdigest() for root in (with_torch, without)]
        assert digest[0] == digest[1], f"{relative} differs with and without torch"


def test_round_trip_without_torch_keeps_every_tensor(weights, tmp_path):
    for src, dst in ((weights, "a.gguf"), ("a.gguf", "b.h5"), ("b.h5", "a.npz"), ("a.npz", "c.safetensors"),
                     ("c.safetensors", "d")):
        result = _modelkit(["convert", str(src), dst, *(["--shard-size", "4KB"] if dst == "d" else [])],
                           tmp_path, torch_free=True)
        assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file

    expected = load_file(str(weights))
    index = json.loads((tmp_path / "d" / "model.safetensors.index.json").read_text())
    got = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(load_file(str(tmp_path / "d" / shard)))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name].view(torch.uint8) if tensor.dim() else got[name], tensor.view(torch.uint8)
                           if tensor.dim() else tensor), name


def test_npz_without_torch_is_what_np_load_and_safetensors_read(weights, tmp_path):
    """safetensors -> npz -> safetensors with torch unimportable: np.load reads the npz (bfloat16 as its
    uint16 bits), and the safetensors file that comes back holds the original tensors bit for bit."""
    for src, dst in ((weights, "w.npz"), ("w.npz", "back.safetensors")):
        result = _modelkit(["convert", str(src), dst], tmp_path, torch_free=True)
        assert result.returncode == 0, result.stderr
        assert "verified: weights bit-exact" in result.stdout
    expected = {name: tensor.numpy() for name, tensor in _torch_bits(weights).items()}
    with np.load(tmp_path / "w.npz") as arrays:
        assert [f for f in arrays.files if f != "modelkit.json"] == sorted(expected)
        for name, array in expected.items():
            assert arrays[name].dtype == array.dtype and arrays[name].tobytes() == array.tobytes(), name
    back = {name: tensor.numpy() for name, tensor in _torch_bits(tmp_path / "back.safetensors").items()}
    assert sorted(back) == sorted(expected)
    for name, array in expected.items():
        assert back[name].dtype == array.dtype and back[name].tobytes() == array.tobytes(), name


def _torch_bits(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors, with bfloat16 as its uint16 bits (what numpy holds)."""
    from safetensors.torch import load_file

    return {name: t.view(torch.uint16) if t.dtype == torch.bfloat16 else t for name, t in load_file(str(path)).items()}


@pytest.mark.parametrize("source", ["w.safetensors", "w.gguf", "w.npz"])
def test_inspect_without_torch_matches_inspect_with_torch(weights, tmp_path, source):
    if source != "w.safetensors":
        assert _modelkit(["convert", str(weights), source], tmp_path, torch_free=False).returncode == 0
        path = tmp_path / source
    else:
        path = weights
    docs = []
    for torch_free in (False, True):
        result = _modelkit(["inspect", str(path), "--json"], tmp_path, torch_free=torch_free)
        assert result.returncode == 0, result.stderr
        docs.append(json.loads(result.stdout))
    assert docs[0] == docs[1]
    assert {t["name"]: t["dtype"] for t in docs[1]["tensors"]}["model.bf16"] == "bfloat16"


FLOATS = ("float32", "float16", "bfloat16", "float64")


@pytest.mark.parametrize("target", FLOATS)
@pytest.mark.parametrize("source", FLOATS)
def test_dtype_casts_give_torchs_bits(source, target):
    """convert --dtype casts with numpy: the bits equal torch's .to() for every pair, over magnitudes from
    1e-8 to 1e8, ties, overflow, signed zeros and NaN, as arrays and as 0-d tensors."""
    from modelkit.storage.dtypes import DTYPES, cast_float, to_numpy

    g = torch.Generator().manual_seed(1)
    scales = torch.logspace(-8, 8, 200_000, dtype=torch.float64)[torch.randperm(200_000, generator=g)]
    specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e300, -1e300,
                             1e-300, 1.00390625, 1.01171875, 3.4e38, 65520.0, 1e-40], dtype=torch.float64)
    values = torch.cat([torch.randn(200_000, generator=g, dtype=torch.float64) * scales, specials]).to(getattr(torch, source))
    # torch's own NaN bits depend on where an element falls in its vector loop (and so on the thread
    # count): a NaN must stay a NaN; every other element must have torch's bits exactly.
    nan = values.to(torch.float32).isnan().numpy()
    ours = cast_float(to_numpy(values), DTYPES[source], DTYPES[target])
    want = to_numpy(values.to(getattr(torch, target)))
    assert ours[~nan].tobytes() == want[~nan].tobytes()
    assert torch.from_numpy(ours).view(getattr(torch, target))[torch.from_numpy(nan)].isnan().all()
    for value in values[-len(specials):]:
        scalar = cast_float(to_numpy(value.clone()), DTYPES[source], DTYPES[target])
        assert scalar.shape == ()
        if not value.isnan():
            assert scalar.tobytes() == to_numpy(value.to(getattr(torch, target))).tobytes(), value


def test_dtype_conversion_writes_what_torch_casts(weights, tmp_path):
    """Not only the same bytes with and without torch: the torch-free --dtype output holds torch's cast."""
    from safetensors.torch import load_file

    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        result = _modelkit(["convert", str(weights), f"{dtype}.safetensors", "--dtype", dtype], tmp_path, torch_free=True)
        assert result.returncode == 0, result.stderr
        got, source = load_file(str(tmp_path / f"{dtype}.safetensors")), load_file(str(weights))
        for name, tensor in source.items():
            want = tensor.to(torch_dtype) if tensor.is_floating_point() else tensor
            assert got[name].dtype == want.dtype and torch.equal(got[name].view(-1).view(torch.uint8) if want.dim()
                                                                  else got[name], want.view(-1).view(torch.uint8)
                                                                  if want.dim() else want), name


def test_a_graph_target_without_torch_names_the_extra(weights, tmp_path):
    result = _modelkit(["convert", str(weights), "m.onnx", "--arch", "mlp"], tmp_path, torch_free=True)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "modelkit[torch]" in result.stderr or "modelkit[onnx]" in result.stderr


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_quantize_a_weight_file_to_gguf_without_torch(weights, tmp_path, scheme):
    """No architecture, no model, no torch: 2-D weights become blocks byte-identical to gguf-py's,
    the rest is stored as it was, and the file is the same as with torch."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import quantize as gguf_quantize
    from safetensors.torch import load_file

    for torch_free in (True, False):
        name = f"{scheme}-{torch_free}.gguf"
        result = _modelkit(["quantize", str(weights), name, "--scheme", scheme, "--json"], tmp_path, torch_free=torch_free)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)["reports"][0]
        assert report["stats"]["quantized_tensors"] == 2 and report["verify"]["method"] == "bit-exact"   # embed, proj
    assert (tmp_path / f"{scheme}-True.gguf").read_bytes() == (tmp_path / f"{scheme}-False.gguf").read_bytes()
    source = load_file(str(weights))
    stored = {t.name: t for t in GGUFReader(tmp_path / f"{scheme}-True.gguf").tensors}
    for name in ("model.embed.weight", "model.proj.weight"):
        expected = gguf_quantize(source[name].numpy(), GGMLQuantizationType[scheme.upper()])
        assert stored[name].tensor_type == GGMLQuantizationType[scheme.upper()]
        assert np.array_equal(np.asarray(stored[name].data).reshape(expected.shape), expected), name
    assert stored["model.half"].tensor_type == GGMLQuantizationType.F16          # 1-D: kept as it is


def test_quantize_a_weight_file_with_nan_names_the_tensor(tmp_path):
    bad = torch.zeros(4, 64)
    bad[2, 5] = float("nan")
    save_file({"layer.weight": bad}, str(tmp_path / "nan.safetensors"))
    result = _modelkit(["quantize", "nan.safetensors", "nan.gguf", "--scheme", "q8_0"], tmp_path, torch_free=True)
    assert result.returncode == 2
    assert "layer.weight" in result.stderr and "NaN" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "nan.gguf").exists()


@pytest.fixture(scope="module")
def training_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A torch.save training checkpoint: the model's state dict (bf16, a strided view, int64, a tie)
    nested beside optimizer state and Python values."""
    folder = tmp_path_factory.mktemp("torch-free-pth")
    g = torch.Generator().manual_seed(2)
    embed = torch.randn(32, 64, generator=g)
    state = {"embed.weight": embed, "head.weight": embed, "proj.weight": torch.randn(64, 32, generator=g).t(),
             "norm.weight": torch.randn(64, generator=g).to(torch.bfloat16), "steps": torch.arange(5)}
    torch.save({"model": state, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}, "epoch": 3},
               folder / "ckpt.pt")
    return folder / "ckpt.pt", state


def test_a_training_checkpoint_becomes_safetensors_without_torch(training_checkpoint, tmp_path):
    """No unpickler runs and torch is not importable: the tensors equal torch.load's, bit for bit."""
    from safetensors.torch import load_file

    path, state = training_checkpoint
    result = _modelkit(["convert", str(path), "out.safetensors", "--key", "model"], tmp_path, torch_free=True)
    assert result.returncode == 0, result.stderr
    got = load_file(str(tmp_path / "out.safetensors"))
    loaded = torch.load(path, weights_only=True)["model"]
    assert got.keys() <= loaded.keys() == state.keys()
    for name, tensor in loaded.items():
        back = got[name] if name in got else got["embed.weight"]         # a tie is stored once
        assert back.dtype == tensor.dtype and back.shape == tensor.shape
        assert torch.equal(back.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
    result = _modelkit(["inspect", str(path), "--key", "model", "--json"], tmp_path, torch_free=True)
    assert result.returncode == 0, result.stderr
    assert {t["name"] for t in json.loads(result.stdout)["tensors"]} == set(state)


@pytest.mark.parametrize("source", ["float", "uint8"])
def test_tfjs_models_convert_without_torch_to_the_same_bytes(tmp_path, source):
    """Reading a TF.js Layers model needs no torch: ours (torch names and layouts back from the manifest,
    float or TF.js's uint8 weights) converts to safetensors with torch unimportable, byte for byte what the
    run with torch writes; and writing one (the zoo model's Keras layout, checked against the checkpoint's
    shapes layer to layer where torch cannot build the model) gives the same folder as the run with torch."""
    import modelkit
    from modelkit.models import build

    modelkit.export(build("mlp", seed=0), tmp_path / "mlp.safetensors")
    model = tmp_path / "web" / "model.json"
    if source == "uint8":
        modelkit.quantize(tmp_path / "mlp.safetensors", model, scheme="tfjs-uint8")
    else:
        modelkit.convert(tmp_path / "mlp.safetensors", model)
        written = _modelkit(["convert", "mlp.safetensors", "again/model.json"], tmp_path, torch_free=True)
        assert written.returncode == 0, written.stderr
        assert sorted(p.name for p in (tmp_path / "again").iterdir()) == sorted(p.name for p in model.parent.iterdir())
        assert all((tmp_path / "again" / p.name).read_bytes() == p.read_bytes() for p in model.parent.iterdir())
    for torch_free in (False, True):
        result = _modelkit(["convert", str(model), f"out-{torch_free}.safetensors"], tmp_path, torch_free=torch_free)
        assert result.returncode == 0, result.stderr
        assert "verified: weights bit-exact" in result.stdout
    assert (tmp_path / "out-True.safetensors").read_bytes() == (tmp_path / "out-False.safetensors").read_bytes()
