"""mlp: the classic multilayer perceptron, Linear-ReLU-Linear-ReLU-Linear, on two 2-D spirals."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from modelkit.errors import ConfigError
from modelkit.models.plugin import (
    Axis,
    DistillDefaults,
    KerasLayer,
    KerasLayout,
    KerasWeight,
    NoTorch,
    PruneGroup,
    PruneSlice,
    QualityBar,
)

try:
    import torch
    from torch import nn

    from modelkit.models._data import spiral_split
    from modelkit.models._tasks import ClassificationTask, TrainDefaults
except ImportError:         # a slim install: the config and Keras layout below work without torch (plugin.NoTorch)
    torch = nn = None


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Args:
        in_features: Input width (2 for the spirals).
        hidden: Widths of the hidden layers, in order.
        num_classes: Output logits.
    """

    in_features: int = 2
    hidden: tuple[int, ...] = (30, 20)
    num_classes: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(self.hidden))  # JSON gives lists
        if self.in_features < 1 or self.num_classes < 2 or any(h < 1 for h in self.hidden):
            raise ConfigError(
                f"mlp: widths must be positive and num_classes >= 2, got in_features={self.in_features}, "
                f"hidden={list(self.hidden)}, num_classes={self.num_classes}"
            )


class MLP(nn.Module if nn is not None else NoTorch):
    """(B, in_features) float32 -> (B, num_classes) logits. Layers live in `net` (a Sequential)."""

    arch: ClassVar[str] = "mlp"

    def __init__(self, config: MLPConfig | None = None) -> None:
        super().__init__()
        self.config = config or MLPConfig()
        widths = (self.config.in_features, *self.config.hidden)
        layers: list[nn.Module] = []
        for width_in, width_out in zip(widths, widths[1:], strict=False):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], self.config.num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


CONFIG = MLPConfig
MODEL = MLP
TASK = ClassificationTask(spiral_split) if torch is not None else None
TRAINING = TrainDefaults(epochs=40, batch_size=64, lr=1e-2, weight_decay=1e-4) if torch is not None else None


def example_inputs(batch_size: int = 4, *, seed: int = 0) -> torch.Tensor:
    """Points like the training data: (B, 2) float32."""
    return torch.randn(batch_size, 2, generator=torch.Generator().manual_seed(seed))


def keras_layers(config: MLPConfig) -> KerasLayout:
    """Sequential([Input((in,)), Dense(h, activation='relu'), ..., Dense(classes)]): net.0, net.2, ..."""
    widths = (*config.hidden, config.num_classes)
    layers = tuple(KerasLayer("dense", (KerasWeight(f"net.{2 * i}.weight", "kernel", "dense_kernel"),
                                        KerasWeight(f"net.{2 * i}.bias", "bias")),
                              {"units": width, "activation": "relu" if i < len(config.hidden) else "linear"})
                   for i, width in enumerate(widths))
    described = [f"Dense({w}, activation='relu')" for w in config.hidden] + [f"Dense({config.num_classes})"]
    return KerasLayout(layers, f"Sequential([Input(({config.in_features},)), {', '.join(described)}])",
                       (config.in_features,))


def onnx_axes(config: MLPConfig) -> dict[int, Axis]:
    return {}


def prune_groups(config: MLPConfig) -> list[PruneGroup]:
    """Each hidden layer's neurons: its weight rows (ranked by norm) and bias, the next layer's columns."""
    return [PruneGroup((PruneSlice(f"net.{2 * i}.weight", 0, score=True), PruneSlice(f"net.{2 * i}.bias", 0),
                        PruneSlice(f"net.{2 * i + 2}.weight", 1)), "hidden", index=i)
            for i in range(len(config.hidden))]


# Measured 2026-11-21 with cnn's (bench/compress.py): the classifiers share them.
DISTILL = DistillDefaults(temperature=4.0, alpha=0.9)
STUDENT = {"hidden": [8, 8]}
QUALITY = QualityBar("test", "accuracy", 0.95, "higher")
GGUF = None
