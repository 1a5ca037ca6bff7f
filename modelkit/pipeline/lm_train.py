"""Training a Hugging Face causal language model on text: next-token loss on windows of its own tokenizer's ids.

The one loop that trains a transformers model in modelkit: quantization-aware training of a folder
(`modelkit quantize FOLDER OUT --qat`) and fine-tuning after pruning one (`modelkit prune FOLDER OUT
--finetune-epochs N`). The text is a UTF-8 file (`data`, the CLI's --data) or, by default, the train split of
the standard library's source text (`modelkit.models._data.stdlib_corpus`), split by file from the held-out
split `modelkit eval` measures folders on, so the measured text is never trained on. It is tokenized once with
the model's own tokenizer and cut into windows of `context + 1` tokens (the first `context` are the input, the
last `context` the targets). The optimisation is the zoo's (pipeline/train.py): AdamW, linear warm-up then
cosine decay to a tenth, gradient clipping, a shuffle per epoch from the seed; under torchrun every rank trains
its DistributedSampler shard and DistributedDataParallel averages the gradients.

Example:
    >>> from modelkit.pipeline.load import load_language_model
    >>> lm = load_language_model("./tiny-llama")                                          # doctest: +SKIP
    >>> train_causal_lm(lm.model, lm.tokenizer, LMTrainConfig(steps_per_epoch=50, lr=1e-4))  # doctest: +SKIP
    {'steps': 50, 'windows': ..., 'text': 'standard library (train split)', ...}
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modelkit.errors import ConfigError

PathLike = str | os.PathLike[str]
ProgressFn = Callable[[int, int, Mapping[str, float]], None]     # (step, total steps, {"loss": ..., "epoch": ...})

# Tokens a training window predicts (fewer when the model's context is shorter): long enough for the
# next-token guesses that help on source code, short enough that a CPU step of a 0.5B model takes seconds.
TRAIN_CONTEXT = 256
# Peak learning rate when none is given: fine-tuning a trained model (QAT, recovery after pruning), not training
# one; the order Hugging Face fine-tuning recipes use for 0.5B-8B models (1e-5 to 5e-5).
TRAIN_LR = 2e-5
# The default text: the first this many bytes of the standard library's train split (about 250,000-450,000
# tokens with a 32k-150k vocabulary; `--steps` reads only what its steps need).
TRAIN_TEXT_BYTES = 1_000_000
# Bytes a token covers at most, to read only the text a capped run needs (source code: 2-4 with real vocabularies).
_BYTES_PER_TOKEN = 8
DEFAULT_TEXT = "standard library (train split)"


@dataclass(frozen=True, kw_only=True)
class LMTrainConfig:
    """How to train a causal LM on text.

    Args:
        epochs: Passes over the training windows.
        steps_per_epoch: Stop each epoch after this many steps (None: every window).
        lr: Peak AdamW learning rate (None: TRAIN_LR).
        batch_size: Windows a step (global; under torchrun split evenly across ranks).
        context: Tokens a window predicts (None: the model's context length, at most TRAIN_CONTEXT).
        weight_decay: AdamW's decoupled weight decay.
        warmup_steps: Steps of linear warm-up.
        grad_clip: Clip the gradient norm to this (None: no clipping).
        seed: Seeds the shuffles.
        device: "auto" (cuda, then mps, then cpu), "cpu", "cuda" or "mps".
    """

    epochs: int = 1
    steps_per_epoch: int | None = None
    lr: float | None = None
    batch_size: int = 8
    context: int | None = None
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float | None = 1.0
    seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        for name in ("epochs", "steps_per_epoch", "batch_size", "context"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")


def training_text(data: PathLike | None = None, *, max_bytes: int = TRAIN_TEXT_BYTES) -> tuple[str, str]:
    """(text, label): the UTF-8 file `data`, or the start of the standard library's train split."""
    if data is not None:
        try:
            text = Path(data).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{data}: cannot read it as UTF-8 text ({e})") from e
        if not text:
            raise ConfigError(f"{data}: the training text is empty")
        return text, str(data)
    from modelkit.models._data import stdlib_corpus

    return stdlib_corpus("train", max_bytes=max_bytes).decode("utf-8", "replace"), DEFAULT_TEXT


def token_windows(tokenizer: Any, text: str, length: int, *, vocab: int, source: str = "the text",
                  stride: int | None = None) -> torch.Tensor:
    """The text's token ids (no special tokens; transformers' tokenizer) as (windows, length), one window every
    `stride` tokens (default: `length`, back to back).

    Raises:
        ConfigError: the text gives no whole window, or ids the model's vocabulary does not hold.
    """
    ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)
    if len(ids) < length or int(ids.max()) >= vocab:
        raise ConfigError(f"{source}: the tokenizer gives {len(ids)} tokens with ids up to "
                          f"{int(ids.max()) if len(ids) else None} for a vocabulary of {vocab}; "
                          f"a window needs {length} tokens, each below {vocab}")
    return ids.unfold(0, length, stride or length)


def train_causal_lm(model: nn.Module, tokenizer: Any, config: LMTrainConfig | None = None, *,
                    data: PathLike | None = None, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Train `model` (transformers' causal LM, or one prepared for QAT) in place on text; returns what was done:
    steps, windows, context, tokens trained on, the text's label, lr, mean train loss of each epoch, seconds.

    The model is left in eval mode on its training device.
    """
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from modelkit.pipeline import distributed
    from modelkit.pipeline.train import TrainConfig, fused_adamw, lr_at, optimizer_step

    config = config or LMTrainConfig()
    if tokenizer is None:
        raise ConfigError(f"training a {type(model).__name__} on text needs its tokenizer: the model carries no "
                          "tokenizer.json (copy the tokenizer files into its folder)")
    started = time.perf_counter()
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    context = config.context or min(limit or TRAIN_CONTEXT, TRAIN_CONTEXT)
    if limit and context > limit:
        raise ConfigError(f"context {context}: longer than the model's context length {limit}")
    info = distributed.from_environment()
    if config.batch_size % info.world_size:
        raise ConfigError(f"batch size {config.batch_size} does not split evenly across {info.world_size} ranks")
    max_bytes = TRAIN_TEXT_BYTES
    if config.steps_per_epoch is not None:         # read only what the capped run can use
        max_bytes = min(max_bytes, config.steps_per_epoch * config.batch_size * (context + 1) * _BYTES_PER_TOKEN)
    text, label = training_text(data, max_bytes=max_bytes)
    windows = token_windows(tokenizer, text, context + 1, vocab=int(model.config.vocab_size), source=label,
                            stride=context)
    lr = config.lr or TRAIN_LR
    device = distributed.resolve_device(config.device, info)
    dataset = TensorDataset(windows)
    sampler = DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=config.seed)
    loader = DataLoader(dataset, batch_size=config.batch_size // info.world_size, sampler=sampler)
    steps_per_epoch = min(len(loader), config.steps_per_epoch or len(loader))
    total = steps_per_epoch * config.epochs
    schedule = TrainConfig(lr=lr, warmup_steps=config.warmup_steps)      # the zoo's warm-up and cosine decay
    distributed.init(info, device)
    history: list[float] = []
    step = 0
    try:
        model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=config.weight_decay,
                                      fused=fused_adamw(model, device))
        trainee = DistributedDataParallel(model) if info.enabled else model
        trainee.train()
        for epoch in range(config.epochs):
            sampler.set_epoch(epoch)
            loss_sum, batches = 0.0, 0
            for (batch,) in loader:
                if batches == steps_per_epoch:
                    break
                batch = batch.to(device)
                logits = trainee(input_ids=batch[:, :-1], use_cache=False).logits        # (B, T, vocab)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
                optimizer_step(optimizer, model, loss, lr_at(step, total, schedule), config.grad_clip)
                step += 1
                batches += 1
                loss_sum += loss.item()
                if not math.isfinite(loss_sum):
                    raise ConfigError(f"training diverged at step {step} (loss {loss.item()}); lower the learning "
                                      f"rate (it was {lr:g})")
                if progress is not None and info.is_main:
                    progress(step, total, {"loss": loss.item(), "epoch": epoch + 1})
            history.append(loss_sum / max(batches, 1))
        distributed.barrier(info)
    finally:
        distributed.shutdown(info)
        model.eval()
    return {"steps": step, "epochs": config.epochs, "windows": len(windows), "context": context,
            "tokens": step * config.batch_size * context, "text": label, "lr": lr, "train_loss": history,
            "seconds": round(time.perf_counter() - started, 3)}
