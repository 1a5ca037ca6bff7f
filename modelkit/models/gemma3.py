"""Gemma 3, the language model (Gemma3ForCausalLM; `gemma3_text`, or the `text_config` of a `gemma3`
folder): llama.cpp's `gemma3`. Gemma 2's layout plus query/key norms; every norm stored + 1; rope
base of the global layers (llama.cpp fixes the local layers' at 10000, as Gemma 3 does)."""
from modelkit.models._hf import DECODER_HPARAMS, QK_NORMS
from modelkit.models.gemma2 import GEMMA_TENSORS
from modelkit.models.plugin import HFFamily

FAMILY = HFFamily(
    model_types=("gemma3_text", "gemma3"),
    hf_class="Gemma3ForCausalLM",
    architecture="gemma3",
    tensors={**GEMMA_TENSORS, **QK_NORMS},
    hparams={**DECODER_HPARAMS, "attention.sliding_window": "sliding_window"},
    norm_offset=1.0,
    head_dims=True,
    query_scale_27b=62,
    text_config="text_config",
    prunable=True,
)
