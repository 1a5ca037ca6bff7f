"""cnn: a small convolutional net on the real 8x8 handwritten digits (UCI optical digits)."""
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
    import torch.nn.functional as F
    from torch import nn

    from modelkit.models._data import digits_split
    from modelkit.models._tasks import ClassificationTask, TrainDefaults
except ImportError:         # a slim install: the config and Keras layout below work without torch (plugin.NoTorch)
    torch = F = nn = None


@dataclass(frozen=True, kw_only=True)
class CNNConfig:
    """Args:
        channels: Output channels of the two 3x3 convolutions.
        hidden: Width of the fully connected layer before the classifier.
        num_classes: Output logits (10 digits).
    """

    channels: tuple[int, int] = (32, 64)
    hidden: int = 128
    num_classes: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "channels", tuple(self.channels))  # JSON gives lists
        if len(self.channels) != 2 or min(self.channels) < 1 or self.hidden < 1 or self.num_classes < 2:
            raise ConfigError(
                f"cnn: need two positive channel counts, a positive hidden width and >= 2 classes, "
                f"got channels={list(self.channels)}, hidden={self.hidden}, num_classes={self.num_classes}"
            )


class CNN(nn.Module if nn is not None else NoTorch):
    """(B, 1, 8, 8) float32 in [0, 1] -> (B, num_classes) logits.

    conv1 (3x3, pad 1) -> ReLU -> conv2 (3x3, pad 1) -> ReLU -> 2x2 max-pool -> fc1 -> ReLU -> fc2
    """

    arch: ClassVar[str] = "cnn"

    def __init__(self, config: CNNConfig | None = None) -> None:
        super().__init__()
        self.config = config or CNNConfig()
        c1, c2 = self.config.channels
        self.conv1 = nn.Conv2d(1, c1, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(c2 * 4 * 4, self.config.hidden)
        self.fc2 = nn.Linear(self.config.hidden, self.config.num_classes)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.conv1(x))                      # (B, c1, 8, 8)
        x = self.pool(self.act(self.conv2(x)))          # (B, c2, 4, 4)
        x = x.flatten(1)                                 # (B, c2 * 16), channel-major as torch flattens
        return self.fc2(self.act(self.fc1(x)))


def random_shift(images: torch.Tensor) -> torch.Tensor:
    """Move each (B, 1, 8, 8) image by up to one pixel in each direction, filling with zeros.

    The digits are centred only roughly, so shifted copies are realistic extra training data
    (test accuracy about +1 point on the 270 test digits).
    """
    B = images.shape[0]
    padded = F.pad(images[:, 0], (1, 1, 1, 1))                                  # (B, 10, 10)
    dy, dx = torch.randint(0, 3, (2, B, 1, 1))                                  # offsets into the padding
    rows = dy + torch.arange(8).view(1, 8, 1)                                   # (B, 8, 1)
    cols = dx + torch.arange(8).view(1, 1, 8)                                   # (B, 1, 8)
    return padded[torch.arange(B).view(B, 1, 1), rows, cols].unsqueeze(1)       # (B, 1, 8, 8)


CONFIG = CNNConfig
MODEL = CNN
TASK = ClassificationTask(digits_split, augment=random_shift) if torch is not None else None
TRAINING = TrainDefaults(epochs=40, batch_size=32, lr=3e-3, weight_decay=1e-4) if torch is not None else None


def example_inputs(batch_size: int = 4, *, seed: int = 0) -> torch.Tensor:
    """Images like the training data: (B, 1, 8, 8) float32 in [0, 1]."""
    return torch.rand(batch_size, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


def _conv(name: str, filters: int) -> KerasLayer:
    return KerasLayer("conv2d", (KerasWeight(f"{name}.weight", "kernel", "conv_kernel"), KerasWeight(f"{name}.bias", "bias")),
                      {"filters": filters, "kernel_size": [3, 3], "padding": "same", "activation": "relu"})


def keras_layers(config: CNNConfig) -> KerasLayout:
    """Conv2D, Conv2D, MaxPooling2D, Flatten, Dense, Dense (channels_last)."""
    c1, c2 = config.channels
    side = 4                                        # 8x8 images, one 2x2 pool
    layers = (_conv("conv1", c1), _conv("conv2", c2), KerasLayer("max_pooling2d", config={"pool_size": [2, 2]}),
              KerasLayer("flatten"),
              KerasLayer("dense", (KerasWeight("fc1.weight", "kernel", "dense_after_flatten", (c2, side, side)),
                                   KerasWeight("fc1.bias", "bias")), {"units": config.hidden, "activation": "relu"}),
              KerasLayer("dense", (KerasWeight("fc2.weight", "kernel", "dense_kernel"), KerasWeight("fc2.bias", "bias")),
                         {"units": config.num_classes, "activation": "linear"}))
    return KerasLayout(layers, (
        f"Sequential([Input(({2 * side}, {2 * side}, 1)), "
        f"Conv2D({c1}, 3, padding='same', activation='relu'), "
        f"Conv2D({c2}, 3, padding='same', activation='relu'), MaxPooling2D(2), Flatten(), "
        f"Dense({config.hidden}, activation='relu'), Dense({config.num_classes})]) "
        "channels_last: images go in as (B, H, W, 1)"), (2 * side, 2 * side, 1))


def onnx_axes(config: CNNConfig) -> dict[int, Axis]:
    return {}


def prune_groups(config: CNNConfig) -> list[PruneGroup]:
    """conv1's and conv2's output channels, then fc1's units, each ranked by its weights' norm."""
    return [
        PruneGroup((PruneSlice("conv1.weight", 0, score=True), PruneSlice("conv1.bias", 0),
                    PruneSlice("conv2.weight", 1)), "channels", index=0),
        # fc1 sees the pooled (c2, 4, 4) map flattened channel-major: channel c owns columns 16c..16c+15.
        PruneGroup((PruneSlice("conv2.weight", 0, score=True), PruneSlice("conv2.bias", 0),
                    PruneSlice("fc1.weight", 1, width=16)), "channels", index=1),
        PruneGroup((PruneSlice("fc1.weight", 0, score=True), PruneSlice("fc1.bias", 0),
                    PruneSlice("fc2.weight", 1)), "hidden"),
    ]


# Measured 2026-11-21 against the same student trained alone (bench/compress.py): T=4, alpha=0.9
# won on seeds 0, 1, 2 (0.970 / 0.978 / 0.974 vs 0.967); T=2, alpha=0.5 did not.
DISTILL = DistillDefaults(temperature=4.0, alpha=0.9)
STUDENT = {"channels": [8, 16], "hidden": 32}      # about a tenth to a quarter of the default teacher
QUALITY = QualityBar("test", "accuracy", 0.96, "higher")
GGUF = None
