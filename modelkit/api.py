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

__all__ = ["RUNTIMES", "Inspection", "TensorInfo", "complete", "evaluate", "formats", "generate", "inspect", "load",
           "load_module", "save"]

if TYPE_CHECKING:
    from modelkit.pipeline.generate import Generation
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
    layers: list[dict[str, str]] | None = None   # formats that hold a layer graph (tfjs): {"name", "class", "config"}
    program: dict[str, Any] | None = None        # formats that hold an exported program (pt2): inputs, outputs, dims

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
            "layers": self.layers,
            "program": self.program,
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
    describe_layers = getattr(load_format(fmt), "layers", None)       # a converter of a format with a layer graph
    describe_program = getattr(load_format(fmt), "program", None)     # ... or with an exported program
    model = _model_summary(path, ckpt, tensors)
    describe_quantization = getattr(load_format(fmt), "quantization", None)   # another tool's quantized folder
    if model is not None and describe_quantization is not None:
        model["quantization"] = describe_quantization(path)
    return Inspection(path, fmt, tensors, metadata, ckpt.arch, size, ckpt.metrics, model,
                      describe_layers(path) if describe_layers is not None else None,
                      describe_program(path) if describe_program is not None else None)


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

    `format`, `trust`, `key` and `arch` mean what they mean for `load_module`. `complete` does the
    same for any causal language model (Hugging Face families included) and times it.
    """
    from modelkit.models.tinylm import TinyLM
    from modelkit.pipeline.generate import generate_bytes

    model = load_module(path, format=format, trust=trust, key=key, arch=arch)
    if not isinstance(model, TinyLM):
        raise ConfigError(f"{path} holds a {_model_name(model)} model; generate needs a tinylm checkpoint "
                          "(complete() continues Hugging Face language models)")
    if max_new_bytes < 0:
        raise ConfigError(f"max_new_bytes must be >= 0, got {max_new_bytes}")
    return generate_bytes(model, prompt, max_new_tokens=max_new_bytes, temperature=temperature, top_k=top_k,
                          seed=seed).completion


def _model_name(model: Any) -> str:
    return getattr(type(model), "arch", None) or type(model).__name__


def complete(path: PathLike, prompt: str, *, max_new_tokens: int | None = None, max_new_bytes: int | None = None,
             temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0, chat: bool = False,
             format: str | None = None, trust: bool = False, key: str | None = None,
             arch: ArchSpec | str | None = None) -> Generation:
    """Continue `prompt` with a causal language model and time it: a Hugging Face family's model (a folder,
    a GGUF of one, a quantized output) with its own tokenizer and transformers' `generate` (KV cache), or
    a tinylm checkpoint (its tokens are bytes).

    Greedy by default; `temperature` > 0 samples (with `top_k`, `top_p`, `seed`). `chat` renders the
    prompt as a user message through the model's chat template. Generation stops at an end-of-sequence
    token or after `max_new_tokens` (default 64; tinylm: `max_new_bytes` or `max_new_tokens`, default 200). `format`, `trust`, `key` and `arch` mean what they mean for `load_module`.

    Example:
        >>> out = modelkit.api.complete("llama-folder", "Hello", max_new_tokens=20)     # doctest: +SKIP
        >>> out.text, out.to_dict()["decode_tokens_per_second"]                        # doctest: +SKIP
    """
    from modelkit.models import hf_config_of
    from modelkit.models.tinylm import TinyLM
    from modelkit.pipeline.generate import generate_bytes, generate_tokens
    from modelkit.pipeline.load import load_language_model

    loaded = load_language_model(path, format=format, trust=trust, key=key, arch=arch)
    if isinstance(loaded.model, TinyLM):
        if chat or top_p is not None:
            raise ConfigError(f"{path}: tinylm has no chat template and samples with --top-k only")
        limit = next((n for n in (max_new_bytes, max_new_tokens) if n is not None), 200)
        return generate_bytes(loaded.model, prompt, max_new_tokens=limit, temperature=temperature, top_k=top_k,
                              seed=seed)
    if hf_config_of(loaded.model) is None:
        raise ConfigError(f"{path} holds a {_model_name(loaded.model)} model; generate needs a tinylm checkpoint "
                          "or a Hugging Face family's causal LM")
    if max_new_bytes is not None:
        raise ConfigError("--max-bytes (max_new_bytes) counts tinylm's byte tokens; use --max-new-tokens for this model")
    if loaded.tokenizer is None:
        raise ConfigError(f"{path} carries no tokenizer (tokenizer.json or tokenizer.model); copy the model's "
                          "tokenizer files into its folder")
    return generate_tokens(loaded.model, loaded.tokenizer, prompt, max_new_tokens=64 if max_new_tokens is None else max_new_tokens,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, chat=chat,
                           assets=dict(loaded.assets), source=str(path))


def formats() -> list[str]:
    """The names of the formats this installation knows."""
    return list(FORMATS)
