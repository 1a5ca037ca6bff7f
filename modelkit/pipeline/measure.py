"""Measuring a model: its task metric on its own data, and CPU latency. One place for both, used by
`modelkit eval`, the quantize (torch and ONNX), prune and distill reports, the demo and bench/quantize.py."""
from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modelkit.errors import ConfigError, UnsupportedConversionError
from modelkit.formats import RUNTIMES, detect_format
from modelkit.models import ArchSpec

PathLike = str | os.PathLike[str]
LATENCY_BATCHES = (1, 64)


def arch_name(model: nn.Module) -> str:
    """The registered model a module is, for metrics and latency inputs; a clear error otherwise."""
    from modelkit.models import MODELS

    name = getattr(type(model), "arch", None)
    if name not in MODELS:
        raise UnsupportedConversionError(type(model).__name__, "quantization report",
                                         "metrics, QAT and calibration need a reference model (mlp, cnn, tinylm)")
    return name




def evaluate(path_or_model: PathLike | nn.Module, *, split: str | None = None, arch: str | None = None,
             device: str = "auto", runtime: str = "torch", format: str | None = None, trust: bool = False,
             key: str | None = None) -> dict[str, Any]:
    """Evaluate a reference model (a file or a module) on a split of its own data.

    Returns the metrics plus "model" and "split": accuracy for classifiers; bits per byte,
    perplexity and the unigram baseline for tinylm. The default split is the model's own
    (test for classifiers, validation for tinylm). `runtime="onnxruntime"` runs an ONNX file
    in an onnxruntime session (CPU) instead of rebuilding the torch module from its weights.
    `format`, `trust`, `key` and `arch` are `load_module`'s, for files.
    """
    from torch import nn

    from modelkit.models import load_model_module
    from modelkit.pipeline import distributed
    from modelkit.pipeline import train as training
    from modelkit.pipeline.load import load_module

    if runtime not in RUNTIMES:
        raise ConfigError(f"unknown runtime {runtime!r}; known: {', '.join(RUNTIMES)}")
    if runtime == "onnxruntime":
        if isinstance(path_or_model, nn.Module) or detect_format(Path(path_or_model)) != "onnx":
            raise ConfigError(f"{path_or_model}: runtime onnxruntime needs an ONNX file; convert it with "
                              "modelkit convert SRC model.onnx first")
        model, device = session_module(path_or_model), "cpu"
    else:
        model = path_or_model if isinstance(path_or_model, nn.Module) else load_module(
            path_or_model, format=format, arch=arch, trust=trust, key=key)
    name = getattr(type(model), "arch", None)
    if name is None:
        raise ConfigError(f"{type(model).__name__} is not a reference model; evaluation needs one of its tasks")
    split = split or load_model_module(name).TASK.default_split
    dev = distributed.resolve_device(device, distributed.DistInfo())
    metrics = training.evaluate(model.to(dev), name, split, device=dev)
    return {"model": name, "split": split, **metrics}


@torch.no_grad()
def latency_ms(model: nn.Module, inputs: Any, *, repeats: int = 20, min_seconds: float = 0.2) -> float:
    """Median wall time of one forward pass on CPU, in milliseconds (after two warm-up calls)."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    model.eval()
    for _ in range(2):
        model(*args)
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - started < min_seconds and len(times) < 10 * repeats):
        t0 = time.perf_counter()
        model(*args)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def latencies(model: nn.Module, batches: Sequence[int] = LATENCY_BATCHES) -> dict[str, float]:
    """CPU latency at each batch size on the model's example inputs (tinylm: 16-token windows)."""
    from modelkit.models import load_model_module

    make = load_model_module(arch_name(model)).example_inputs
    return {f"batch_{b}": round(latency_ms(model.cpu(), make(b)), 4) for b in batches}


def metric_change(name: str, higher_is_better: bool, before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """One metric before and after a transform (as `evaluate` returns them): the reports' "metric" entry."""
    b, a = before[name], after[name]
    return {"name": name, "higher_is_better": higher_is_better, "float": b, "quantized": a, "delta": a - b,
            "relative": (a - b) / b if b else math.nan}


def session_module(path: PathLike, arch: ArchSpec | None = None) -> nn.Module:
    """An onnxruntime session dressed as the reference model, so the zoo's evaluation runs it.

    `arch` defaults to the ArchSpec stored in the file's metadata_props.
    """
    from modelkit.formats import ReadOptions, load_format
    from modelkit.models import config_from_dict

    path = Path(path)
    if arch is None:
        arch = load_format("onnx").read(path, ReadOptions()).arch
        if arch is None:
            raise UnsupportedConversionError(path.name, "onnxruntime", "running the file as a reference model needs "
                                             "the ArchSpec modelkit records when it writes ONNX")
    run = load_format("onnx").runnable(path)

    class Session(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = config_from_dict(arch.name, arch.config)

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(run(*inputs))

    Session.arch = arch.name
    return Session()
