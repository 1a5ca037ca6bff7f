"""Hugging Face causal language models as graph formats see them: the one contract that the ONNX
exporter (modelkit/converters/onnx.py) and the output check (modelkit/pipeline/verify.py) share.

A causal LM is any module whose `config` has an integer `vocab_size` and whose `forward` takes
`input_ids`, `attention_mask`, `position_ids` and a key/value cache (`cache`, or `past_key_values` before
transformers 5.24) by name, as transformers'
`*ForCausalLM` and `GPT2LMHeadModel` classes do; no family is named. `CausalLMGraph` wraps one as
a module of plain tensors, the graph's signature (names as optimum and onnxruntime-genai use them):

    inputs   input_ids        int64 [batch, sequence]
             attention_mask   int64 [batch, total_sequence]   total_sequence = past_sequence + sequence
             position_ids     int64 [batch, sequence]
             past_key_values.N.key / .value   [batch, kv_heads, past_sequence, head_dim]   (kv_cache only)
    outputs  logits           [batch, sequence, vocab]
             present.N.key / .value           [batch, kv_heads, total_sequence, head_dim]  (kv_cache only)

position_ids are an input because transformers takes them from the caller: with left padding,
`generate` numbers each row's tokens from its first real one (`position_ids(attention_mask)`),
which the graph cannot know from input_ids alone without deciding that policy for every caller.

Logits at padded positions are left out of every comparison: a query that may attend to nothing
has no defined result, and transformers' own attention implementations (sdpa, eager) disagree there.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from modelkit.errors import ConfigError
from modelkit.models.plugin import Axis

INPUT_NAMES = ("input_ids", "attention_mask", "position_ids")
_FORWARD_ARGUMENTS = {"input_ids", "attention_mask", "position_ids"}
# The key/value cache argument (and output) of forward: `cache` from transformers 5.24, `past_key_values` before
_CACHE_NAMES = ("cache", "past_key_values")
# (batch, sequence) of the seeded check inputs: two batch sizes, two lengths; row 0 of a batch
# of several is left-padded by a third of its length.
CHECK_SHAPES = ((1, 7), (3, 16))
EXPORT_SHAPE = (2, 8)            # export example: sizes 0 and 1 would be specialised by torch.export
EXPORT_PAST = 4                  # past length of the kv_cache export example


def is_causal_lm(module: Any) -> bool:
    """A transformers-style causal LM, recognised by its config and forward signature."""
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if not isinstance(module, nn.Module) or type(vocab) is not int or vocab <= 0:
        return False
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return _FORWARD_ARGUMENTS <= set(parameters) and any(name in parameters for name in _CACHE_NAMES)


def _cache_argument(model: nn.Module) -> str:
    """The name forward takes the key/value cache by (transformers' own renamed it in 5.24)."""
    parameters = inspect.signature(model.forward).parameters
    return next(name for name in _CACHE_NAMES if name in parameters)


def returned_cache(out: Any) -> Any:
    """The key/value cache a forward returned, under either of transformers' names."""
    for name in _CACHE_NAMES:
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    return None


def position_ids(attention_mask: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """Positions as transformers' generate makes them: each row counts its real tokens from 0;
    padded positions get 1. `length`: only the last `length` columns (a decode step's)."""
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    return positions if length is None else positions[:, -length:]


def cache_layout(model: nn.Module) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of each layer's key/value cache, from one step of the model itself."""
    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True)
    layers = getattr(returned_cache(out), "layers", None)
    if not layers:
        raise ConfigError(f"{type(model).__name__} returns no key/value cache layers; export it without kv_cache")
    return [(layer.keys.shape[1], layer.keys.shape[-1]) for layer in layers]


def input_names(layers: int, *, kv_cache: bool) -> list[str]:
    return [*INPUT_NAMES, *(_cache_names("past_key_values", layers) if kv_cache else [])]


def output_names(layers: int, *, kv_cache: bool) -> list[str]:
    return ["logits", *(_cache_names("present", layers) if kv_cache else [])]


def _cache_names(prefix: str, layers: int) -> list[str]:
    return [f"{prefix}.{n}.{kind}" for n in range(layers) for kind in ("key", "value")]


class CausalLMGraph(nn.Module):
    """The causal LM with the graph's signature (module docstring): tensors in, logits (and the
    present key/values) out. Exported as it is; run in torch, it is the reference."""

    def __init__(self, model: nn.Module, *, kv_cache: bool = False, layers: int = 0) -> None:
        super().__init__()
        self.model = model
        self.kv_cache = kv_cache
        self.layers = layers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if not self.kv_cache:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).logits
        from transformers.cache_utils import DynamicCache

        # Every layer a full (non-sliding) cache layer: present = past + this step for every layer;
        # sliding-window attention still comes from the model's own masks.
        cache = DynamicCache([(past[2 * n], past[2 * n + 1]) for n in range(self.layers)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{_cache_argument(self.model): cache})
        return (out.logits, *(t for layer in returned_cache(out).layers for t in (layer.keys, layer.values)))


def graph(model: nn.Module, *, kv_cache: bool) -> CausalLMGraph:
    return CausalLMGraph(model, kv_cache=kv_cache, layers=len(cache_layout(model)) if kv_cache else 0)


def token_batch(vocab: int, batch: int, length: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded (input_ids, attention_mask, position_ids): ids across the vocabulary; with several
    rows, row 0 is left-padded by a third of its length (its padded ids are 0)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1:
        mask[0, :length // 3] = 0
        ids[0, :length // 3] = 0
    return ids, mask, position_ids(mask)


def complete(given: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caller's example inputs (input_ids[, attention_mask[, position_ids]]) as all three."""
    ids = torch.as_tensor(given[0])
    if ids.dim() != 2 or ids.is_floating_point():
        raise ConfigError(f"a causal LM's example input_ids must be integer [batch, sequence], not {ids.dtype} "
                          f"{list(ids.shape)}")
    mask = torch.as_tensor(given[1]).long() if len(given) > 1 else torch.ones_like(ids)
    positions = torch.as_tensor(given[2]).long() if len(given) > 2 else position_ids(mask)
    return ids.long(), mask, positions


def export_inputs(model: nn.Module, *, kv_cache: bool) -> tuple[torch.Tensor, ...]:
    """Example inputs for the exporter: batch 2, 8 tokens (and 4 past ones with kv_cache)."""
    batch, length = EXPORT_SHAPE
    ids, mask, positions = token_batch(model.config.vocab_size, batch, length, seed=0)
    if not kv_cache:
        return ids, mask, positions
    dtype = _float_dtype(model)
    past = [torch.randn(batch, heads, EXPORT_PAST, dim, generator=torch.Generator().manual_seed(n)).to(dtype)
            for n, (heads, dim) in enumerate(cache_layout(model)) for _ in range(2)]
    mask = torch.ones(batch, EXPORT_PAST + length, dtype=torch.long)
    return ids, mask, position_ids(mask, length), *past


def dynamic_axes(layers: int, *, kv_cache: bool) -> list[dict[int, Axis]]:
    """The free axes of each input, in input order; axes of one name are one size."""
    batch, sequence = Axis("batch"), Axis("sequence")
    tokens = {0: batch, 1: sequence}
    if not kv_cache:
        return [tokens, tokens, tokens]
    return [tokens, {0: batch, 1: Axis("total_sequence")}, tokens, *[{0: batch, 2: Axis("past_sequence")}] * (2 * layers)]


def check_inputs(model: nn.Module, *, kv_cache: bool, given: Sequence[Any] | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Seeded inputs for the output check (CHECK_SHAPES, then the caller's own if given).

    With kv_cache each batch is checked twice: as a prefill (empty past) and as one decode step
    whose past is what torch's model cached for all but the last token.
    """
    batches = [token_batch(model.config.vocab_size, b, n, seed=seed) for seed, (b, n) in enumerate(CHECK_SHAPES)]
    batches += [complete(given)] if given is not None else []
    if not kv_cache:
        return batches
    layout = cache_layout(model)
    dtype = _float_dtype(model)
    inputs: list[tuple[torch.Tensor, ...]] = []
    for ids, mask, positions in batches:
        empty = [torch.zeros(ids.shape[0], heads, 0, dim, dtype=dtype) for heads, dim in layout for _ in range(2)]
        inputs.append((ids, mask, positions, *empty))
        with torch.no_grad():
            out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], use_cache=True)
        past = [t.detach().clone() for layer in returned_cache(out).layers for t in (layer.keys, layer.values)]
        inputs.append((ids[:, -1:], mask, positions[:, -1:], *past))
    return inputs


class Compared(nn.Module):
    """What the output check compares: the graph's outputs at the positions the attention mask
    keeps (logits of real tokens; present key/values of real tokens), as one flat tensor."""

    def __init__(self, graph: CausalLMGraph) -> None:
        super().__init__()
        self.graph = graph

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return comparable(self.graph(*inputs), inputs[1])


def comparable(outputs: torch.Tensor | Sequence[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
    """Logits (and present key/values) with padded positions zeroed, flattened into one tensor."""
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    logits, present = torch.as_tensor(outputs[0]).float(), [torch.as_tensor(t).float() for t in outputs[1:]]
    keep = attention_mask[:, -logits.shape[1]:].bool()
    parts = [logits.masked_fill(~keep[..., None], 0).reshape(-1)]
    parts += [t.masked_fill(~attention_mask.bool()[:, None, :, None], 0).reshape(-1) for t in present]
    return torch.cat(parts)


def candidate(run: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """The runtime's outputs made comparable the same way."""
    return lambda *inputs: comparable(run(*inputs), inputs[1])


def _float_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
