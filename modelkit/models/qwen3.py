"""Qwen3 (Qwen3ForCausalLM): llama.cpp's `qwen3`: Llama's names plus per-head RMS norms on queries
and keys (`attn_q_norm`, `attn_k_norm`); head_dim is explicit (key_length / value_length when it
differs from hidden / heads); NEOX RoPE, no permutation."""
from modelkit.models._hf import DECODER_HPARAMS, DECODER_TENSORS, QK_NORMS
from modelkit.models.plugin import HFFamily

FAMILY = HFFamily(
    model_types=("qwen3",),
    hf_class="Qwen3ForCausalLM",
    architecture="qwen3",
    tensors={**DECODER_TENSORS, **QK_NORMS},
    hparams=DECODER_HPARAMS,
    prunable=True,
)
