"""Phi-3 (Phi3ForCausalLM): llama.cpp's `phi3`. Hugging Face stores the attention projections fused
(`qkv_proj` -> `attn_qkv`) and the MLP's gate and up fused (`gate_up_proj` -> `ffn_up`); llama.cpp
reads them fused too, so they are stored as they are. NEOX RoPE: no permutation. Structured pruning cuts
the kept heads' and units' rows inside the fused tensors (modelkit.models._hf_prune)."""
from modelkit.models._hf import DECODER_HPARAMS
from modelkit.models.plugin import HFFamily

FAMILY = HFFamily(
    model_types=("phi3",),
    hf_class="Phi3ForCausalLM",
    architecture="phi3",
    tensors={
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
        "model.layers.{n}.input_layernorm.weight": "blk.{n}.attn_norm.weight",
        "model.layers.{n}.self_attn.qkv_proj.weight": "blk.{n}.attn_qkv.weight",
        "model.layers.{n}.self_attn.o_proj.weight": "blk.{n}.attn_output.weight",
        "model.layers.{n}.post_attention_layernorm.weight": "blk.{n}.ffn_norm.weight",
        "model.layers.{n}.mlp.gate_up_proj.weight": "blk.{n}.ffn_up.weight",
        "model.layers.{n}.mlp.down_proj.weight": "blk.{n}.ffn_down.weight",
    },
    hparams={**DECODER_HPARAMS, "attention.sliding_window": "sliding_window"},
    prunable=True,
)
