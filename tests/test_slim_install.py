"""The slim install: `pip install modelkit` in a fresh virtual environment brings no torch, and the
weight-file commands (inspect, scan, convert between weight containers, GGUF block quantization)
work there and write the same bytes as the full install; a command that needs torch names the extra."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slim-install")]


@pytest.fixture(scope="module")
def slim_python(tmp_path_factory) -> Path:
    """A new virtual environment with this checkout's wheel installed (no extras): what `pip install modelkit` does.

    The wheel is built by this interpreter's pip without build isolation (its setuptools is the one `make` installed)
    and installed by the same pip into a venv made without pip of its own (`pip --python`): the same files and the
    same dependency resolution as pip inside the venv, for ~8 s of CPU instead of ~14 s (2026-11-28: the venv's own
    pip took 4 s to set up, and an isolated build installs setuptools into a fresh environment first)."""
    folder = tmp_path_factory.mktemp("slim") / "venv"
    venv.EnvBuilder(with_pip=False).create(folder)
    python = folder / "bin" / "python"
    # Built from a copy of the sources, so the build leaves nothing (build/, *.egg-info) in the checkout.
    source = tmp_path_factory.mktemp("slim-src") / "modelkit"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "runs",
                                                                "__pycache__", "*.so", "tests", "bench", "docs"))
    _reuse_compiled_extensions(source)
    wheels = tmp_path_factory.mktemp("slim-wheel")
    env = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [sys.executable, "-m", "pip"]
    for step in ("wheel", "install"):
        command = ([*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels), str(source)]
                   if step == "wheel" else [*pip, "--python", str(python), "install", "--quiet", *map(str, wheels.glob("*.whl"))])
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=folder, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
    return python


def _reuse_compiled_extensions(source: Path) -> None:
    """The C extensions this checkout's own install built, where setuptools looks for them before compiling
    (build/lib.<platform>-<tag>/, each with its own modification time): setuptools compiles only those older
    than their sources, so the slim install does not spend ~16 s of CPU compiling the same files again."""
    import importlib
    import sysconfig

    build = source / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    for name in ("modelkit.quantizers._gguf_kernels", "modelkit.quantizers._matmul_kernels", "modelkit.storage._transpose"):
        try:
            built = Path(importlib.import_module(name).__file__)
        except ImportError:              # not built here (no compiler): the slim install compiles it, or goes without
            continue
        target = build / Path(*name.split(".")[:-1]) / built.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)


def _run(python: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "modelkit", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("slim-weights")
    g = torch.Generator().manual_seed(0)
    save_file({"model.layers.0.weight": torch.randn(64, 64, generator=g),
               "model.layers.0.bias": torch.randn(64, generator=g),
               "model.norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
               "model.ids": torch.arange(10)}, str(folder / "w.safetensors"), metadata={"format": "pt"})
    torch.save({"model": {"w": torch.randn(8, 32, generator=g).t(), "b": torch.ones(3, dtype=torch.bfloat16)},
                "epoch": 1}, folder / "ckpt.pt")
    from modelkit import export
    from modelkit.models import build

    export(build("mlp", seed=0), folder / "mlp.safetensors")            # a zoo model: its Keras layout for TF.js
    return folder / "w.safetensors"


def test_the_slim_install_has_no_torch(slim_python):
    result = subprocess.run([str(slim_python), "-c", "import torch"], capture_output=True, text=True)
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr
    # from outside the checkout: `python -m` puts the working folder first on sys.path, and the checkout's own
    # modelkit/ folder is not the installed package (its quantizers/ and converters/ live beside it)
    result = _run(slim_python, ["--help"], cwd=slim_python.parent)
    assert result.returncode == 0 and "convert" in result.stdout, result.stderr


# Each command, run in the slim install and in this (full) one: the same output files, byte for byte.
COMMANDS = {
    "to-gguf": (["convert", "{w}", "out.gguf"], ["out.gguf"]),
    "to-hdf5": (["convert", "{w}", "out.h5"], ["out.h5"]),
    "to-npz": (["convert", "{w}", "out.npz"], ["out.npz"]),
    "sharded": (["convert", "{w}", "shards", "--shard-size", "10KB"], ["shards"]),
    "bf16": (["convert", "{w}", "half.safetensors", "--dtype", "bf16"], ["half.safetensors"]),
    "to-tfjs": (["convert", "{m}", "web/model.json"], ["web"]),
    "q4_0": (["quantize", "{w}", "q.gguf", "--scheme", "q4_0"], ["q.gguf"]),
    "from-pth": (["convert", "{p}", "from-pth.safetensors", "--key", "model"], ["from-pth.safetensors"]),
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_weight_commands_give_the_same_bytes_in_the_slim_install(slim_python, weights, tmp_path, name):
    args, outputs = COMMANDS[name]
    args = [a.format(w=weights, p=weights.with_name("ckpt.pt"), m=weights.with_name("mlp.safetensors")) for a in args]
    digests = []
    for python in (slim_python, Path(sys.executable)):
        folder = tmp_path / python.parent.parent.name
        folder.mkdir()
        result = _run(python, args, folder)
        assert result.returncode == 0, result.stderr
        files = sorted(p for out in outputs for p in ([folder / out] if (folder / out).is_file()
                                                      else (folder / out).rglob("*")) if p.is_file())
        digests.append({str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
    assert digests[0] == digests[1]


def test_inspect_and_scan_in_the_slim_install(slim_python, weights, tmp_path):
    result = _run(slim_python, ["inspect", str(weights), "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert {t["name"]: t["dtype"] for t in json.loads(result.stdout)["tensors"]}["model.norm.weight"] == "bfloat16"
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    result = _run(slim_python, ["scan", str(tmp_path / "m.pt")], tmp_path)
    assert result.returncode == 0, result.stderr


def test_a_command_that_needs_torch_names_the_extra(slim_python, weights, tmp_path):
    result = _run(slim_python, ["convert", str(weights), "m.onnx", "--arch", "mlp"], tmp_path)
    assert result.returncode == 2
    assert "pip install 'modelkit[" in result.stderr and "Traceback" not in result.stderr
    result = _run(slim_python, ["convert", str(weights), "m.onnx", "--arch", "mlp", "--json"], tmp_path)
    assert result.returncode == 2 and json.loads(result.stdout)["ok"] is False
