"""The Python API; every CLI command is a thin layer over one function here."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelkit._atomic import atomic_path
from modelkit.checkpoint import ArchSpec, Checkpoint, QuantizedTensor
from modelkit.errors import ConfigError
from modelkit.formats import (
    FORMATS,
    ReadOptions,
    WriteOptions,
    check_readable,
    detect_format,
    format_for_output,
    load_format,
)

if TYPE_CHECKING:
    from torch import nn

PathLike = str | os.PathLike[str]


def _resolve_input(path: PathLike, format: str | None) -> tuple[Path, str]:
    path = Path(path)
    check_readable(path)
    if format is not None:
        load_format(format)  # unknown names raise with "did you mean"
        return path, format
    return path, detect_format(path)


def load(path: PathLike, *, format: str | None = None, trust: bool = False, key: str | None = None,
         dequantize: bool = False) -> Checkpoint:
    """Open a model file as a lazy Checkpoint; no tensor data is read until asked for.

    Args:
        path: The file (or sharded folder) to read.
        format: Force a format instead of detecting it from the content.
        trust: Allow content that runs code when loaded (whole-module pickles, TorchScript).
        key: For nested checkpoints, the entry holding the state_dict ("model", "state_dict").
        dequantize: Return quantized tensors (GGUF block types) as float tensors.

    Example:
        >>> ckpt = modelkit.load("runs/cnn/model.safetensors")       # doctest: +SKIP
        >>> ckpt.arch.name, ckpt.num_parameters                       # doctest: +SKIP
        ('cnn', 38538)
    """
    path, fmt = _resolve_input(path, format)
    return load_format(fmt).read(path, ReadOptions(trust=trust, key=key, dequantize=dequantize))


def save(ckpt: Checkpoint, path: PathLike, *, format: str | None = None, force: bool = False) -> Path:
    """Write `ckpt` to `path` atomically (temporary file, fsync, rename); returns the path.

    The format comes from `format` or the path's suffix. An existing file needs `force=True`.
    """
    path = Path(path)
    fmt = format_for_output(path, format)
    with atomic_path(path, force=force, companions=FORMATS[fmt].companions) as tmp:
        load_format(fmt).write(ckpt, tmp, WriteOptions(final_path=path))
    return path


def load_module(path: PathLike, *, format: str | None = None, arch: ArchSpec | str | None = None,
                trust: bool = False) -> nn.Module:
    """Rebuild a runnable model from a file: its ArchSpec (or `arch`) plus its weights.

    Args:
        path: Any readable model file.
        format: Force a format instead of detecting it.
        arch: A registered model name, an ArchSpec, or a factory "pkg.module:function", for
            files that name no architecture (or to override it).
        trust: Allow content that runs code when loaded (see `load`).

    Raises:
        UnsupportedConversionError: the file names no architecture and none was given.

    Example:
        >>> model = modelkit.load_module("runs/cnn/model.safetensors")   # doctest: +SKIP
    """
    from modelkit.models import instantiate

    ckpt = load(path, format=format, trust=trust)
    if any(isinstance(t, QuantizedTensor) for t in ckpt.tensors.values()):   # quantized layers, not dequantized floats
        from modelkit.quantization import instantiate_quantized

        return instantiate_quantized(ckpt, arch=arch, source=str(path))
    return instantiate(ckpt, arch=arch, source=str(path))


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    quantized: str | None = None     # the scheme, for quantized tensors


@dataclass
class Inspection:
    """What `modelkit inspect` reports: read from headers only, never from tensor data."""

    path: Path
    format: str
    tensors: list[TensorInfo]
    metadata: dict[str, str]
    arch: ArchSpec | None
    file_bytes: int
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def num_parameters(self) -> int:
        import math

        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path), "format": self.format, "file_bytes": self.file_bytes,
            "parameters": self.num_parameters, "tensor_bytes": self.tensor_bytes,
            "tensors": [vars(t) for t in self.tensors],
            "metadata": self.metadata,
            "arch": None if self.arch is None else {"name": self.arch.name, "config": self.arch.config},
            "metrics": self.metrics,
        }


def inspect(path: PathLike, *, format: str | None = None) -> Inspection:
    """Describe a model file (format, tensors, totals, metadata, ArchSpec) without reading tensor data."""
    from modelkit._tensors import dtype_name
    from modelkit.checkpoint import METRICS_KEY

    path, fmt = _resolve_input(path, format)
    ckpt = load_format(fmt).read(path, ReadOptions())
    tensors = [
        TensorInfo(name, dtype_name(t.dtype), list(t.shape), t.nbytes,
                   t.scheme if isinstance(t, QuantizedTensor) else None)
        for name, t in ckpt.tensors.items()
    ]
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    metadata = {k: v for k, v in ckpt.metadata.items() if k != METRICS_KEY}
    return Inspection(path, fmt, tensors, metadata, ckpt.arch, size, ckpt.metrics)


RUNTIMES = ("torch", "onnxruntime")


def evaluate(path_or_model: PathLike | nn.Module, *, split: str | None = None, arch: str | None = None,
             device: str = "auto", runtime: str = "torch") -> dict[str, Any]:
    """Evaluate a reference model (a file or a module) on a split of its own data.

    Returns the metrics plus "model" and "split": accuracy for classifiers; bits per byte,
    perplexity and the unigram baseline for tinylm. The default split is the model's own
    (test for classifiers, validation for tinylm). `runtime="onnxruntime"` runs an ONNX file
    in an onnxruntime session (CPU) instead of rebuilding the torch module from its weights.
    """
    from torch import nn

    from modelkit import distributed, training
    from modelkit.models import load_model_module

    if runtime not in RUNTIMES:
        raise ConfigError(f"unknown runtime {runtime!r}; known: {', '.join(RUNTIMES)}")
    if runtime == "onnxruntime":
        if isinstance(path_or_model, nn.Module) or detect_format(Path(path_or_model)) != "onnx":
            raise ConfigError(f"{path_or_model}: runtime onnxruntime needs an ONNX file; convert it with "
                              "modelkit convert SRC model.onnx first")
        from modelkit.onnx_quantization import session_module

        model, device = session_module(path_or_model), "cpu"
    else:
        model = path_or_model if isinstance(path_or_model, nn.Module) else load_module(path_or_model, arch=arch)
    name = getattr(type(model), "arch", None)
    if name is None:
        raise ConfigError(f"{type(model).__name__} is not a reference model; evaluation needs one of its tasks")
    split = split or load_model_module(name).TASK.default_split
    dev = distributed.resolve_device(device, distributed.DistInfo())
    metrics = training.evaluate(model.to(dev), name, split, device=dev)
    return {"model": name, "split": split, **metrics}


def generate(path: PathLike, prompt: str | bytes, *, max_new_bytes: int = 200, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0) -> bytes:
    """Continue `prompt` with a tinylm checkpoint: greedy by default, sampled when temperature > 0."""
    from modelkit.models.tinylm import TinyLM
    from modelkit.models.tinylm import generate as _generate

    model = load_module(path)
    if not isinstance(model, TinyLM):
        raise ConfigError(f"{path} holds a {type(model).arch} model; generate needs a tinylm checkpoint")
    data = prompt.encode("utf-8") if isinstance(prompt, str) else prompt
    return _generate(model, data, max_new_bytes=max_new_bytes, temperature=temperature, top_k=top_k, seed=seed)


def formats() -> list[str]:
    """The names of the formats this installation knows."""
    return list(FORMATS)
