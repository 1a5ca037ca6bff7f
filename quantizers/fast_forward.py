"""tinylm's forward pass in one call of the packed-weight kernels, with its plan kept per model.

A forward pass of a quantized tinylm over a 16-token window spends as much time in ~40 torch ops per block
(norms, rotary, SDPA, SwiGLU, module dispatch) as in its weight products, and those ops cost the same as
float's. When every product of every block is packed (`fast_decode.plan` applies) and no gradient is wanted,
`TinyLM.forward` hands the whole block stack to `DecodePlan.forward` (_matmul_kernels_forward.h): one C call
for all B x T rows. (The model asks its first product layer, `QuantizedModule.fused_forward`, which calls
`tinylm_logits` here: the models layer imports no quantizer.)

The plan is built on the first such call and kept in a table keyed weakly by the model (not on the model:
`copy.deepcopy` and `torch.save` must not carry raw addresses). Every call checks that the modules the plan
reads are still the model's and that each of their tensors still has the address the plan holds; a replaced
layer, a `load_state_dict(assign=True)`, `.to()` or `.half()` builds a new plan on the next call (in-place
writes into the same tensors need none: the plan reads their memory). The check costs ~10 us on tinylm.
"""
from __future__ import annotations

import operator
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelkit.quantizers import fast_decode, fast_linear


@dataclass(frozen=True)
class _Entry:
    """A built plan (or None: the model's layers are not all packed) and what it was built from."""

    modules: tuple[nn.Module, ...]
    dicts: list[dict[str, Any]]              # the modules' parameters and buffers
    addresses: list[int]
    plan: fast_decode.DecodePlan | None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


_PLANS: weakref.WeakKeyDictionary[nn.Module, _Entry] = weakref.WeakKeyDictionary()
_enabled = True


@contextmanager
def unfused() -> Iterator[None]:
    """Run tinylm's torch path inside the block (its products still on the kernels): the reference the tests and
    bench/infer.py compare the fused forward with."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def _blocks(model: nn.Module) -> list[tuple[nn.Module, ...]]:
    """Each layer's modules as fast_decode.plan takes them (read from the `_modules` dicts: nn.Module's
    __getattr__ would cost ~0.8 us a name, half the check on every call)."""
    out = []
    for layer in model._modules["model"]._modules["layers"]._modules.values():
        parts = layer._modules
        a, m = parts["self_attn"]._modules, parts["mlp"]._modules
        out.append((parts["input_layernorm"], a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"],
                    parts["post_attention_layernorm"], m["gate_proj"], m["up_proj"], m["down_proj"]))
    return out


def _tensor_dicts(modules: tuple[nn.Module, ...]) -> list[dict[str, Any]]:
    return [d for m in modules for d in (m._parameters, m._buffers) if d]


def _addresses(dicts: list[dict[str, Any]]) -> list[int]:
    return [t.data_ptr() for d in dicts for t in d.values() if t is not None]


def _entry(model: nn.Module) -> _Entry:
    """The model's plan, built again where a module or tensor it reads has changed."""
    blocks = _blocks(model)
    parts = model._modules
    modules = (*(m for block in blocks for m in block), parts["model"]._modules["norm"], parts["lm_head"])
    found = _PLANS.get(model)
    if found is not None and len(found.modules) == len(modules) and all(map(operator.is_, found.modules, modules)) \
            and _addresses(found.dicts) == found.addresses:
        return found
    dicts = _tensor_dicts(modules)
    cfg = model.config
    geometry = fast_decode.Geometry(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                    cfg.intermediate_size)
    plan = fast_decode.plan(blocks, model.model.norm, model.lm_head, geometry)
    tables: tuple[Any, ...] = ()
    if plan is not None:
        from modelkit.models.tinylm import rotary_tables

        tables = tuple(t.contiguous() for t in rotary_tables(cfg, cfg.max_position_embeddings, torch.device("cpu")))
    entry = _Entry(modules, dicts, _addresses(dicts), plan, *tables)
    _PLANS[model] = entry
    return entry


def tinylm_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor | None:
    """tinylm's (B, T, vocab) logits from the fused forward, or None where it does not apply (the caller runs
    its torch path): the kernels off, a gradient wanted, a traced or compiled graph, an input off the CPU, or
    a product that is not packed. TinyLM.forward calls this through its first product's `fused_forward` (so a
    float model pays one attribute test)."""
    if not _enabled or fast_linear.ISA is None \
            or torch.is_grad_enabled() or input_ids.device.type != "cpu" or input_ids.ndim != 2 \
            or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return None
    entry = _entry(model)
    if entry.plan is None:
        return None
    x = model.model.embed_tokens(input_ids)
    if x.dtype != torch.float32:
        return None
    return entry.plan.forward(x.contiguous(), entry.cos, entry.sin)
