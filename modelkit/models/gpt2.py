"""GPT-2 (GPT2LMHeadModel): llama.cpp's `gpt2`. Learned positions (`position_embd`), LayerNorm with
biases, fused QKV. Hugging Face's Conv1D layers store weights (in, out): transposed to (out, in) for
GGUF. The causal-mask buffers (`attn.bias`, `attn.masked_bias`) of older files are not weights and
are dropped; the output is tied to the embeddings. Structured pruning removes MLP hidden units only
(modelkit.models._hf_prune: transformers' GPT-2 ties n_head x head_dim to n_embd)."""
from modelkit.models.plugin import HFFamily

_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")

FAMILY = HFFamily(
    model_types=("gpt2",),
    hf_class="GPT2LMHeadModel",
    architecture="gpt2",
    tensors={
        "transformer.wte.weight": "token_embd.weight",
        "transformer.wpe.weight": "position_embd.weight",
        "transformer.ln_f.weight": "output_norm.weight",
        "transformer.ln_f.bias": "output_norm.bias",
        "lm_head.weight": "output.weight",
        **{f"transformer.h.{{n}}.{hf}.{p}": f"blk.{{n}}.{g}.{p}" for hf, g in (
            ("ln_1", "attn_norm"), ("attn.c_attn", "attn_qkv"), ("attn.c_proj", "attn_output"),
            ("ln_2", "ffn_norm"), ("mlp.c_fc", "ffn_up"), ("mlp.c_proj", "ffn_down")) for p in ("weight", "bias")},
    },
    hparams={
        "context_length": "n_positions",
        "embedding_length": "n_embd",
        "block_count": "n_layer",
        "feed_forward_length": "n_inner",
        "attention.head_count": "n_head",
        "attention.layer_norm_epsilon": "layer_norm_epsilon",
    },
    transposed=tuple(f"transformer.h.{{n}}.{c}.weight" for c in _CONV1D),
    dropped=(r"transformer\.h\.\d+\.attn\.(masked_)?bias",),
    float_modules=("transformer.wte", "transformer.wpe", "lm_head"),
    prunable=True,
)
