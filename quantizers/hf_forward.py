"""A forward pass of a quantized Hugging Face Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3) in one call of
the packed-weight kernels: `model(input_ids)` on what `quantize_module` / `load_module` return for such a model.

transformers' forward around modelkit's packed layers spends as long in its own ops (norms, rotary, SDPA, SwiGLU,
module dispatch) as in the products: llama-100m's q4_k_m at batch 1 took 0.41-0.59 of float's time, where the
products alone take far less. `DecodePlan.forward` runs the whole block stack instead (as tinylm's forward,
fast_forward.py), with the rotary tables of the model's own `rotary_emb`, Qwen3's per-head q/k norms and Qwen2's
biases (the products' own), on the plan kept per model by fast_forward.cached_plan (weak table; identity and
address check on every call; rebuilt after `.to()` or a replaced layer).

**How the call gets here.** The model's class is transformers' and its forward is transformers' code, which
never asks its layers (tinylm's forward asks its first product; the models layer imports no quantizer). Where
modelkit makes a quantized model of these families (quantizers/_modules.py: `replace`, behind quantize_module,
and `rebuild`, behind load_module / instantiate), `install` sets an instance attribute `forward`: a `FusedForward`
holding the model. nn.Module.__call__ reads `self.forward`, so the instance attribute is what runs; calling
the class's forward (`type(model).forward(model, ...)`) still runs transformers' alone. Chosen over the others:
- a forward hook cannot replace the output without running transformers' forward first;
- swapping `model.__class__` for a subclass changes `type(model)`, which save_pretrained writes into config.json
  as the architecture, and a dynamic class does not pickle;
- the object (not a closure, not a bound method) deep-copies and pickles with the model: `copy.deepcopy` and
  `pickle` reach the model through their memo, so a copy's forward runs the copy; its `__signature__` is the
  class forward's, so transformers' generate and modelkit's cache-argument probe read the real parameters.
Float models are never touched: only `replace` / `rebuild` (quantized layers) call `install`.

**The contract.** The fused path answers only where it produces what transformers' forward would (to the
kernels' rounding; tests/test_hf_fast_decode.py): input_ids (B, T) on CPU; the attention_mask absent or all
ones; no position_ids, cache, inputs_embeds or other keyword (flash-attention's, debug_io, past_key_values, ...),
except a DynamicCache the fused path may continue (batch 1, positions absent or the default past..past+T-1:
transformers' generate; hf_cache.py); output_attentions / output_hidden_states off (argument and config);
logits_to_keep 0 or 1; at most 64 rows (B T) where the products are int8-dynamic's (ROWWISE_ROWS); no gradient,
eval mode, not tracing or compiling; a float32 embedding; `config.is_causal` not False; no sliding window inside
the positions attended; no forward hook on the model's blocks (it would not run; transformers' output-capturing
hooks count only while they collect).
Otherwise transformers' forward runs, unchanged. labels: the model's own `loss_function` on the fused logits,
as transformers computes it. use_cache (the config's default, True for these families): the C forward also
writes every token's keys (after the rotary and Qwen3's key norm) and values into a (layers, B, kv_heads, T,
head_dim) buffer, fed to a DynamicCache built from the config through `update(keys, values, layer)`, as
transformers' attention fills it, so sliding-window layers keep what they keep there; the returned cache
continues decoding in transformers (a generate from it gives the tokens of one from transformers' own).
return_dict as `can_return_tuple` does. Given a cache, that cache is continued and returned instead (its shadow
static cache, hf_cache.py: the prompt through DecodePlan.forward, each token through the C decode step).
"""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn

from modelkit.quantizers import fast_decode, fast_forward, fast_linear, hf_cache
from modelkit.quantizers.hf_rotary import cover, rotary_tables

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")      # tables fixed per position (dynamic/longrope are not)
_TABLE_MIN = 64                                           # rotary rows built at first; doubled as needed
# int8-dynamic's layers run torch._int_mm on large weights, which beats the fused forward's kernels on many rows
# (llama-100m, 1024 rows, one thread, CPU time: fused 1.41-1.48x transformers' forward; at 16 rows 0.59x):
# plans with such products are fused up to this many rows.
ROWWISE_ROWS = 64
# Keywords the fused path takes (with the values it takes, checked below); any other sends the call to
# transformers' forward.
_TAKEN = frozenset({"input_ids", "attention_mask", "use_cache", "return_dict", "logits_to_keep", "labels",
                    "position_ids", "cache", "inputs_embeds", "output_attentions", "output_hidden_states"})


def _limits(model: nn.Module) -> tuple[str | None, int | None]:
    """(why `model` is not a model the fused plans take at any length, or None; its smallest sliding window)."""
    cfg = getattr(model, "config", None)
    body = getattr(model, "model", None)
    if getattr(cfg, "model_type", None) not in FAMILIES or not hasattr(body, "rotary_emb") or not hasattr(model, "lm_head"):
        return f"not a model of {', '.join(FAMILIES)}", None
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}", None
    rope = getattr(body.rotary_emb, "rope_type", "default")
    if rope not in ROPE_TYPES:
        return f"rope type {rope}", None
    layers = body.layers
    sliding = [getattr(layer.self_attn, "sliding_window", None) for layer in layers]
    if cfg.model_type == "mistral":
        sliding.append(getattr(cfg, "sliding_window", None))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if any(not math.isclose(getattr(layer.self_attn, "scaling", head_dim ** -0.5), head_dim ** -0.5) for layer in layers):
        return "an attention scale other than 1/sqrt(head_dim)", None
    return None, min((w for w in sliding if w is not None), default=None)


def unsupported(model: nn.Module, window: int) -> str | None:
    """Why the fused plans cannot run `model` over `window` positions (None: they can): another family, an
    activation other than SiLU, a rope type whose tables change with the length (dynamic, longrope), an attention
    scale other than 1/sqrt(head_dim), or a sliding window that would reach inside the window."""
    reason, sliding = _limits(model)
    if reason is None and sliding is not None and sliding < window:
        return f"a sliding window of {sliding} positions"
    return reason


def _entry(model: nn.Module) -> fast_forward.Entry:
    """The model's plan (fast_forward.cached_plan); `extra` holds (the smallest sliding window, every module whose
    hooks would be skipped)."""
    layers = fast_forward.layers(model)
    blocks = [fast_forward.block_modules(layer) for layer in layers]
    parts, body = model._modules, model._modules["model"]._modules
    containers = [m for layer in layers for m in (layer, layer._modules["self_attn"], layer._modules["mlp"])]
    modules = (*(m for block in blocks for m in block), body["norm"], parts["lm_head"], body["rotary_emb"], *containers,
               body["embed_tokens"])

    def build() -> fast_forward.Entry:
        reason, sliding = _limits(model)
        if reason is None and not all(type(m).__module__.startswith("transformers.") for m in containers):
            reason = "a block that is not transformers' own"
        plan = None if reason is not None else fast_decode.plan(blocks, body["norm"], parts["lm_head"],
                                                                  fast_forward.geometry(model.config))
        if plan is None:
            return fast_forward.Entry((), [], [], None)
        cos, sin = rotary_tables(model, _TABLE_MIN)
        rowwise = any(getattr(type(m), "ROWWISE_ACTIVATIONS", False) for block in blocks for m in block)
        return fast_forward.Entry((), [], [], plan, cos, sin, (sliding, (parts["model"], *modules), rowwise))

    return fast_forward.cached_plan(model, modules, build)


_CAPTURING = "transformers.utils.output_capturing"


def _hooked(modules: tuple[nn.Module, ...]) -> bool:
    """Whether a forward hook would run in one of `modules` (or a global one). transformers' own output-capturing
    hooks (installed for good by the first call asking for hidden states or attentions) do nothing while no
    collector is active, and so do not count then."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    hooks = [h for m in modules for d in (m._forward_hooks, m._forward_pre_hooks) if d for h in d.values()]
    if not hooks:
        return False
    if any(getattr(h, "__module__", None) != _CAPTURING for h in hooks):
        return True
    from transformers.utils.output_capturing import _active_collector

    return bool(_active_collector.get())


def _output(model: nn.Module, logits: torch.Tensor, cache: Any, loss: torch.Tensor | None) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = CausalLMOutputWithPast.__dataclass_fields__
    name = "cache" if "cache" in fields else "past_key_values"        # (transformers renamed it in 5.24)
    return CausalLMOutputWithPast(loss=loss, logits=logits, **{name: cache})


def _default_positions(positions: Any, B: int, T: int, past: int) -> bool:
    """Whether `positions` are the ones transformers takes by default: past..past+T-1 for each sequence (what
    generate passes with its cache; without a cache, given positions keep transformers' forward, as before)."""
    if not isinstance(positions, torch.Tensor) or positions.shape not in ((T,), (1, T), (B, T)) \
            or positions.is_floating_point() or positions.device.type != "cpu":
        return False
    if positions.numel() == 1:
        return int(positions.reshape(())) == past
    return torch.equal(positions, torch.arange(past, past + T).expand_as(positions))


def fused_outputs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What `model(*args, **kwargs)` returns, from the fused forward; None where it does not apply (see the
    module docstring: the caller runs transformers' forward)."""
    if not fast_forward.enabled() or fast_linear.ISA is None or len(args) > 1 or not _TAKEN.issuperset(kwargs) \
            or torch.is_grad_enabled() or model.training or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return None
    ids = args[0] if args else kwargs.get("input_ids")
    get = kwargs.get
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.device.type != "cpu" or ids.shape[1] < 1 \
            or ids.is_floating_point() or ids.is_complex() \
            or get("inputs_embeds") is not None \
            or get("output_attentions") or get("output_hidden_states"):
        return None
    cfg = model.config
    keep = get("logits_to_keep", 0)
    if getattr(cfg, "output_attentions", False) or getattr(cfg, "output_hidden_states", False) \
            or getattr(cfg, "is_causal", None) is False or type(keep) is not int or keep not in (0, 1) \
            or (keep and get("labels") is not None):
        return None
    use_cache = get("use_cache")
    if use_cache is None:
        use_cache = getattr(cfg, "use_cache", False)
    B, T = ids.shape
    given, past = get("cache"), 0
    if given is not None:            # continue it (generate's cache): hf_cache.py
        past = hf_cache.past_length(given, cfg.num_hidden_layers) if use_cache and B == 1 else None
        if past is None:
            return None
    mask, positions = get("attention_mask"), get("position_ids")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != (B, past + T) or not bool(mask.all())):
        return None
    if positions is not None and (given is None or not _default_positions(positions, B, T, past)):
        return None
    entry = _entry(model)
    if entry.plan is None or cfg.num_hidden_layers != entry.plan.layers:
        return None
    sliding, hooked, rowwise = entry.extra
    if (sliding is not None and sliding < past + T) or (rowwise and B * T > ROWWISE_ROWS) or _hooked(hooked):
        return None
    if given is not None:
        logits = hf_cache.cached_logits(model, entry, ids, given, past, keep == 1)
        return None if logits is None else _finish(model, kwargs, logits, given)
    x = model.model.embed_tokens(ids)
    if x.dtype != torch.float32:
        return None
    cover(entry, model, T)
    plan, g = entry.plan, entry.plan.geometry
    into = None
    if use_cache:
        into = tuple(torch.empty(plan.layers, B, g.kv_heads, T, g.head_dim) for _ in range(2))
    logits = plan.forward(x.contiguous(), entry.cos, entry.sin, into=into, last_only=keep == 1)
    if keep == 1:
        logits = logits.unsqueeze(1)
    cache = None
    if into is not None:
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=cfg)
        for i in range(plan.layers):
            cache.update(into[0][i], into[1][i], i)
    return _finish(model, kwargs, logits, cache)


def _finish(model: nn.Module, kwargs: dict[str, Any], logits: torch.Tensor, cache: Any) -> Any:
    """The call's output around the fused logits: the loss where labels are given, a tuple where asked."""
    labels, cfg = kwargs.get("labels"), model.config
    loss = None if labels is None else model.loss_function(logits=logits, labels=labels, vocab_size=cfg.vocab_size)
    out = _output(model, logits, cache, loss)
    return_dict = kwargs.get("return_dict")
    if return_dict is None:
        return_dict = getattr(cfg, "return_dict", True)
    return out if return_dict else out.to_tuple()


class FusedForward:
    """`model.forward` of a quantized Llama-family model: the fused forward where it applies, else the class's
    (transformers') forward (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        out = fused_outputs(model, args, kwargs)
        return out if out is not None else type(model).forward(model, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.model).forward.__get__(self.model))

    def __repr__(self) -> str:
        return f"<fused forward of {type(self.model).__name__}>"


def install(model: nn.Module) -> nn.Module:
    """Route `model(...)` through FusedForward where `model` is a Llama-family causal LM of transformers (its
    class's own forward, no instance forward already set by someone else); returns `model`."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if family in FAMILIES and type(model).__module__ == f"transformers.models.{family}.modeling_{family}" \
            and "forward" not in model.__dict__ and _limits(model)[0] is None:
        model.forward = FusedForward(model)
    return model
