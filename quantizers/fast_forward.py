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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelkit.quantizers import fast_decode, fast_linear


@dataclass
class Entry:
    """A built plan (or None: the model's layers are not all packed), what it was built from, and its rotary
    tables (which a family may lengthen: hf_forward.py)."""

    modules: tuple[nn.Module, ...]
    dicts: list[dict[str, Any]]              # the modules' parameters and buffers
    addresses: list[int]
    plan: fast_decode.DecodePlan | None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    extra: Any = None                        # what the family's builder keeps beside the plan


_PLANS: weakref.WeakKeyDictionary[nn.Module, Entry] = weakref.WeakKeyDictionary()
_enabled = True


def enabled() -> bool:
    """False inside `unfused()`."""
    return _enabled


@contextmanager
def unfused() -> Iterator[None]:
    """Run the models' torch paths (their products still on the kernels): the reference the tests and
    bench/infer.py compare the fused forward with (tinylm's forward here, an HF model's in hf_forward.py)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def block_modules(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A Llama layer's modules as fast_decode.plan takes them: (attention norm, q, k, v, o, MLP norm, gate, up,
    down), then Qwen3's (query norm, key norm) where the attention has them. Read from the `_modules` dicts:
    nn.Module's __getattr__ would cost ~0.8 us a name, half the check on every call."""
    parts = layer._modules
    a, m = parts["self_attn"]._modules, parts["mlp"]._modules
    norms = (a["q_norm"], a["k_norm"]) if "q_norm" in a else ()
    return (parts["input_layernorm"], a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"],
            parts["post_attention_layernorm"], m["gate_proj"], m["up_proj"], m["down_proj"], *norms)


def layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a tinylm or a transformers Llama-family causal LM."""
    return list(model._modules["model"]._modules["layers"]._modules.values())


def _tensor_dicts(modules: tuple[nn.Module, ...]) -> list[dict[str, Any]]:
    return [d for m in modules for d in (m._parameters, m._buffers) if d]


def _addresses(dicts: list[dict[str, Any]]) -> list[int]:
    return [t.data_ptr() for d in dicts for t in d.values() if t is not None]


def cached_plan(model: nn.Module, modules: tuple[nn.Module, ...], build: Callable[[], Entry]) -> Entry:
    """`model`'s entry, built again by `build()` (modules, dicts and addresses left to fill here) where one of
    `modules` (what the plan reads, and what must stay the model's for it to hold) or one of their tensors has
    changed."""
    found = _PLANS.get(model)
    if found is not None and len(found.modules) == len(modules) and all(map(operator.is_, found.modules, modules)) \
            and _addresses(found.dicts) == found.addresses:
        return found
    entry = build()
    entry.modules, entry.dicts = modules, _tensor_dicts(modules)
    entry.addresses = _addresses(entry.dicts)
    _PLANS[model] = entry
    return entry


def geometry(config: Any) -> fast_decode.Geometry:
    """The widths of a Llama-shaped config (head_dim, where it is None, hidden / heads)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return fast_decode.Geometry(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                                config.intermediate_size)


def _tinylm_entry(model: nn.Module) -> Entry:
    """tinylm's plan, with its rotary tables over its whole window."""
    blocks = [block_modules(layer) for layer in layers(model)]
    parts = model._modules
    modules = (*(m for block in blocks for m in block), parts["model"]._modules["norm"], parts["lm_head"])

    def build() -> Entry:
        cfg = model.config
        plan = fast_decode.plan(blocks, model.model.norm, model.lm_head, geometry(cfg))
        if plan is None:
            return Entry((), [], [], None)
        from modelkit.models.tinylm import rotary_tables

        cos, sin = (t.contiguous() for t in rotary_tables(cfg, cfg.max_position_embeddings, torch.device("cpu")))
        return Entry((), [], [], plan, cos, sin)

    return cached_plan(model, modules, build)


def tinylm_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor | None:
    """tinylm's (B, T, vocab) logits from the fused forward, or None where it does not apply (the caller runs
    its torch path): the kernels off, a gradient wanted, a traced or compiled graph, an input off the CPU, or
    a product that is not packed. TinyLM.forward calls this through its first product's `fused_forward` (so a
    float model pays one attribute test)."""
    if not _enabled or fast_linear.ISA is None \
            or torch.is_grad_enabled() or input_ids.device.type != "cpu" or input_ids.ndim != 2 \
            or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return None
    entry = _tinylm_entry(model)
    if entry.plan is None:
        return None
    x = model.model.embed_tokens(input_ids)
    if x.dtype != torch.float32:
        return None
    return entry.plan.forward(x.contiguous(), entry.cos, entry.sin)
