"""Mistral (MistralForCausalLM): llama.cpp stores it as `llama` (convert_hf_to_gguf.py registers
MistralForCausalLM with its Llama class): Llama's names, hyperparameters and Q/K permutation.
llama.cpp's llama architecture has no sliding-window key, so `sliding_window` is not written (it
matters only past 4096 tokens for the models that set it)."""
from dataclasses import replace

from modelkit.models.llama import FAMILY as LLAMA

FAMILY = replace(LLAMA, model_types=("mistral",), hf_class="MistralForCausalLM")
