"""What torch.export needs of a module beyond the module: its dynamic shapes and example inputs, shared by the
exporters built on torch.export (the ONNX and PT2 converters), so both leave the same axes free.

- a Hugging Face causal LM: the graph of modelkit/testing/causal_lm.py, batch and sequence free;
- a reference model: axis 0 of every tensor input ("batch") and the axes its module declares (`onnx_axes`:
  tinylm's sequence, bounded by its context);
- a user's module: the axes the caller names ({input name: axes}), else axis 0 of every input.
"""
from __future__ import annotations

from typing import Any

import torch

from modelkit.errors import UnsupportedConversionError
from modelkit.models import MODELS, load_model_module
from modelkit.testing import causal_lm


def dynamic_shapes(module: Any, inputs: tuple[Any, ...], *, names: tuple[str, ...] | None = None,
                   axes: dict[str, tuple[int, ...]] | None = None) -> tuple[Any, ...]:
    """torch.export's `dynamic_shapes` for `module` on `inputs` (one entry per input).

    `axes` ({input name: free axes}, inputs named by `names`) are the caller's, exactly (torch finds
    which are equal); else axis 0 of every tensor input ("batch") and the axes a reference model declares.
    """
    import torch.export

    if axes is not None:
        free = [axes.get(name, ()) for name in names or ("",) * len(inputs)]
        return tuple({axis: torch.export.Dim.DYNAMIC for axis in f} or None for f in free)
    arch = getattr(type(module), "arch", None)
    declared = load_model_module(arch).onnx_axes(module.config) if arch in MODELS else {}
    extra = {axis: torch.export.Dim(a.name, max=a.max) if a.max is not None else torch.export.Dim(a.name)
             for axis, a in declared.items()}
    batch = torch.export.Dim("batch")
    return tuple({0: batch, **{a: d for a, d in extra.items() if a < x.dim()}}
                 if isinstance(x, torch.Tensor) and x.dim() else None for x in inputs)


def causal_lm_shapes(layers: int, *, kv_cache: bool) -> tuple[Any, ...]:
    """The causal LM graph's dynamic shapes: one torch Dim per axis name (causal_lm.dynamic_axes); the
    past key/values (kv_cache) as one tuple, as the graph takes them (*past)."""
    import torch.export

    axes = causal_lm.dynamic_axes(layers, kv_cache=kv_cache)
    dims = {axis.name: torch.export.Dim(axis.name) for entry in axes for axis in entry.values()}   # one per name
    dynamic = [{a: dims[axis.name] for a, axis in entry.items()} for entry in axes]
    return (*dynamic[:3], tuple(dynamic[3:])) if kv_cache else tuple(dynamic)


def example_inputs(module: Any, given: Any, *, target: str) -> tuple[Any, ...]:
    """The caller's example inputs, else the reference model's own in the module's float dtype.

    Raises:
        UnsupportedConversionError: neither (a user's module needs --input-shape).
    """
    if given is not None:
        return given if isinstance(given, tuple) else (given,)
    arch = getattr(type(module), "arch", None)
    if arch not in MODELS:
        raise UnsupportedConversionError(type(module).__name__, target, "exporting a graph needs example inputs "
                                         "shaped like real ones: pass --input-shape NAME=DIMS[:DTYPE] "
                                         "(API: example_inputs=...)")
    example = load_model_module(arch).example_inputs()
    example = example if isinstance(example, tuple) else (example,)
    dtype = next((p.dtype for p in module.parameters() if p.dtype.is_floating_point), torch.float32)
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in example)
