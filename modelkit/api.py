"""The Python API; every CLI command is a thin layer over one function here.

Loading, saving and measuring live in modelkit.pipeline; they are named here too, so users and
the CLI find every entry point in one module."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelkit.checkpoint import ArchSpec, QuantizedTensor
from modelkit.errors import ConfigError
from modelkit.formats import (
    FORMATS,
    RUNTIMES,
    ReadOptions,
    load_format,
)
from modelkit.pipeline.load import load, load_module, resolve_input, save

__all__ = ["RUNTIMES", "Inspection", "TensorInfo", "evaluate", "formats", "generate", "inspect", "load",
           "load_module", "save"]

if TYPE_CHECKING:
    from modelkit.pipeline.measure import evaluate


def __getattr__(name: str) -> Any:
    """`evaluate` runs models (torch): imported on first use, so inspect and convert never load torch."""
    if name == "evaluate":
        from modelkit.pipeline.measure import evaluate

        return evaluate
    raise AttributeError(f"module 'modelkit.api' has no attribute {name!r}")

PathLike = str | os.PathLike[str]


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
    model: dict[str, Any] | None = None        # a Hugging Face family's summary (modelkit.models._hf.describe)

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
            "model": self.model,
        }


def inspect(path: PathLike, *, format: str | None = None, trust: bool = False, key: str | None = None) -> Inspection:
    """Describe a model file (format, tensors, totals, metadata, ArchSpec) without reading tensor data.

    `format`, `trust` and `key` mean what they mean for `load`.
    """
    from modelkit.checkpoint import METRICS_KEY
    from modelkit.storage.dtypes import dtype_name

    path, fmt = resolve_input(path, format)
    ckpt = load_format(fmt).read(path, ReadOptions(trust=trust, key=key))
    tensors = [
        TensorInfo(name, dtype_name(t.dtype), list(t.shape), t.nbytes,
                   t.scheme if isinstance(t, QuantizedTensor) else None)
        for name, t in ckpt.tensors.items()
    ]
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    metadata = {k: v for k, v in ckpt.metadata.items() if k != METRICS_KEY}
    return Inspection(path, fmt, tensors, metadata, ckpt.arch, size, ckpt.metrics, _model_summary(path, ckpt, tensors))


def _model_summary(path: Path, ckpt: Any, tensors: list[TensorInfo]) -> dict[str, Any] | None:
    """A Hugging Face family's facts (modelkit.models._hf.describe), the dtype holding most matrix weights,
    and a folder's shard layout; None for other models."""
    from collections import Counter

    from modelkit.models import _hf, hf_family

    family = hf_family(ckpt.arch.name) if ckpt.arch is not None else None
    if family is None:
        return None
    summary = _hf.describe(ckpt.arch.name, family, ckpt.arch.config, ckpt.assets)
    weights: Counter[str] = Counter()
    for t in tensors:
        if len(t.shape) == 2:
            weights[t.quantized or t.dtype] += t.nbytes
    summary["dtype"] = weights.most_common(1)[0][0] if weights else None
    summary["parameters"] = sum(math.prod(t.shape) for t in tensors)
    if path.is_dir():
        shards = sorted(path.glob("*.safetensors"))
        summary["shards"] = {"files": len(shards), "bytes": sum(p.stat().st_size for p in shards)}
    return summary


def generate(path: PathLike, prompt: str | bytes, *, max_new_bytes: int = 200, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, format: str | None = None, trust: bool = False,
             key: str | None = None, arch: ArchSpec | str | None = None) -> bytes:
    """Continue `prompt` with a tinylm checkpoint: greedy by default, sampled when temperature > 0.

    `format`, `trust`, `key` and `arch` mean what they mean for `load_module`.
    """
    from modelkit.models.tinylm import TinyLM
    from modelkit.models.tinylm import generate as _generate

    model = load_module(path, format=format, trust=trust, key=key, arch=arch)
    if not isinstance(model, TinyLM):
        raise ConfigError(f"{path} holds a {type(model).arch} model; generate needs a tinylm checkpoint")
    data = prompt.encode("utf-8") if isinstance(prompt, str) else prompt
    return _generate(model, data, max_new_bytes=max_new_bytes, temperature=temperature, top_k=top_k, seed=seed)


def formats() -> list[str]:
    """The names of the formats this installation knows."""
    return list(FORMATS)
