"""Knowledge distillation: a small student learns from a trained teacher's output distributions.

loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, labels)

(Hinton et al., 2015: the T^2 factor keeps the soft-target gradients on the same scale as the
hard-label ones when T changes.) For classifiers the distributions are over classes; for tinylm
over the next byte at every position. Training runs through the zoo's own loop
(`modelkit.pipeline.train.train(..., loss=...)`), so it scales out with torchrun like any training.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from modelkit.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """How to mix the teacher's soft targets with the hard labels.

    Args:
        temperature: Softens both distributions; 1 is plain softmax, higher shows more of the
            teacher's "dark knowledge" about wrong classes.
        alpha: Weight of the soft-target term; 1 - alpha weighs the hard-label loss.
    """

    scheme: ClassVar[str] = "distill"
    # The classifiers' defaults; `default_config` gives each reference model its own.
    temperature: float = 4.0
    alpha: float = 0.9

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be positive, got {self.temperature}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha must be in [0, 1], got {self.alpha}")


def default_config(arch: str, *, temperature: float | None = None, alpha: float | None = None) -> DistillConfig:
    """The defaults registered model `arch` declares (its DISTILL; DistillConfig's own for others), with overrides.

    Example:
        >>> default_config("tinylm")
        DistillConfig(temperature=1.0, alpha=0.5)
    """
    from modelkit.models import MODELS, load_model_module

    values = dataclasses.asdict(load_model_module(arch).DISTILL) if arch in MODELS else {}
    values.update({k: v for k, v in (("temperature", temperature), ("alpha", alpha)) if v is not None})
    return DistillConfig(**values)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                      config: DistillConfig) -> torch.Tensor:
    """The mixed loss over (..., classes) logits and (...) integer labels, averaged over items."""
    classes = student_logits.shape[-1]
    s = student_logits.reshape(-1, classes).float()                       # (N, classes)
    t = teacher_logits.reshape(-1, classes).float()
    T = config.temperature
    soft = F.kl_div(F.log_softmax(s / T, dim=-1), F.log_softmax(t / T, dim=-1), reduction="batchmean",
                    log_target=True) * (T * T)
    hard = F.cross_entropy(s, labels.reshape(-1))
    return config.alpha * soft + (1.0 - config.alpha) * hard


class DistillationLoss:
    """The training loop's loss hook: runs the frozen teacher on each batch next to the student.

    `augment` is the task's training augmentation (random shifts for the digits): the student
    and the teacher see the same augmented inputs, as the student would when trained alone.
    """

    def __init__(self, teacher: nn.Module, config: DistillConfig,
                 augment: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.teacher = teacher.eval().requires_grad_(False)
        self.config = config
        self.augment = augment

    def __call__(self, student: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, labels = batch
        if self.augment is not None and student.training:
            inputs = self.augment(inputs)
        with torch.no_grad():
            self.teacher.to(inputs.device)
            teacher_logits = self.teacher(inputs)
        return distillation_loss(student(inputs), teacher_logits, labels, self.config)


def config_dict(config: DistillConfig) -> dict[str, Any]:
    return {"scheme": config.scheme, **dataclasses.asdict(config)}
