"""tinylm: a Llama-architecture byte-level decoder trained on the Python standard library's source.

Architecture as in Hugging Face's LlamaForCausalLM (and llama.cpp's `llama`): RMSNorm before
attention and MLP, rotary position embeddings applied in the "rotate half" layout, SwiGLU MLP,
grouped-query attention, no biases, untied output head. Parameter names are Hugging Face's
(`model.layers.0.self_attn.q_proj.weight`, ...), so other tools' name maps apply unchanged.
The vocabulary is the 256 byte values: token id == byte value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from modelkit.errors import ConfigError
from modelkit.models._hf_prune import decoder_prune_groups
from modelkit.models._tasks import LanguageModelTask, TrainDefaults
from modelkit.models.plugin import Axis, DistillDefaults, GGUFLayout, KerasLayout, PruneGroup, QualityBar


@dataclass(frozen=True, kw_only=True)
class TinyLMConfig:
    """Hyperparameters, named as in Hugging Face's LlamaConfig.

    Args:
        vocab_size: 256: one token per byte value.
        hidden_size: Width of the residual stream.
        intermediate_size: Hidden width of the SwiGLU MLP.
        num_hidden_layers: Decoder blocks.
        num_attention_heads: Query heads; hidden_size must divide evenly.
        num_key_value_heads: Key/value heads shared by groups of query heads (GQA).
        max_position_embeddings: Longest context the model is trained and run on.
        rope_theta: Base of the rotary embedding frequencies.
        rms_norm_eps: Epsilon inside RMSNorm.
        head_dim: Width of each attention head; None means hidden_size / num_attention_heads.
            Set explicitly when heads are pruned away (as Hugging Face's LlamaConfig allows).
    """

    vocab_size: int = 256
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"tinylm: {name} must be a positive integer, got {getattr(self, name)}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"tinylm: hidden_size {self.hidden_size} is not divisible by "
                    f"num_attention_heads {self.num_attention_heads}; set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        elif self.head_dim < 1:
            raise ConfigError(f"tinylm: head_dim must be a positive integer, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"tinylm: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"tinylm: head_dim {self.head_dim} must be even for RoPE")


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 as Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_tables(config: TinyLMConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (T, head_dim), in Hugging Face's half-split layout."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)            # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)             # (T, hd)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, nh, T, hd) queries or keys by position."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)     # (B, T, C) -> (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.n_heads // self.n_kv_heads
        if groups > 1:  # each key/value head serves `groups` query heads
            k = k.repeat_interleave(groups, dim=1)                                       # (B, nh, T, hd)
            v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)                     # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)                # (B, T, nh * hd)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The `model.` prefix of Hugging Face's names: embeddings, layers, final norm."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class TinyLM(nn.Module):
    """Byte-level Llama: (B, T) int64 token ids -> (B, T, vocab) logits."""

    arch: ClassVar[str] = "tinylm"

    def __init__(self, config: TinyLMConfig | None = None) -> None:
        super().__init__()
        self.config = config or TinyLMConfig()
        self.model = Decoder(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # Llama's initializer_range 0.02 for every matrix; norms start at one.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        if T > self.config.max_position_embeddings:
            raise ConfigError(
                f"tinylm: input of {T} tokens exceeds max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
        if not torch.is_grad_enabled():
            # Packed quantized products can run the whole stack in one C call (quantizers/fast_forward.py): asked of
            # the first product, duck-typed, since the models layer imports no quantizer. None: the path below.
            fused = getattr(self.model.layers[0].self_attn.q_proj, "fused_forward", None)
            logits = fused(self, input_ids) if fused is not None else None
            if logits is not None:
                return logits
        x = self.model.embed_tokens(input_ids)                                           # (B, T, C)
        cos, sin = (t.to(x.dtype) for t in rotary_tables(self.config, T, input_ids.device))  # f16/bf16 models too
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))                                          # (B, T, vocab)


@torch.no_grad()
def generate(
    model: TinyLM,
    prompt: bytes,
    *,
    max_new_bytes: int = 200,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
) -> bytes:
    """Continue `prompt` byte by byte: greedy when temperature is 0, else sampled.

    The context is cropped to the model's window, so any length can be generated.
    """
    if max_new_bytes < 0:
        raise ConfigError(f"max_new_bytes must be >= 0, got {max_new_bytes}")
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt) or [ord("\n")]
    window = model.config.max_position_embeddings
    for _ in range(max_new_bytes):
        context = torch.tensor([ids[-window:]], dtype=torch.long, device=device)
        ids.append(next_byte(model(context)[0, -1], temperature, top_k, generator))
    return bytes(ids[len(prompt):] if prompt else ids[1:])


def next_byte(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    """The next token from one row of logits (vocab,): argmax at temperature 0, else a sample of the
    `top_k` most likely (all when None) drawn with `generator` (on the CPU)."""
    logits = logits.float().cpu()
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        cutoff = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, -math.inf)
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


CONFIG = TinyLMConfig
MODEL = TinyLM
# 128-byte windows; 1.0 MB of training text is one pass of 977 steps at batch 8. Measured 2026-11-25
# (bench/tinylm_recipe.py, one thread; validation / test ratio to the unigram baseline, bar 0.55): this
# recipe 0.502 / 0.476 (seeds 1, 2: 0.504 / 0.481, 0.503 / 0.482), in 0.88x the time of the one before
# it (1.2 MB, batch 32, lr 2e-3: 0.509 / 0.479; 172 s against 194 s back to back, 0.80x on a busier
# machine). Small batches at lr 1e-3 learn more from each byte, but the validation text needs the bytes:
# 720 KB reached only 0.566 (batch 8 or 4 at lr 1e-3; batch 8 at lr 5e-4 0.570, 2e-3 0.586, 3e-3 0.604;
# batch 32 at lr 2e-3 0.604) and 900 KB 0.529.
TASK = LanguageModelTask(block=128, train_bytes=1_000_000, eval_bytes=250_000)
TRAINING = TrainDefaults(epochs=1, batch_size=8, lr=1e-3, weight_decay=0.1, warmup_steps=50, grad_clip=1.0)


def example_inputs(batch_size: int = 2, *, seed: int = 0, seq_len: int = 16) -> torch.Tensor:
    """Byte ids like real text windows: (B, T) int64."""
    return torch.randint(0, 256, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))


def keras_layers(config: TinyLMConfig) -> KerasLayout | None:
    return None                 # RMSNorm, rotary attention, SwiGLU: no standard Keras equivalent


def onnx_axes(config: TinyLMConfig) -> dict[int, Axis]:
    return {1: Axis("sequence", max=config.max_position_embeddings)}


def prune_groups(config: TinyLMConfig) -> list[PruneGroup]:
    """Per block: attention heads (each key/value group keeps its best query heads, so GQA stays
    uniform) and SwiGLU hidden units: the Llama decoder's groups (modelkit.models._hf_prune)."""
    return decoder_prune_groups(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                                config.head_dim)


# Measured 2026-11-21 (seed 0, bits/byte, the student alone 2.580): T=1, alpha=0.5 -> 2.519; T=1,
# alpha=1 -> 2.534; T=2, alpha=0.5 -> 2.619; T=4, alpha=0.9 -> 3.046. Next-byte distributions are
# already soft: a high temperature flattens what the small student should copy, and the hard labels still help.
DISTILL = DistillDefaults(temperature=1.0, alpha=0.5)
STUDENT = {"hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2}
QUALITY = QualityBar("val", "ratio_to_unigram", 0.55, "lower")
# llama.cpp's llama conventions (our names and config are Hugging Face Llama's); bytes as tokens, with
# ASCII STX / ETX as begin / end: byte tokens that Python source never contains.
GGUF = GGUFLayout("llama", "bytes", bos_id=0x02, eos_id=0x03)
