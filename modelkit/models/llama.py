"""Llama (LlamaForCausalLM): llama.cpp's `llama` architecture, Q/K rows permuted for ggml's RoPE.

Llama-3 rope scaling (`rope_type: llama3`) travels as llama.cpp's `rope_freqs.weight` tensor. tinylm,
our zoo's Llama, is stored through this same table.
"""
from modelkit.models._hf import DECODER_HPARAMS, DECODER_TENSORS
from modelkit.models.plugin import HFFamily

FAMILY = HFFamily(
    model_types=("llama",),
    hf_class="LlamaForCausalLM",
    architecture="llama",
    tensors=DECODER_TENSORS,
    hparams=DECODER_HPARAMS,
    rope_permute=True,
    prunable=True,
)
