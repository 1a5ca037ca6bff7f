"""Checks run on a written output before it takes its final name.

- weights: every tensor read back equals the expected one bit for bit (`verify_weights`);
- graphs: the file's own runtime (onnxruntime, the ScriptModule) and torch eager run seeded
  sample inputs, compared by `modelkit.testing.compare_outputs` within the format's tolerance
  (`verify_outputs`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from modelkit.checkpoint import Checkpoint
from modelkit.errors import ConfigError, VerificationError
from modelkit.storage.dtypes import dtype_name
from modelkit.testing import compare_outputs

if TYPE_CHECKING:
    from torch import nn

# Largest |eager - runtime| accepted for graph formats, per format and dtype. Measured on the
# reference models on 2026-11-21 (see docs/formats/<name>.md for the figures), then pinned with
# headroom: float32 kernels differ in summation order, not in what they compute.
GRAPH_ATOL: dict[tuple[str, torch.dtype], float] = {
    ("onnx", torch.float32): 1e-4,
    ("torchscript", torch.float32): 1e-5,
    ("onnx", torch.float16): 5e-2,
    ("torchscript", torch.float16): 5e-2,
    ("onnx", torch.bfloat16): 2e-1,
    ("torchscript", torch.bfloat16): 2e-1,
}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    x, y = a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    if _int64_viewable(x) and _int64_viewable(y):      # torch.equal is 5x faster on int64 than on bytes
        x, y = x.view(torch.int64), y.view(torch.int64)
    return torch.equal(x, y)


def _int64_viewable(raw: torch.Tensor) -> bool:
    return raw.numel() % 8 == 0 and raw.storage_offset() % 8 == 0 and raw.data_ptr() % 8 == 0


def verify_weights(expected: Checkpoint, written: Checkpoint, *, label: str) -> dict[str, Any]:
    """Every tensor of `expected` is in `written` with the same dtype, shape and bits."""
    missing = [n for n in expected.tensors if n not in written.tensors]
    if missing:
        raise VerificationError(f"{label}: tensor {missing[0]!r} is missing from the output", max_abs_err=float("inf"), atol=0.0)
    for name, entry in expected.tensors.items():
        want, got = entry.load(), written.tensors[name].load()
        if not _same_bits(want, got):
            err = float((want.double() - got.double()).abs().max()) if want.shape == got.shape and want.dtype != torch.bool else float("inf")
            raise VerificationError(f"{label}: tensor {name!r} differs ({dtype_name(want.dtype)} {list(want.shape)} "
                                    f"vs {dtype_name(got.dtype)} {list(got.shape)})", max_abs_err=err, atol=0.0)
    return {"method": "bit-exact", "tensors_checked": len(expected.tensors), "max_abs_err": 0.0, "atol": 0.0, "passed": True}


def sample_inputs(module: nn.Module, example_inputs: tuple[Any, ...] | None = None,
                  batches: tuple[int, ...] = (1, 3)) -> list[tuple[Any, ...]]:
    """Seeded inputs: the caller's, or the reference model's at a few batch sizes."""
    if example_inputs is not None:
        return [tuple(example_inputs)]
    from modelkit.models import MODELS, load_model_module

    name = getattr(type(module), "arch", None)
    if name not in MODELS:
        raise ConfigError(f"{type(module).__name__} is not a reference model: pass example_inputs for export and checks")
    make = load_model_module(name).example_inputs
    dtype = module_dtype(module)       # a module cast to f16/bf16 takes inputs of that dtype
    # Token ids: the zoo makes byte ids (0-255); a smaller vocabulary takes them modulo its size.
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)

    def fit(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            return x.to(dtype)
        return x % vocab if isinstance(vocab, int) and vocab > 0 else x

    return [(fit(make(batch, seed=seed)),) for seed, batch in enumerate(batches)]


def verify_outputs(module: nn.Module, run: Callable[..., torch.Tensor], inputs: list[tuple[Any, ...]], *,
                   atol: float = 0.0, rtol: float = 0.0, label: str) -> dict[str, Any]:
    """`module` in eval mode against `run` (a runtime) on `inputs`, through the one comparator."""
    module.eval()
    return compare_outputs(module, run, inputs, atol=atol, rtol=rtol, label=label)


def graph_atol(fmt: str, dtype: torch.dtype) -> float:
    return GRAPH_ATOL.get((fmt, dtype), GRAPH_ATOL.get((fmt, torch.float32), 1e-4))


def module_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def reference_module(ckpt: Checkpoint, *, target: str) -> nn.Module | None:
    """The module a graph written from `ckpt` must agree with: rebuilt from its ArchSpec in the
    checkpoint's float dtype. None when no output check applies: no ArchSpec, quantized tensors
    (their own check rebuilds the quantized model), or float tensors of mixed dtypes."""
    from modelkit.checkpoint import QuantizedTensor, instantiate

    dtypes = {t.dtype for t in ckpt.tensors.values() if t.dtype.is_floating_point}
    if ckpt.arch is None or len(dtypes) > 1 or any(isinstance(t, QuantizedTensor) for t in ckpt.tensors.values()):
        return None
    module = instantiate(ckpt, source="the checkpoint", target=target)
    return module.to(dtypes.pop()) if dtypes else module
