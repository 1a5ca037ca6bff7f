"""Structured-pruning groups of the Hugging Face families (and the zoo's tinylm, a Llama decoder): where
each attention head and MLP hidden unit sits, in the three layouts the families store.

- Llama-style (llama, mistral, qwen2, qwen3, gemma2, gemma3, tinylm): separate q/k/v/o and gate/up/down.
- Phi-3: q, k and v are consecutive row runs of one `qkv_proj`, gate and up the two halves of `gate_up_proj`;
  the slices name their run (`PruneSlice.start` / `length`), so the three (or two) are cut together.
- GPT-2: Conv1D layers store weights (in, out), so a hidden unit is a column of `c_fc` (with its bias) and a
  row of the MLP's `c_proj`. Its heads stay: transformers' GPT-2 derives head_dim as n_embd / n_head and
  sizes `c_attn` and `c_proj` from n_embd alone, so no config holds fewer heads at the same residual width.

Heads are ranked by the product of the norms of their query rows and output columns, hidden units by the
product of the norms of the rows and columns that hold them. Under grouped-query attention each key/value
head keeps the same number of query heads; under multi-head attention a head goes with its key and value
rows. head_dim becomes explicit in the config (it no longer equals hidden_size / num_attention_heads).
No torch at import.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from modelkit.models._hf import FUSED_QKV, head_dim, rope_parameters, text_config
from modelkit.models.plugin import HFFamily, PruneGroup, PruneSlice

GPT2_QKV = "transformer.h.{n}.attn.c_attn.weight"
GPT2_KEPT = ("gpt2: attention heads kept (transformers' GPT-2 needs n_head x head_dim == n_embd, and the residual "
             "width is not pruned); MLP hidden units pruned")
LONGROPE_KEPT = ("phi3: attention heads kept (transformers checks longrope's short/long factors against "
                 "hidden_size / num_attention_heads, so the head count cannot change); MLP hidden units pruned")


def _heads(parts: Callable[[str], list[PruneSlice]], output: PruneSlice, heads: int, kv_heads: int,
           head_dim: int) -> PruneGroup:
    """One block's attention heads: `parts(name)` gives the slices holding projection "q", "k" or "v"."""
    mha = kv_heads == heads
    slices = [s for n in (("q", "k", "v") if mha else ("q",)) for s in parts(n)]
    return PruneGroup((*slices, output), "num_attention_heads", buckets=1 if mha else kv_heads,
                      pinned={"head_dim": head_dim}, also_counts={"num_key_value_heads": 1} if mha else {})


def decoder_prune_groups(layers: int, heads: int, kv_heads: int, head_dim: int, *,
                         attention_bias: bool = False, mlp_bias: bool = False) -> list[PruneGroup]:
    """A Llama-style decoder's groups, per block: attention heads (q/k/v rows, their biases, o_proj columns)
    and SwiGLU hidden units (a gate row, an up row and a down column together)."""
    groups = []
    for i in range(layers):
        p = f"model.layers.{i}"

        def parts(n: str, p: str = p) -> list[PruneSlice]:
            weight = PruneSlice(f"{p}.self_attn.{n}_proj.weight", 0, width=head_dim, score=n == "q")
            return [weight, PruneSlice(f"{p}.self_attn.{n}_proj.bias", 0, width=head_dim)] if attention_bias else [weight]

        groups.append(_heads(parts, PruneSlice(f"{p}.self_attn.o_proj.weight", 1, width=head_dim, score=True),
                             heads, kv_heads, head_dim))
        mlp = [PruneSlice(f"{p}.mlp.{n}_proj.weight", d, score=True) for n, d in (("gate", 0), ("up", 0), ("down", 1))]
        if mlp_bias:
            mlp += [PruneSlice(f"{p}.mlp.gate_proj.bias", 0), PruneSlice(f"{p}.mlp.up_proj.bias", 0)]
        groups.append(PruneGroup(tuple(mlp), "intermediate_size"))
    return groups


def _longrope(config: Mapping[str, Any]) -> bool:
    rope = rope_parameters(config)
    return rope.get("short_factor") is not None or rope.get("long_factor") is not None


def phi3_prune_groups(config: Mapping[str, Any]) -> list[PruneGroup]:
    """Phi-3's groups, per block: heads as row runs of qkv_proj (q, then k, then v) with o_proj's columns, and
    hidden units as a row of each half of gate_up_proj (gate, then up) with down_proj's column. A longrope
    model keeps its heads (LONGROPE_KEPT)."""
    heads = int(config["num_attention_heads"])
    kv_heads, hd, inner = int(config.get("num_key_value_heads") or heads), head_dim(config), int(config["intermediate_size"])
    runs = {"q": (0, heads * hd), "k": (heads * hd, kv_heads * hd), "v": ((heads + kv_heads) * hd, kv_heads * hd)}
    longrope = _longrope(config)
    groups = [PruneGroup((), "num_attention_heads", kept=LONGROPE_KEPT)] if longrope else []
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}"
        if not longrope:
            def parts(n: str, p: str = p) -> list[PruneSlice]:
                return [PruneSlice(f"{p}.self_attn.qkv_proj.weight", 0, width=hd, score=n == "q",
                                   start=runs[n][0], length=runs[n][1])]

            groups.append(_heads(parts, PruneSlice(f"{p}.self_attn.o_proj.weight", 1, width=hd, score=True),
                                 heads, kv_heads, hd))
        gate_up = [PruneSlice(f"{p}.mlp.gate_up_proj.weight", 0, score=True, start=s, length=inner) for s in (0, inner)]
        groups.append(PruneGroup((*gate_up, PruneSlice(f"{p}.mlp.down_proj.weight", 1, score=True)), "intermediate_size"))
    return groups


def gpt2_prune_groups(config: Mapping[str, Any]) -> list[PruneGroup]:
    """GPT-2's groups: per block, hidden units as a column of c_fc (Conv1D: in, out) and its bias with a row
    of the MLP's c_proj; the heads stay (GPT2_KEPT)."""
    groups = [PruneGroup((), "n_head", kept=GPT2_KEPT)]
    for i in range(int(config["n_layer"])):
        p = f"transformer.h.{i}.mlp"
        groups.append(PruneGroup((PruneSlice(f"{p}.c_fc.weight", 1, score=True), PruneSlice(f"{p}.c_fc.bias", 0),
                                  PruneSlice(f"{p}.c_proj.weight", 0, score=True)), "n_inner"))
    return groups


def prune_groups(family: HFFamily, config: Mapping[str, Any]) -> list[PruneGroup] | None:
    """A family's structured-pruning groups (`HFFamily.prunable`), in the layout its tensor names show, or
    None for families with none."""
    if not family.prunable:
        return None
    config = text_config(family, config)
    if FUSED_QKV in family.tensors:
        return phi3_prune_groups(config)
    if GPT2_QKV in family.tensors:
        return gpt2_prune_groups(config)
    heads = int(config["num_attention_heads"])
    return decoder_prune_groups(
        int(config["num_hidden_layers"]), heads, int(config.get("num_key_value_heads") or heads), head_dim(config),
        attention_bias=bool(config.get("attention_bias")) or "model.layers.{n}.self_attn.q_proj.bias" in family.tensors,
        mlp_bias=bool(config.get("mlp_bias")))
