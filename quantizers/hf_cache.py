"""The fused forward of a quantized Llama-family model (hf_forward.py) continuing a transformers DynamicCache: what
transformers' `generate` passes on every call (empty at the prompt), so that its prefill and each decode step run
the C kernels instead of transformers' forward.

A DynamicCache holds each layer's keys and values as (B, kv_heads, length, head_dim) tensors that grow by
concatenation; the kernels read a static cache. So each DynamicCache the fused path starts (an empty one) gets a
shadow: a static cache of (layers, 1 slot, kv_heads, window, head_dim) kept in a table keyed weakly by the
DynamicCache object. A call then runs DecodePlan.forward into the shadow's slot from the cache's length (the
prompt, or any chunk of several tokens) or DecodePlan.step (one token: the C decode step, its embedding read by
fast_decode.row_reader), and sets each DynamicLayer's keys and values to views of the shadow's first
past+T positions: what `update`'s concatenation would hold, without copying the whole cache every token (24
concatenations of the growing cache took ~0.35 ms of a ~4 ms llama-100m step). The cache the call returns is
the one transformers' forward would have returned (to the kernels' rounding) and any later call may run
transformers' (its `update` concatenates into new tensors; the shadow never rewrites positions a view shows).

The shadow is used only while it is certainly the cache's twin: the same DynamicCache object, of plain
DynamicLayers (no sliding-window, quantized or offloaded layers), each layer's keys and values the very tensors
the last fused call left there (every DynamicLayer edit, update, crop, beam search's reorder, batch_select, makes
new ones), batch 1. Otherwise the call runs transformers' forward (and the cache stays off the fused path until
it is emptied: a cache reset to nothing starts a new shadow). An in-place write into the cache's tensors is not
seen. The window starts at twice the first chunk (16 at least) and doubles, copied, when a sequence outgrows it.
The plan holds one binding (DecodePlan.bind), so binding and the kernel call hold a lock: generates in several
threads on one model take turns there.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from modelkit.quantizers import fast_decode, fast_forward, hf_rotary

_MIN_WINDOW = 16


@dataclass(eq=False)
class Shadow:
    """A DynamicCache's static twin: keys and values (layers, 1, kv_heads, window, head_dim), the positions
    written, and the layer tensors the DynamicCache held after the last fused call."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0
    seen: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    row: tuple[nn.Module, Callable[[int], torch.Tensor]] | None = None      # (embedding layer, its row reader)


_SHADOWS: weakref.WeakKeyDictionary[Any, Shadow] = weakref.WeakKeyDictionary()
_BINDING = threading.Lock()


def past_length(cache: Any, layers: int) -> int | None:
    """How many positions `cache` holds where the fused path may continue it (0: an empty DynamicCache), else
    None (see the module docstring)."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:                 # (a transformers before its cache layers: not continued)
        return None
    held = getattr(cache, "layers", None) if type(cache) is DynamicCache else None
    if held is None or getattr(cache, "offloading", False) or len(held) != layers \
            or any(type(layer) is not DynamicLayer for layer in held):
        return None
    if not any(layer.is_initialized for layer in held):
        return 0
    shadow = _SHADOWS.get(cache)
    if shadow is None or len(shadow.seen) != layers \
            or any(layer.keys is not k or layer.values is not v
                   for layer, (k, v) in zip(held, shadow.seen, strict=True)):
        return None
    return shadow.length


def _window(shadow: Shadow | None, length: int, entry: fast_forward.Entry, model: nn.Module) -> Shadow:
    """`shadow` (a new one where None) with room for `length` positions, and the entry's rotary tables as long."""
    g = entry.plan.geometry
    window = _MIN_WINDOW if shadow is None else shadow.keys.shape[3]
    while window < length or (shadow is None and window < 2 * length):
        window *= 2
    if shadow is None or window != shadow.keys.shape[3]:
        shape = (entry.plan.layers, 1, g.kv_heads, window, g.head_dim)
        grown = Shadow(torch.zeros(shape), torch.zeros(shape))
        if shadow is not None:
            n = shadow.length
            grown.keys[:, :, :, :n], grown.values[:, :, :, :n] = shadow.keys[:, :, :, :n], shadow.values[:, :, :, :n]
            grown.length, grown.seen, grown.row = n, shadow.seen, shadow.row
        shadow = grown
    hf_rotary.cover(entry, model, window)
    return shadow


def cached_logits(model: nn.Module, entry: fast_forward.Entry, ids: torch.Tensor, cache: Any, past: int,
                  last_only: bool) -> torch.Tensor | None:
    """The logits of `ids` (1, T) after the `past` positions of `cache` (past_length's answer), (1, T, vocab) or
    (1, 1, vocab) with `last_only`, from the kernels on the cache's shadow; `cache`'s layers then hold every
    position's keys and values (views of the shadow). None where the embedding is not float32 (nothing written)."""
    plan, T = entry.plan, ids.shape[1]
    shadow = _SHADOWS.get(cache) if past else None
    embed = model.model.embed_tokens
    if T == 1 and shadow is not None and shadow.row is not None and shadow.row[0] is embed:
        x = shadow.row[1](int(ids[0, 0]))
    else:
        x = embed(ids)
        if x.dtype != torch.float32:
            return None
        x = x.contiguous()
    shadow = _window(shadow, past + T, entry, model)
    if shadow.row is None or shadow.row[0] is not embed:
        shadow.row = (embed, fast_decode.row_reader(embed))
    window = shadow.keys.shape[3]
    with _BINDING:          # the plan's binding is one per plan: a generate in another thread must not move it
        bound = getattr(plan, "bound", None)
        if bound is None or bound[2] is not shadow.keys:
            plan.bind(entry.cos[:window], entry.sin[:window], shadow.keys, shadow.values)
        if T == 1 and x.ndim == 1:
            logits = plan.step(x, past, 0).view(1, 1, -1)
        else:
            logits = plan.forward(x.view(1, T, -1), plan.bound[0], plan.bound[1], start=past, slot=0,
                                  last_only=last_only)
            if last_only:
                logits = logits.unsqueeze(1)
    n = past + T
    views = zip(shadow.keys[:, :, :, :n].unbind(), shadow.values[:, :, :, :n].unbind(), strict=True)
    for layer, (keys, values) in zip(cache.layers, views, strict=True):    # what update's concatenation would hold
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    shadow.length, shadow.seen = n, [(layer.keys, layer.values) for layer in cache.layers]
    _SHADOWS[cache] = shadow
    return logits
