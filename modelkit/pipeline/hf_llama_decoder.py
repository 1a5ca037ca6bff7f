"""Hugging Face Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3) with a static key/value cache and the
fused C decode step (quantizers/fast_decode.py): what `modelkit generate` and serve run on a packed-weight
model of these families, such as a GGUF file, instead of transformers' own loop.

The decoder is tinylm's (pipeline/tinylm_decoder.py) with the family's differences:
- the prompt runs in one C call too (DecodePlan.forward writing the static cache); where the plan does not
  apply, through transformers' own forward (its DynamicCache copied into the static cache);
- the rotary tables are the model's own `rotary_emb` at every position of the window (default, linear,
  Llama-3 and YaRN scaling, YaRN's attention factor folded in);
- Qwen3's per-head query/key RMSNorms; Qwen2's q/k/v biases are the products' own biases;
- no cropping: a sequence longer than the window runs full passes over all its tokens.

`llama_decoder` says None (the caller keeps transformers' path) for other families, a float model (no plan),
rope types whose tables change with the length (dynamic, longrope), sliding-window attention that would
reach inside the window, or an attention scale other than 1/sqrt(head_dim) (`unsupported`, shared with the
fused forward pass of these models, quantizers/hf_forward.py, as are the rotary tables and the block modules).
GGUF's Q/K row permutation is undone when the file is read (models/_hf.py from_llama_rope), so the products
here are in Hugging Face's rotate-half layout, as the C step's rotary expects.
"""
from __future__ import annotations

import torch
from torch import nn

from modelkit.errors import ConfigError
from modelkit.pipeline.tinylm_decoder import Cached, TinyLMDecoder
from modelkit.quantizers.hf_forward import unsupported
from modelkit.quantizers.hf_rotary import rotary_tables


class HFLlamaDecoder(TinyLMDecoder):
    """A Llama-family transformers model with a static cache of `window` positions per slot (see the module
    docstring; check `unsupported` first)."""

    def __init__(self, model: nn.Module, slots: int, *, window: int, fused: bool = True) -> None:
        from modelkit.testing.causal_lm import _cache_argument

        reason = unsupported(model, window)
        if reason is not None:
            raise ConfigError(f"the fused Llama-family decoder does not take this model: {reason}")
        self.cache_argument = _cache_argument(model)
        super().__init__(model, slots, fused=fused, window=window)

    def _rotary_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_tables(self.model, self.window, self.device)

    def _head_norms(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if hasattr(attn, "q_norm"):
            return attn.q_norm(q), attn.k_norm(k)
        return q, k

    def prefill(self, seq: Cached) -> torch.Tensor:
        """The prompt in one call of the kernels into a cache slot (TinyLMDecoder._fused_prefill) where the plan
        applies; else transformers' forward over it, its keys and values copied into the slot."""
        from transformers.cache_utils import DynamicCache

        from modelkit.testing.causal_lm import returned_cache

        if len(seq.ids) >= self.window:
            return self._full(seq)
        fused = self._fused_prefill(seq)
        if fused is not None:
            return fused
        T = len(seq.ids)
        out = self.model(input_ids=torch.tensor([seq.ids], device=self.device), use_cache=True,
                         **{self.cache_argument: DynamicCache(config=self.model.config)})
        slot = self._take_slot(seq)
        for i, layer in enumerate(returned_cache(out).layers):
            self.keys[i, slot, :, :T], self.values[i, slot, :, :T] = layer.keys[0], layer.values[0]
        return out.logits[0, -1]

    def _full(self, seq: Cached) -> torch.Tensor:
        """A full pass over every token (no cropping: the model's positions go on)."""
        self.release(seq)
        return self.model(input_ids=torch.tensor([seq.ids], device=self.device), use_cache=False).logits[0, -1]


def llama_decoder(model: nn.Module, slots: int, window: int) -> HFLlamaDecoder | None:
    """An HFLlamaDecoder whose single-sequence steps run fused, or None where the model is not one it takes or
    its products are not all packed weights (the caller keeps transformers' path)."""
    from modelkit.quantizers._modules import QuantizedLinear

    if unsupported(model, window) is not None or type(model.model.layers[0].self_attn.q_proj) is not QuantizedLinear:
        return None         # (the second test only spares a float model the cache; the plan checks every layer)
    decoder = HFLlamaDecoder(model, slots, window=window)
    return decoder if decoder.plan is not None else None
