"""The reference models ("the zoo"): small, seeded, trained by modelkit itself.

Every model module has the same names, so one training loop and every converter can work
with any of them:

- ``CONFIG``: a frozen dataclass of primitive fields (the ArchSpec's ``config``)
- ``MODEL``: the nn.Module class; ``MODEL(config)`` builds it, ``MODEL.arch`` is its table name
- ``TASK``: data splits, loss and metrics (``modelkit.models._tasks``)
- ``TRAINING``: the default recipe (epochs, batch size, learning rate, ...)
- ``example_inputs(batch_size)``: a batch shaped like real inputs, for export and checks
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from modelkit.errors import ConfigError, UnknownModelError, did_you_mean

if TYPE_CHECKING:
    from torch import nn

    from modelkit.checkpoint import ArchSpec, Checkpoint


@dataclass(frozen=True)
class ModelInfo:
    name: str          # the ArchSpec name and the CLI's `modelkit train NAME`
    module: str        # imported on first use
    summary: str


MODELS: dict[str, ModelInfo] = {m.name: m for m in (
    ModelInfo("cnn", "modelkit.models.cnn", "small conv net on the 8x8 handwritten digits (UCI optical digits)"),
    ModelInfo("mlp", "modelkit.models.mlp", "Linear-ReLU-Linear-ReLU-Linear on two interleaved 2-D spirals"),
    ModelInfo("tinylm", "modelkit.models.tinylm", "byte-level Llama decoder trained on the Python standard library"),
)}


def load_model_module(name: str) -> ModuleType:
    """Import and return the module of the registered model `name`."""
    info = MODELS.get(name)
    if info is None:
        raise UnknownModelError(name, known=MODELS)
    return importlib.import_module(info.module)


def config_from_dict(name: str, values: Mapping[str, Any] | None = None) -> Any:
    """Build model `name`'s config dataclass from plain values (unknown keys are an error)."""
    config_cls = load_model_module(name).CONFIG
    values = dict(values or {})
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(
            f"{name}: unknown config key {unknown[0]!r}{did_you_mean(unknown[0], fields)}; "
            f"known: {', '.join(sorted(fields))}"
        )
    try:
        return config_cls(**values)
    except TypeError as e:
        raise ConfigError(f"{name}: bad config value ({e})") from e


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config dataclass as JSON-ready values (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def build(name: str, config: Mapping[str, Any] | None = None, *, seed: int | None = None) -> nn.Module:
    """Build a fresh, untrained reference model.

    Args:
        name: A key of MODELS: "mlp", "cnn" or "tinylm".
        config: Constructor values that differ from the defaults, e.g. {"hidden": [64, 32]}.
        seed: Seeds torch's generator first, so the initial weights are reproducible.

    Example:
        >>> from modelkit.models import build
        >>> model = build("mlp", seed=0)
        >>> model.net[0].weight.shape
        torch.Size([30, 2])
    """
    module = load_model_module(name)
    cfg = config_from_dict(name, config)
    if seed is not None:
        import torch

        torch.manual_seed(seed)
    return module.MODEL(cfg)


def arch_spec(model: nn.Module) -> ArchSpec:
    """The ArchSpec that rebuilds `model` (a reference model built by `build`)."""
    from modelkit.checkpoint import ArchSpec

    name = getattr(type(model), "arch", None)
    if name not in MODELS:
        raise ConfigError(f"{type(model).__name__} is not a registered reference model; known: {', '.join(MODELS)}")
    return ArchSpec(name, config_to_dict(model.config))


def build_from_spec(spec: ArchSpec) -> nn.Module:
    """Build the (untrained) module an ArchSpec names."""
    return build(spec.name, spec.config)


def load_factory(reference: str) -> Callable[[], nn.Module]:
    """Import a user's model factory named on the command line or in the API as "pkg.module:function".

    Never called with a name read from a file: files may only name registered models.
    """
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"--arch {reference!r}: expected a registered model ({', '.join(MODELS)}) "
                          "or a factory as pkg.module:function")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--arch {reference!r}: cannot import it ({e})") from e
    if not callable(factory):
        raise ConfigError(f"--arch {reference!r} is not callable")
    return factory


def instantiate(ckpt: Checkpoint, *, arch: ArchSpec | str | None = None, source: str = "checkpoint",
                target: str = "a runnable model") -> nn.Module:
    """Rebuild a runnable module from a checkpoint: its ArchSpec (or `arch`) plus its weights.

    Args:
        ckpt: The weights (and usually the ArchSpec).
        arch: Overrides the file: an ArchSpec, a registered model name (the file's config is kept
            when it names the same model), or a user factory "pkg.module:function".
        source, target: Names for error messages ("m.safetensors", "onnx").

    Raises:
        UnsupportedConversionError: no architecture is known.
        ConfigError: the weights do not fit the architecture.
    """
    from modelkit.checkpoint import ArchSpec
    from modelkit.errors import UnsupportedConversionError

    if isinstance(arch, str) and ":" in arch:
        model = load_factory(arch)()
        label = arch
    else:
        if isinstance(arch, str):
            arch = ArchSpec(arch, ckpt.arch.config if ckpt.arch and ckpt.arch.name == arch else {})
        spec = arch or ckpt.arch
        if spec is None:
            raise UnsupportedConversionError(
                source, target,
                f"the file names no architecture; pass --arch NAME (one of {', '.join(MODELS)}) "
                "or --arch pkg.module:factory (API: arch=...)",
            )
        model = build_from_spec(spec)
        label = spec.name
    state = ckpt.materialize()
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"{source}: weights do not fit architecture {label!r}"
            + (f"; missing {missing[:3]}" if missing else "") + (f"; unexpected {unexpected[:3]}" if unexpected else "")
        )
    wrong = [k for k in expected if tuple(expected[k].shape) != tuple(state[k].shape)]
    if wrong:
        raise ConfigError(f"{source}: weights do not fit architecture {label!r}; {wrong[0]} is "
                          f"{list(state[wrong[0]].shape)}, the model expects {list(expected[wrong[0]].shape)}")
    model.load_state_dict(state)
    return model.eval()
