"""Pruning: zero the least important weights (magnitude, 2:4) or remove whole units (structured).

- magnitude: unstructured; the smallest |w| of each layer (or of all layers, scope="global")
  become zero until `sparsity` of the weights are zero.
- 2:4: semi-structured; in every group of four consecutive weights along the input dimension
  the two smallest become zero (the layout sparse tensor cores expect). Sparsity is 0.5.
  Layers whose input dimension is not a multiple of four stay dense (the report shows them).
- structured: whole output units go (Linear neurons, conv channels, attention heads, MLP hidden
  units), ranked by weight norm; every dependent tensor shrinks with them (the next layer's
  inputs, biases), and the new widths go into the model's config, so the smaller model rebuilds
  from its ArchSpec and converts to every format.

Masks are folded into the weights: the result is a plain model with no hooks and no
`weight_orig` parameters. `keep_masks` holds zeros at zero while fine-tuning.
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from modelkit.errors import ConfigError, UnsupportedConversionError
from modelkit.models.plugin import PruneGroup, PruneSlice

METHODS = ("magnitude", "2:4", "structured")
logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PruneConfig:
    """How to prune.

    Args:
        method: "magnitude", "2:4" or "structured".
        sparsity: Fraction to remove: of the weights (magnitude), or of the units of each
            prunable group (structured). 2:4 always removes half and ignores it.
        scope: magnitude only: "layer" prunes each layer to `sparsity`; "global" ranks all
            weights together, so layers end up with different sparsities.
        skip: fnmatch patterns of module names left dense, e.g. ("fc2", "lm_head").

    Example:
        >>> from modelkit.models import build
        >>> pruned = apply(build("mlp", seed=0), PruneConfig(method="magnitude", sparsity=0.5))
        >>> round(float((pruned.net[2].weight == 0).float().mean()), 2)
        0.5
    """

    scheme: ClassVar[str] = "prune"
    method: str = "magnitude"
    sparsity: float = 0.5
    scope: str = "layer"
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "skip", tuple(self.skip))
        if self.method not in METHODS:
            raise ConfigError(f"unknown pruning method {self.method!r}; known: {', '.join(METHODS)}")
        if not 0.0 <= self.sparsity < 1.0:
            raise ConfigError(f"sparsity must be in [0, 1), got {self.sparsity}")
        if self.scope not in ("layer", "global"):
            raise ConfigError(f"scope must be 'layer' or 'global', got {self.scope!r}")


def _prunable(model: nn.Module, skip: tuple[str, ...]) -> dict[str, nn.Module]:
    """Linear and Conv2d layers not matched by `skip` (embeddings and norms are never pruned)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Conv2d)) and not any(fnmatch.fnmatch(name, p) for p in skip)}


def apply(model: nn.Module, config: PruneConfig) -> nn.Module:
    """Return a pruned copy of `model`; the input model is left unchanged."""
    if config.method == "structured":
        return _structured(model, config)
    pruned = copy.deepcopy(model)
    layers = _prunable(pruned, config.skip)
    with torch.no_grad():
        if config.method == "2:4":
            for name, layer in layers.items():
                if layer.weight.shape[1] % 4:   # the pattern needs whole groups of four inputs
                    logger.info("2:4: leaving %s dense (input dimension %d)", name, layer.weight.shape[1])
                    continue
                layer.weight.mul_(_two_four_mask(layer.weight))
        elif config.scope == "global" and layers:
            scores = torch.cat([m.weight.abs().flatten() for m in layers.values()])
            k = int(config.sparsity * scores.numel())
            if k:
                threshold = scores.kthvalue(k).values
                for layer in layers.values():
                    layer.weight.mul_(_keep_above(layer.weight, threshold))
        else:
            for layer in layers.values():
                k = int(config.sparsity * layer.weight.numel())
                if k:
                    layer.weight.mul_(_keep_above(layer.weight, layer.weight.abs().flatten().kthvalue(k).values))
    return pruned


def _keep_above(weight: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return (weight.abs() > threshold).to(weight.dtype)


def _two_four_mask(weight: torch.Tensor) -> torch.Tensor:
    """Keep the two largest |w| of every four along the input dimension (dim 1)."""
    moved = weight.transpose(0, 1).reshape(weight.shape[1] // 4, 4, -1)          # (in/4, 4, rest)
    keep = moved.abs().argsort(dim=1, descending=True)[:, :2]                     # (in/4, 2, rest)
    mask = torch.zeros_like(moved).scatter_(1, keep, 1.0)
    return mask.reshape(weight.shape[1], *weight.shape[:1], *weight.shape[2:]).transpose(0, 1)


def sparsity_report(model: nn.Module) -> list[dict[str, Any]]:
    """Per prunable layer: zeros, total and the fraction of zero weights, read from the weights."""
    rows = []
    for name, layer in _prunable(model, ()).items():
        zeros = int((layer.weight == 0).sum())
        rows.append({"layer": name, "zeros": zeros, "total": layer.weight.numel(),
                     "sparsity": zeros / max(layer.weight.numel(), 1)})
    return rows


def keep_masks(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Hold today's zeros at zero while training: gradients of pruned weights are masked.

    With zero gradients from the start, AdamW's moments for those weights stay zero, so its
    updates are zero, and decoupled weight decay keeps a zero at zero. Remove the returned
    handles after training (the model then carries no hooks).
    """
    handles = []
    for layer in _prunable(model, ()).values():
        mask = (layer.weight != 0).to(layer.weight.dtype)
        if bool(mask.all()):
            continue
        handles.append(layer.weight.register_hook(lambda grad, mask=mask: grad * mask))
    return handles


# --- structured: the model declares its groups (modelkit.models.plugin.PruneGroup); slicing is here ---

def _keep(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Indices of the units to keep (at least one), in their original order."""
    count = max(1, round(scores.numel() * (1.0 - sparsity)))
    return scores.topk(count).indices.sort().values


def _run(tensor: torch.Tensor, part: PruneSlice) -> tuple[int, int]:
    """Where the slice's units lie along `part.dim`: (start, length)."""
    length = tensor.shape[part.dim] - part.start if part.length is None else part.length
    if part.start < 0 or length <= 0 or part.start + length > tensor.shape[part.dim] or length % part.width:
        raise ConfigError(f"structured pruning: {part.tensor} has {tensor.shape[part.dim]} entries along dim {part.dim}, "
                          f"not whole units of {part.width} at {part.start}..{part.start + length}")
    return part.start, length


def _units(tensor: torch.Tensor, part: PruneSlice) -> torch.Tensor:
    """The slice's run as (units, everything else): unit u is `part.width` consecutive entries along `part.dim`."""
    moved = tensor.narrow(part.dim, *_run(tensor, part)).movedim(part.dim, 0)
    return moved.reshape(moved.shape[0] // part.width, -1)


def _group_keep(state: dict[str, torch.Tensor], group: PruneGroup, sparsity: float) -> torch.Tensor:
    scores = None
    for part in group.slices:
        if part.score:
            norms = _units(state[part.tensor], part).norm(dim=1)
            scores = norms if scores is None else scores * norms
    if scores is None:
        raise ConfigError(f"pruning group {group.config_key!r} scores no tensor (set score=True on one slice)")
    if group.buckets == 1:
        return _keep(scores, sparsity)
    per = scores.numel() // group.buckets
    keep = max(1, round(per * (1.0 - sparsity)))
    kept = scores.view(group.buckets, per).topk(keep, dim=1).indices.sort(dim=1).values    # (buckets, keep)
    return (kept + torch.arange(group.buckets)[:, None] * per).flatten()


def _take(tensor: torch.Tensor, parts: list[PruneSlice], units: torch.Tensor) -> torch.Tensor:
    """Keep `units` of every run the slices (one tensor, one dim) name, and every entry outside those runs."""
    dim = parts[0].dim
    keep = torch.ones(tensor.shape[dim], dtype=torch.bool)
    for part in parts:
        start, length = _run(tensor, part)
        keep[start:start + length] = False
        keep[start + (units[:, None] * part.width + torch.arange(part.width)[None, :]).flatten()] = True
    return tensor.index_select(dim, keep.nonzero().flatten()).contiguous()


def _apply_groups(state: dict[str, torch.Tensor], groups: list[PruneGroup], config: dict[str, Any],
                  sparsity: float) -> None:
    """Shrink `state` and `config` in place, group after group."""
    for group in groups:
        missing = [part.tensor for part in group.slices if part.tensor not in state]
        if missing:
            raise ConfigError(f"structured pruning: the model has no plain weight {missing[0]!r} (quantized layers "
                              "are pruned as their float model: dequantize first)")
        if group.kept:                  # units the family cannot remove (the report prints why)
            continue
        units = _group_keep(state, group, sparsity)
        cuts: dict[tuple[str, int], list[PruneSlice]] = {}      # the runs of a fused tensor are cut together
        for part in group.slices:
            cuts.setdefault((part.tensor, part.dim), []).append(part)
        for (name, _), parts in cuts.items():
            state[name] = _take(state[name], parts, units)
        config.update(group.pinned)
        config.update({key: units.numel() * per_unit for key, per_unit in group.also_counts.items()})
        if group.index is None:
            config[group.config_key] = units.numel()
        else:
            values = list(config[group.config_key])
            values[group.index] = units.numel()
            config[group.config_key] = values


def _groups(model: nn.Module) -> tuple[Any, list[PruneGroup]]:
    """The model's ArchSpec and the pruning groups its model module declares."""
    from modelkit.models import MODELS, arch_spec, config_from_dict, hf_config_of, hf_families, load_model_module

    hf = hf_config_of(model) is not None
    spec = arch_spec(model) if hf or getattr(type(model), "arch", None) in MODELS else None
    groups = load_model_module(spec.name).prune_groups(config_from_dict(spec.name, spec.config)) if spec else None
    if groups is None:
        prunable = ", ".join(n for n, f in hf_families().items() if f.prunable)
        raise UnsupportedConversionError(type(model).__name__, "structured pruning",
                                         "structured pruning needs a model that declares its prune_groups: "
                                         f"the zoo's {', '.join(sorted(n for n, i in MODELS.items() if not i.hf))} "
                                         f"or a Hugging Face {prunable} model"
                                         + (f" ({spec.name} declares none)" if hf else ""))
    return spec, groups


def kept_units(model: nn.Module) -> list[str]:
    """Why structured pruning leaves some of `model`'s units in place (GPT-2's heads): one line each."""
    return [group.kept for group in _groups(model)[1] if group.kept]


def _structured(model: nn.Module, config: PruneConfig) -> nn.Module:
    """The model's declared groups applied to a copy of its weights, rebuilt at the new widths: a zoo model,
    or a transformers model of a `prunable` Hugging Face family (its config.json gets the new sizes)."""
    from modelkit.models import build

    spec, groups = _groups(model)
    if config.skip:
        raise ConfigError("structured pruning removes units model-wide; --skip applies to magnitude and 2:4 only")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    new_config = dict(spec.config)
    _apply_groups(state, groups, new_config, config.sparsity)
    pruned = build(spec.name, new_config).to(next(model.parameters()).dtype)
    pruned.load_state_dict(state)
    return pruned.train(model.training)


def config_dict(config: PruneConfig) -> dict[str, Any]:
    return {"scheme": config.scheme, **{k: list(v) if isinstance(v, tuple) else v
                                        for k, v in dataclasses.asdict(config).items()}}
