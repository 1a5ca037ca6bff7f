"""Qwen2 (Qwen2ForCausalLM): llama.cpp's `qwen2`: Llama's names plus Q/K/V biases; rotate-half RoPE
(NEOX) in llama.cpp too, so no permutation. Small models tie the output to the embeddings."""
from modelkit.models._hf import DECODER_HPARAMS, DECODER_TENSORS, QK_BIASES
from modelkit.models.plugin import HFFamily

FAMILY = HFFamily(
    model_types=("qwen2",),
    hf_class="Qwen2ForCausalLM",
    architecture="qwen2",
    tensors={**DECODER_TENSORS, **QK_BIASES},
    hparams=DECODER_HPARAMS,
    prunable=True,
)
