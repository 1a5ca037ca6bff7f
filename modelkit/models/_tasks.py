"""What a reference model is trained and measured on: its data splits, loss and metrics.

Metrics are computed from sums (loss, correct, count) so that data-parallel ranks can each
evaluate a shard and add their sums together; `finish` turns the totals into the figures.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from modelkit.models._data import ByteBlocks, check_split, stdlib_corpus, unigram_bits_per_byte

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class TrainDefaults:
    """A model's default training recipe; every field can be overridden from the CLI or API."""

    epochs: int
    batch_size: int
    lr: float
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float | None = None


@dataclass(frozen=True)
class ClassificationTask:
    """Cross-entropy over class logits; reports accuracy and mean loss."""

    load_split: Callable[[str], Dataset]
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None   # applied to training batches only
    kind: str = "classification"
    metric: str = "accuracy"          # the headline figure; higher is better
    higher_is_better: bool = True
    default_split: str = "test"
    eval_batch_size: int = 256        # examples per forward pass when measuring

    def dataset(self, split: str, model: nn.Module | None = None) -> Dataset:
        check_split(split)
        return self.load_split(split)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, labels = batch
        if self.augment is not None and model.training:
            inputs = self.augment(inputs)
        return F.cross_entropy(model(inputs), labels)

    def metric_sums(self, model: nn.Module, batch: Batch) -> dict[str, float]:
        inputs, labels = batch
        logits = model(inputs)
        return {
            "loss": float(F.cross_entropy(logits, labels, reduction="sum")),
            "correct": float((logits.argmax(-1) == labels).sum()),
            "count": float(labels.numel()),
        }

    def finish(self, sums: dict[str, float], split: str) -> dict[str, float]:
        count = max(sums["count"], 1.0)
        return {"accuracy": sums["correct"] / count, "loss": sums["loss"] / count, "examples": sums["count"]}


@dataclass(frozen=True)
class LanguageModelTask:
    """Next-byte prediction on standard-library source; reports bits per byte and perplexity.

    `unigram_bits_per_byte` is the cross-entropy of the same text under byte frequencies of
    the training split: the figure a model that ignores context would reach.
    """

    block: int
    train_bytes: int
    eval_bytes: int
    kind: str = "language-model"
    metric: str = "bits_per_byte"     # lower is better
    higher_is_better: bool = False
    default_split: str = "val"
    # Windows per forward pass when measuring: small enough that the SwiGLU and norm activations stay in
    # cache. tinylm over 256 windows of 128 bytes, one thread, 2026-11-28: 2.94 s of CPU in batches of 256
    # (67 MB activations: its elementwise ops ran at memory speed, 12% of the time), 2.09 s in 32s, 1.96 s
    # in 16s; evaluate() on the val split (1953 windows) 20.1-22.5 s in 256s, 14.3-15.0 s in 32s.
    eval_batch_size: int = 32

    def text(self, split: str) -> bytes:
        check_split(split)
        return stdlib_corpus(split, max_bytes=self.train_bytes if split == "train" else self.eval_bytes)

    def dataset(self, split: str, model: nn.Module | None = None) -> Dataset:
        """Windows of `block` bytes, or of the model's context length when that is shorter."""
        context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        return ByteBlocks(self.text(split), min(self.block, context or self.block))

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        logits = model(inputs)                                            # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def metric_sums(self, model: nn.Module, batch: Batch) -> dict[str, float]:
        inputs, targets = batch
        logits = model(inputs)
        nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return {"nll": float(nll), "count": float(targets.numel())}

    def finish(self, sums: dict[str, float], split: str) -> dict[str, float]:
        nats = sums["nll"] / max(sums["count"], 1.0)
        bits = nats / math.log(2)
        unigram = unigram_bits_per_byte(self.text("train"), self.text(split))
        return {
            "bits_per_byte": bits,
            "perplexity": math.exp(nats),
            "unigram_bits_per_byte": unigram,
            "ratio_to_unigram": bits / unigram,
            "bytes": sums["count"],
        }
