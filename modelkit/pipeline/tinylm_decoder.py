"""tinylm with a static key/value cache: the decoder behind `modelkit serve`'s continuous batching
(pipeline/serve_text.py) and `modelkit generate` on tinylm (pipeline/generate.py).

A cache of (layers, slots, kv_heads, window, head_dim); each sequence holds a slot (running sequences
keep slots 0..n-1, so a step reads views, not copies). tinylm's `generate` crops the context to the
model's window and re-runs it; a sequence that outgrows the window does the same here, one full pass
per token, so the text stays equal.

A step of one cached sequence on a float32 model whose products are all packed quantized weights
(a GGUF or int8/int4 file) runs as one call of the C kernels (quantizers/fast_decode.py): norms,
rotary, attention over this cache and SwiGLU in C around the same weight products; so does the prompt
(DecodePlan.forward: all its tokens in one call that writes their keys and values into the slot).
Anything else runs the torch path below. Hugging Face Llama-family models run through the same class
(pipeline/hf_llama_decoder.py overrides the family's rotary tables, per-head norms and prefill).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from modelkit.quantizers import fast_linear
from modelkit.quantizers.fast_decode import row_reader

TABLE_FLOATS = 1 << 20       # the fused step dequantizes an embedding table up to 4 MB (tinylm's 256 rows) once


class Cached(Protocol):
    """What the decoder reads and writes of a sequence (serve's Job, generate's Stream)."""

    ids: list[int]
    state: Any


@dataclass(eq=False)
class Stream:
    """One sequence decoded alone: its tokens so far and its cache slot (None: none)."""

    ids: list[int]
    state: Any = None


class TinyLMDecoder:
    """tinylm with a key/value cache (see the module docstring)."""

    def __init__(self, model: nn.Module, slots: int, *, fused: bool = True, window: int | None = None) -> None:
        """`fused`: run single-sequence steps in one C call where the model allows (see the module docstring);
        `window`: positions a slot holds (default the model's max_position_embeddings)."""
        self.model = model.eval()
        cfg = model.config
        self.window = window or cfg.max_position_embeddings
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.device = next(model.parameters()).device
        self.dtype = model.model.embed_tokens(torch.zeros(1, dtype=torch.long, device=self.device)).dtype
        shape = (cfg.num_hidden_layers, slots, self.kv_heads, self.window, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.cos, self.sin = (t.to(self.dtype).contiguous() for t in self._rotary_tables())
        self.owners: list[Cached] = []       # slot i holds owners[i]'s cache
        self.plan = self._plan() if fused and self.dtype == torch.float32 and self.device.type == "cpu" else None
        if self.plan is not None:
            self.plan.bind(self.cos, self.sin, self.keys, self.values)
        self.table: torch.Tensor | None = None      # the embedding table in float, for the fused step
        self.row: Callable[[int], torch.Tensor] | None = None      # or a reader of one row (row_reader)

    # ---- what a family changes (HFLlamaDecoder overrides these) ----

    def _rotary_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each (window, head_dim), in the rotate-half layout."""
        from modelkit.models.tinylm import rotary_tables

        return rotary_tables(self.model.config, self.window, self.device)

    def _head_norms(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys (B, T, heads, head_dim) before the rotary; tinylm has no per-head norms."""
        return q, k

    def _plan(self) -> Any:
        """The block stack's plan (each layer's modules as fast_forward.block_modules reads them: Qwen3's per-head
        norms too), or None."""
        from modelkit.quantizers import fast_decode, fast_forward

        blocks = [fast_forward.block_modules(layer) for layer in fast_forward.layers(self.model)]
        body = self.model.model
        return fast_decode.plan(blocks, body.norm, self.model.lm_head, fast_forward.geometry(self.model.config))

    def _fused_step(self, seq: Cached) -> torch.Tensor:
        """The next logits of one cached sequence, in one call of the kernels."""
        if self.table is None and self.row is None:
            embed, cfg = self.model.model.embed_tokens, self.model.config
            # (not `embed.weight` of a quantized layer: that property dequantizes the whole table)
            if type(embed) is nn.Embedding and embed.weight.dtype == torch.float32 and embed.weight.is_contiguous():
                self.table = embed.weight.detach()              # a float table: its rows as they are
            elif cfg.vocab_size * cfg.hidden_size <= TABLE_FLOATS:
                # a quantized table's row costs ~0.1 ms of torch ops to dequantize: a small table once, in float
                self.table = embed(torch.arange(cfg.vocab_size)).to(torch.float32).contiguous()
            else:
                self.row = row_reader(embed)
            if self.table is not None:
                self.plan.bind(self.cos, self.sin, self.keys, self.values, self.table)
        token = seq.ids[-1] if self.row is None else self.row(seq.ids[-1])
        return self.plan.step(token, len(seq.ids) - 1, seq.state)

    def _take_slot(self, seq: Cached) -> int:
        slot = len(self.owners)
        self.owners.append(seq)
        seq.state = slot
        return slot

    def _fused_prefill(self, seq: Cached) -> torch.Tensor | None:
        """The logits after the prompt from one call of the kernels (DecodePlan.forward into the sequence's cache
        slot), or None where the fused path does not apply (no plan, the kernels off, an embedding not float32)."""
        if self.plan is None or fast_linear.ISA is None:
            return None
        x = self.model.model.embed_tokens(torch.tensor([seq.ids], device=self.device))          # (1, T, C)
        if x.dtype != torch.float32:
            return None
        return self.plan.forward(x.contiguous(), self.cos, self.sin, slot=self._take_slot(seq), last_only=True)[0]

    def prefill(self, seq: Cached) -> torch.Tensor:
        """The logits after the prompt; fills a cache slot unless the prompt already fills the window."""
        if len(seq.ids) >= self.window:
            return self._full(seq)
        fused = self._fused_prefill(seq)
        if fused is not None:
            return fused
        from modelkit.models.tinylm import apply_rotary

        slot = self._take_slot(seq)
        ids = torch.tensor([seq.ids], device=self.device)
        T = ids.shape[1]
        x = self.model.model.embed_tokens(ids)                                           # (1, T, C)
        cos, sin = self.cos[:T], self.sin[:T]
        groups = self.heads // self.kv_heads
        for i, layer in enumerate(self.model.model.layers):
            attn, h = layer.self_attn, layer.input_layernorm(x)
            q, k = self._head_norms(attn, attn.q_proj(h).view(1, T, self.heads, self.head_dim),
                                    attn.k_proj(h).view(1, T, self.kv_heads, self.head_dim))
            q, k = q.transpose(1, 2), k.transpose(1, 2)                                  # (1, nh / nkv, T, hd)
            v = attn.v_proj(h).view(1, T, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            self.keys[i, slot, :, :T], self.values[i, slot, :, :T] = k[0], v[0]
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, T, -1)
            x = x + attn.o_proj(y)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.model.model.norm(x[:, -1]))[0]                    # (vocab,)

    def _full(self, seq: Cached) -> torch.Tensor:
        """A full pass over the last window of tokens, as tinylm's generate runs past its window."""
        self.release(seq)
        return self.model(torch.tensor([seq.ids[-self.window:]], device=self.device))[0, -1]

    def step(self, seqs: Sequence[Cached]) -> list[torch.Tensor]:
        """Feed each sequence its last token; the next logits of each, in order."""
        from modelkit.models.tinylm import apply_rotary

        if len(seqs) == 1 and self.plan is not None and fast_linear.ISA is not None and seqs[0].state is not None \
                and len(seqs[0].ids) <= self.window:
            return [self._fused_step(seqs[0])]
        out: dict[int, torch.Tensor] = {}
        cached = []
        for seq in seqs:
            if seq.state is None or len(seq.ids) > self.window:
                out[id(seq)] = self._full(seq)
            else:
                cached.append(seq)
        if cached:
            B = len(cached)
            slots = torch.tensor([s.state for s in cached], device=self.device)
            pos = torch.tensor([len(s.ids) - 1 for s in cached], device=self.device)        # the fed token's position
            width = int(pos.max()) + 1
            mask = (torch.arange(width, device=self.device)[None, :] <= pos[:, None]).view(B, 1, 1, width)
            cos, sin = self.cos[pos].view(B, 1, 1, -1), self.sin[pos].view(B, 1, 1, -1)
            x = self.model.model.embed_tokens(torch.tensor([[s.ids[-1]] for s in cached], device=self.device))
            groups = self.heads // self.kv_heads
            contiguous = bool((slots == torch.arange(B, device=self.device)).all())
            for i, layer in enumerate(self.model.model.layers):
                attn, h = layer.self_attn, layer.input_layernorm(x)                          # (B, 1, C)
                q, k = self._head_norms(attn, attn.q_proj(h).view(B, 1, self.heads, self.head_dim),
                                        attn.k_proj(h).view(B, 1, self.kv_heads, self.head_dim))
                q, k = q.transpose(1, 2), k.transpose(1, 2)                              # (B, nh / nkv, 1, hd)
                v = attn.v_proj(h).view(B, 1, self.kv_heads, self.head_dim).transpose(1, 2)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
                self.keys[i, slots, :, pos], self.values[i, slots, :, pos] = k[:, :, 0], v[:, :, 0]
                if contiguous:      # slots 0..B-1: views of the cache
                    keys, values = self.keys[i, :B, :, :width], self.values[i, :B, :, :width]
                else:
                    keys, values = self.keys[i, slots, :, :width], self.values[i, slots, :, :width]
                # query heads grouped by the key/value head they share: (B, nkv, groups, hd)
                y = F.scaled_dot_product_attention(q.reshape(B, self.kv_heads, groups, self.head_dim), keys, values,
                                                   attn_mask=mask)
                x = x + attn.o_proj(y.reshape(B, 1, self.heads * self.head_dim))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            logits = self.model.lm_head(self.model.model.norm(x[:, 0]))                      # (B, vocab)
            for seq, row in zip(cached, logits, strict=True):
                out[id(seq)] = row
        return [out[id(s)] for s in seqs]

    def release(self, seq: Cached) -> None:
        """Free the sequence's slot; the last slot's sequence moves into it, so slots stay 0..n-1."""
        slot, seq.state = seq.state, None
        if slot is None:
            return
        last = len(self.owners) - 1
        if slot != last:
            moved = self.owners[last]
            self.keys[:, slot], self.values[:, slot] = self.keys[:, last], self.values[:, last]
            self.owners[slot], moved.state = moved, slot
        self.owners.pop()
