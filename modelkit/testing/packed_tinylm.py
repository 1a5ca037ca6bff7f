"""Small tinylm models on packed quantized weights, shared by the tests of the fused C decode step and forward
(tests/test_fast_decode.py, tests/test_fast_forward.py)."""
from __future__ import annotations

import warnings

import torch

# Grouped-query ratios 1, 3 and 8; head widths 16, 16, 12; key/value rows 64, 32 and 12 (not a multiple of
# the kernels' 8-row tiles); a hidden size of 256 for whole K-quant super-blocks.
CONFIGS = {
    "gqa1": {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 4},
    "gqa3": {"hidden_size": 96, "intermediate_size": 160, "num_attention_heads": 6, "num_key_value_heads": 2},
    "gqa8": {"hidden_size": 96, "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 1},
    "k256": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2},
}
WINDOW = 24
# Each kind of activations the C code rounds (q8_0 blocks; int4's pair order; q8_K super-blocks, and q4_k_m's
# q5_0/q8_0 stand-ins at rows of 96; int8-dynamic's one scale per row), each grouped-query ratio.
CASES = [("gqa1", "q8_0"), ("gqa3", "int4"), ("gqa3", "q4_k_m"), ("gqa8", "q4_0"), ("gqa8", "int8"), ("k256", "q4_k_m"),
         ("gqa3", "q5_0"), ("gqa8", "q4_1"),      # q5_0 / q4_1: the legacy kernels (q4_k_m stores some rows so too)
         ("gqa3", "int8-dynamic")]


def tinylm(config: str, scheme: str | None) -> torch.nn.Module:
    """A 2-block tinylm of CONFIGS[config] with a window of WINDOW positions, quantized with `scheme` (None:
    float)."""
    from modelkit import schemes
    from modelkit.models import build
    from modelkit.pipeline.quantize import quantize_module

    model = build("tinylm", {**CONFIGS[config], "num_hidden_layers": 2, "max_position_embeddings": WINDOW},
                  seed=1).eval()
    if scheme is None:
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_module(model, schemes.load_scheme(scheme)()).eval()
