"""A model is a closed plugin: one module, registered, and every command works with it.

`blobs` below is a model no other file knows: it is written to tmp_path, registered through the
public `register_model` (and once through a faked entry point), and removed again in `finally`.
"""
from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

import modelkit.models as models
from modelkit import metadata
from modelkit.errors import ConfigError, FormatError
from modelkit.formats import FORMATS, WRITABLE
from modelkit.models import MODELS, ArchSpec, build, load_model_module, register_model, unregister_model

PLUGIN = textwrap.dedent('''
    """blobs: three Gaussian blobs in 4-D, Linear-ReLU-Linear (a test's model plugin)."""
    from __future__ import annotations

    from dataclasses import dataclass
    from typing import ClassVar

    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from modelkit.models.plugin import (Axis, ClassificationTask, DistillDefaults, KerasLayer, KerasLayout,
                                        KerasWeight, PruneGroup, PruneSlice, QualityBar, TrainDefaults)


    @dataclass(frozen=True, kw_only=True)
    class BlobsConfig:
        in_features: int = 4
        hidden: int = 32                # a multiple of 32: GGUF blocks fit the head's rows
        num_classes: int = 3


    class Blobs(nn.Module):
        arch: ClassVar[str] = "blobs"

        def __init__(self, config: BlobsConfig | None = None) -> None:
            super().__init__()
            self.config = config or BlobsConfig()
            self.encoder = nn.Linear(self.config.in_features, self.config.hidden)
            self.act = nn.ReLU()
            self.head = nn.Linear(self.config.hidden, self.config.num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.act(self.encoder(x)))


    def blob_split(split: str) -> TensorDataset:
        g = torch.Generator().manual_seed({"train": 0, "val": 1, "test": 2}[split])
        n = 256 if split == "train" else 96
        labels = torch.randint(0, 3, (n,), generator=g)
        centers = 3.0 * torch.eye(3, 4)
        return TensorDataset(centers[labels] + 0.5 * torch.randn(n, 4, generator=g), labels)


    CONFIG = BlobsConfig
    MODEL = Blobs
    TASK = ClassificationTask(blob_split)
    TRAINING = TrainDefaults(epochs=3, batch_size=32, lr=1e-2)


    def example_inputs(batch_size: int = 4, *, seed: int = 0) -> torch.Tensor:
        return torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(seed))


    def keras_layers(config: BlobsConfig) -> KerasLayout:
        return KerasLayout((KerasLayer("dense", (KerasWeight("encoder.weight", "kernel", "dense_kernel"),
                                                 KerasWeight("encoder.bias", "bias"))),
                            KerasLayer("dense", (KerasWeight("head.weight", "kernel", "dense_kernel"),
                                                 KerasWeight("head.bias", "bias")))),
                           f"Sequential([Input((4,)), Dense({config.hidden}, activation='relu'), Dense(3)])")


    def onnx_axes(config: BlobsConfig) -> dict[int, Axis]:
        return {}


    def prune_groups(config: BlobsConfig) -> list[PruneGroup]:
        return [PruneGroup((PruneSlice("encoder.weight", 0, score=True), PruneSlice("encoder.bias", 0),
                            PruneSlice("head.weight", 1)), "hidden")]


    DISTILL = DistillDefaults(temperature=2.0, alpha=0.7)
    STUDENT = {"hidden": 4}
    QUALITY = QualityBar("test", "accuracy", 0.9)
    GGUF = None
''')


@pytest.fixture
def blobs(tmp_path, monkeypatch):
    """The plugin module on sys.path and registered as "blobs"; gone again afterwards."""
    (tmp_path / "mk_blobs_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    register_model("blobs", "mk_blobs_plugin", summary="three Gaussian blobs")
    try:
        yield tmp_path
    finally:
        unregister_model("blobs")
        sys.modules.pop("mk_blobs_plugin", None)


def test_a_new_model_trains_converts_quantizes_prunes_and_distills(blobs, tmp_path):
    from modelkit.pipeline.compress import distill_file, prune_file
    from modelkit.pipeline.convert import convert
    from modelkit.pipeline.measure import evaluate
    from modelkit.pipeline.quantize import quantize
    from modelkit.pipeline.train import TrainConfig, train
    from modelkit.quantizers.prune import PruneConfig

    result = train("blobs", tmp_path / "run", config=TrainConfig(seed=0, device="cpu"))
    assert result.metrics["test"]["accuracy"] >= load_model_module("blobs").QUALITY.bar
    src = result.path
    assert evaluate(src, device="cpu")["accuracy"] == pytest.approx(result.metrics["test"]["accuracy"])

    (tmp_path / "out").mkdir()
    for fmt in sorted(f for f in WRITABLE if not FORMATS[f].folder):    # hf folders hold Hugging Face families
        dst = tmp_path / "out" / f"blobs{FORMATS[fmt].suffixes[0]}"
        report = convert(src, dst, to=fmt)                # verified before it takes its name
        assert dst.exists() and report.to_dict()["target"]["format"] == fmt
    import h5py

    with h5py.File(tmp_path / "out" / "blobs.h5") as f:   # the plugin's Keras mapping was used
        assert f.attrs[metadata.KERAS_LAYOUT_ATTR] == "keras"
        assert f["layers/dense/vars/0"].shape == (4, 32)   # Dense kernel (in, out)

    for scheme, suffix in (("int8", ".safetensors"), ("q8_0", ".gguf")):
        report = quantize(src, tmp_path / f"q-{scheme}{suffix}", scheme=scheme, evaluate=True, latency=False)
        assert report.to_dict()["scheme"] == scheme

    pruned = prune_file(src, tmp_path / "pruned.safetensors", PruneConfig(method="structured", sparsity=0.5),
                        device="cpu")
    assert pruned.parameters["after"] < pruned.parameters["before"]
    assert build("blobs").config.hidden == 32
    from modelkit.pipeline.load import load_module

    assert load_module(tmp_path / "pruned.safetensors").config.hidden == 16

    report = distill_file(src, "blobs", tmp_path / "distill", epochs=1, device="cpu", baseline=False)
    assert report.config["temperature"] == 2.0 and report.config["alpha"] == 0.7      # the plugin's DISTILL
    student = load_module(tmp_path / "distill" / "student" / "model.safetensors")
    assert student.config.hidden == 4                                                 # the plugin's STUDENT


def test_registering_a_name_twice_raises(blobs):
    with pytest.raises(ConfigError, match="registered twice"):
        register_model("blobs", "mk_blobs_plugin")
    with pytest.raises(ConfigError, match="registered twice"):
        register_model("mlp", "mk_blobs_plugin")


def test_a_module_object_registers_and_a_mismatched_name_is_refused(blobs):
    module = load_model_module("blobs")
    with pytest.raises(ConfigError, match="MODEL.arch"):
        register_model("other", module)
    assert "other" not in MODELS
    unregister_model("blobs")
    register_model("blobs", module)
    assert load_model_module("blobs") is module


def test_files_name_only_registered_models(blobs):
    spec = ArchSpec("blobs", {"hidden": 8}).to_json()
    assert ArchSpec.from_json(spec).name == "blobs"
    unregister_model("blobs")
    try:
        with pytest.raises(FormatError, match="not a registered model"):
            ArchSpec.from_json(spec)
    finally:
        register_model("blobs", "mk_blobs_plugin")


def test_a_module_missing_plugin_names_is_refused(tmp_path, monkeypatch):
    (tmp_path / "mk_half_plugin.py").write_text(PLUGIN.replace("GGUF = None", "").replace('"blobs"', '"half"'))
    monkeypatch.syspath_prepend(str(tmp_path))
    register_model("half", "mk_half_plugin")
    try:
        with pytest.raises(ConfigError, match="does not define GGUF"):
            load_model_module("half")
    finally:
        unregister_model("half")
        sys.modules.pop("mk_half_plugin", None)


def test_the_zoo_cannot_be_unregistered():
    with pytest.raises(ConfigError):
        unregister_model("mlp")


class _FakeEntryPoint:
    def __init__(self, name: str, value: str) -> None:
        self.name, self.value, self.dist = name, value, None


def test_entry_points_are_read_once_on_the_first_lookup(tmp_path, monkeypatch):
    (tmp_path / "mk_blobs_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    len(MODELS)                                              # the real registry has read its entry points
    calls = []

    def entry_points(*, group: str):
        calls.append(group)
        return [_FakeEntryPoint("blobs", "mk_blobs_plugin")]

    monkeypatch.setattr(importlib.import_module("importlib.metadata"), "entry_points", entry_points)
    registry = models._Registry(models._ZOO)
    monkeypatch.setattr(models, "MODELS", registry)
    try:
        assert calls == []                                   # nothing read before a lookup
        assert "blobs" in models.MODELS and calls == [models.ENTRY_POINT_GROUP]
        assert sorted(models.MODELS) == ["blobs", "cnn", "mlp", "tinylm"] and len(calls) == 1
        assert build("blobs", {"hidden": 5}).encoder.out_features == 5
        with pytest.raises(ConfigError, match="registered twice"):
            register_model("blobs", "mk_blobs_plugin")
    finally:
        sys.modules.pop("mk_blobs_plugin", None)
    assert "blobs" not in MODELS                             # the real registry never saw it


def test_import_modelkit_and_scan_do_not_read_entry_points():
    import subprocess

    code = ("import importlib.metadata as md, sys\n"
            "calls = []\n"
            "md.entry_points = lambda **kw: calls.append(kw) or []\n"
            "import modelkit, modelkit.scan\n"
            "from click.testing import CliRunner\nfrom modelkit.cli import main\n"
            "r = CliRunner().invoke(main, ['scan', sys.argv[1]])\n"
            "print(r.exit_code in (0, 1), len(calls), 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, str(Path(__file__))], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "0", "False"]


def test_metadata_keys_keep_their_values():
    # These strings are in files on disk: changing one orphans every file written before.
    assert {k: v for k, v in vars(metadata).items() if k.isupper()} == {
        "ARCH_KEY": "modelkit.arch", "METRICS_KEY": "modelkit.metrics", "ALIASES_KEY": "modelkit.aliases",
        "QUANTIZED_KEY": "modelkit.quantized", "QUANT_KEY": "modelkit.quantization", "PRUNE_KEY": "modelkit.prune",
        "DISTILL_KEY": "modelkit.distill", "TRAIN_KEY": "modelkit.train", "NAMES_KEY": "modelkit.names",
        "VERSION_KEY": "modelkit.version", "TENSORS_KEY": "modelkit.tensors", "META_PREFIX": "modelkit.meta.",
        "KERAS_LAYOUT_ATTR": "modelkit.keras_layout", "KERAS_NOTE_ATTR": "modelkit.keras_note",
        "KERAS_JSON_ATTR": "modelkit.keras_json",
        "TORCHSCRIPT_EXTRA": "modelkit.json", "TORCHSCRIPT_EXPORT_KEY": "modelkit.torchscript.export",
        "PT2_EXTRA": "modelkit.json",
        "PTH_SOURCE_KEY": "modelkit.pth.source", "PTH_METADATA_ENTRY": "__modelkit__", "PTH_LAYOUT": "modelkit.pth/1",
        "NPZ_MEMBER": "modelkit.json", "NPZ_LAYOUT": "modelkit.npz/1",
        "TF_KEYS_KEY": "modelkit.tensorflow.keys", "TF_SOURCE_KEY": "modelkit.tensorflow.source",
        "GGML_SOURCE_KEY": "modelkit.ggml.source", "FILE_TYPE_KEY": "modelkit.file_type",
    }
