"""The rotary tables of a Hugging Face Llama-family model as the fused kernels read them: cos and sin of each
position, (positions, head_dim) float32, contiguous, made by the model's own `rotary_emb` (so every rope type it
computes per position comes out as transformers applies it). Shared by the fused forward (hf_forward.py), its
cache continuation (hf_cache.py) and the decoder of `modelkit generate` (pipeline/hf_llama_decoder.py)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rotary_tables(model: nn.Module, length: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions 0..length-1, each (length, head_dim) float32, contiguous, from the model's own
    `rotary_emb` (default, linear, Llama-3 and YaRN scaling; YaRN's attention factor folded in)."""
    positions = torch.arange(length, device=device)[None]
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(probe, positions)
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def cover(entry: Any, model: nn.Module, length: int) -> None:
    """Make a plan entry's tables (`entry.cos`, `entry.sin`) reach `length` positions, doubling as they grow."""
    if len(entry.cos) < length:
        entry.cos, entry.sin = rotary_tables(model, max(length, 2 * len(entry.cos)))
