"""Gemma 2 (Gemma2ForCausalLM): llama.cpp's `gemma2`. Norms around the attention and the MLP
(post_attention_norm, ffn_norm before the MLP, post_ffw_norm after); Gemma's RMSNorm multiplies by
(1 + weight), llama.cpp by weight, so every norm is stored + 1. Logit soft-capping and the sliding
window are hyperparameters; the output is tied to the embeddings."""
from modelkit.models._hf import DECODER_HPARAMS, DECODER_TENSORS
from modelkit.models.plugin import HFFamily

GEMMA_TENSORS = {
    **DECODER_TENSORS,
    "model.layers.{n}.post_attention_layernorm.weight": "blk.{n}.post_attention_norm.weight",
    "model.layers.{n}.pre_feedforward_layernorm.weight": "blk.{n}.ffn_norm.weight",
    "model.layers.{n}.post_feedforward_layernorm.weight": "blk.{n}.post_ffw_norm.weight",
}

FAMILY = HFFamily(
    model_types=("gemma2",),
    hf_class="Gemma2ForCausalLM",
    architecture="gemma2",
    tensors=GEMMA_TENSORS,
    hparams={**DECODER_HPARAMS, "attention.sliding_window": "sliding_window",
             "attn_logit_softcapping": "attn_logit_softcapping",
             "final_logit_softcapping": "final_logit_softcapping"},
    norm_offset=1.0,
    head_dims=True,
    query_scale_27b=46,
    prunable=True,
)
