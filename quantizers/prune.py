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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from modelkit.errors import ConfigError, UnsupportedConversionError

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


# --- structured: one function per reference model, each returning (new config, new state) -----

def _keep(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Indices of the units to keep (at least one), in their original order."""
    count = max(1, round(scores.numel() * (1.0 - sparsity)))
    return scores.topk(count).indices.sort().values


def _structured_mlp(state: dict[str, torch.Tensor], config: Any, sparsity: float) -> tuple[dict, dict]:
    hidden = list(config.hidden)
    for i in range(len(hidden)):
        this, nxt = f"net.{2 * i}", f"net.{2 * i + 2}"
        keep = _keep(state[f"{this}.weight"].norm(dim=1), sparsity)              # neuron = weight row
        state[f"{this}.weight"], state[f"{this}.bias"] = state[f"{this}.weight"][keep], state[f"{this}.bias"][keep]
        state[f"{nxt}.weight"] = state[f"{nxt}.weight"][:, keep]
        hidden[i] = keep.numel()
    return {"hidden": hidden}, state


def _structured_cnn(state: dict[str, torch.Tensor], config: Any, sparsity: float) -> tuple[dict, dict]:
    keep1 = _keep(state["conv1.weight"].flatten(1).norm(dim=1), sparsity)      # output channels of conv1
    state["conv1.weight"], state["conv1.bias"] = state["conv1.weight"][keep1], state["conv1.bias"][keep1]
    state["conv2.weight"] = state["conv2.weight"][:, keep1]
    keep2 = _keep(state["conv2.weight"].flatten(1).norm(dim=1), sparsity)
    state["conv2.weight"], state["conv2.bias"] = state["conv2.weight"][keep2], state["conv2.bias"][keep2]
    # fc1 sees the pooled (c2, 4, 4) map flattened channel-major: channel c owns columns 16c..16c+15.
    columns = (keep2[:, None] * 16 + torch.arange(16)[None, :]).flatten()
    state["fc1.weight"] = state["fc1.weight"][:, columns]
    keep3 = _keep(state["fc1.weight"].norm(dim=1), sparsity)
    state["fc1.weight"], state["fc1.bias"] = state["fc1.weight"][keep3], state["fc1.bias"][keep3]
    state["fc2.weight"] = state["fc2.weight"][:, keep3]
    return {"channels": [keep1.numel(), keep2.numel()], "hidden": keep3.numel()}, state


def _structured_tinylm(state: dict[str, torch.Tensor], config: Any, sparsity: float) -> tuple[dict, dict]:
    hd, n_kv = config.head_dim, config.num_key_value_heads
    group = config.num_attention_heads // n_kv
    keep_per_group = max(1, round(group * (1.0 - sparsity)))
    units = max(1, round(config.intermediate_size * (1.0 - sparsity)))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        # Attention heads: each key/value group keeps its best query heads, so GQA stays uniform.
        q = state[f"{p}.self_attn.q_proj.weight"].view(n_kv, group, hd, -1)         # (kv, group, hd, C)
        o = state[f"{p}.self_attn.o_proj.weight"].view(-1, n_kv, group, hd)         # (C, kv, group, hd)
        scores = q.flatten(2).norm(dim=2) * o.permute(1, 2, 0, 3).flatten(2).norm(dim=2)   # (kv, group)
        keep = scores.topk(keep_per_group, dim=1).indices.sort(dim=1).values       # (kv, keep)
        q = torch.stack([q[g, keep[g]] for g in range(n_kv)])                       # (kv, keep, hd, C)
        o = torch.stack([o[:, g, keep[g]] for g in range(n_kv)], dim=1)             # (C, kv, keep, hd)
        state[f"{p}.self_attn.q_proj.weight"] = q.reshape(-1, q.shape[-1]).contiguous()
        state[f"{p}.self_attn.o_proj.weight"] = o.reshape(o.shape[0], -1).contiguous()
        # MLP hidden units: a unit is a gate row, an up row and a down column together.
        gate, up, down = (state[f"{p}.mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        unit_scores = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)
        kept = unit_scores.topk(units).indices.sort().values
        state[f"{p}.mlp.gate_proj.weight"], state[f"{p}.mlp.up_proj.weight"] = gate[kept], up[kept]
        state[f"{p}.mlp.down_proj.weight"] = down[:, kept].contiguous()
    return {"num_attention_heads": n_kv * keep_per_group, "head_dim": hd, "intermediate_size": units}, state


STRUCTURED: dict[str, Callable[[dict, Any, float], tuple[dict, dict]]] = {
    "mlp": _structured_mlp, "cnn": _structured_cnn, "tinylm": _structured_tinylm,
}


def _structured(model: nn.Module, config: PruneConfig) -> nn.Module:
    from modelkit.models import build, config_to_dict

    arch = getattr(type(model), "arch", None)
    if arch not in STRUCTURED:
        raise UnsupportedConversionError(type(model).__name__, "structured pruning",
                                         f"structured pruning knows the reference models ({', '.join(STRUCTURED)})")
    if config.skip:
        raise ConfigError("structured pruning removes units model-wide; --skip applies to magnitude and 2:4 only")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    changes, state = STRUCTURED[arch](state, model.config, config.sparsity)
    new_config = {**config_to_dict(model.config), **changes}
    pruned = build(arch, new_config)
    pruned.load_state_dict(state)
    return pruned.train(model.training)


def config_dict(config: PruneConfig) -> dict[str, Any]:
    return {"scheme": config.scheme, **{k: list(v) if isinstance(v, tuple) else v
                                        for k, v in dataclasses.asdict(config).items()}}
