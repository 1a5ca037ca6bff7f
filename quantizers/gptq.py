"""GPTQ: int4 (or int8) group-wise weights chosen column by column to cancel each other's error.

After Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers" (2022), Algorithm 1. For each layer, in model order:

1. Run calibration batches (the model's own training data by default) through the model
   whose earlier layers are already quantized, and accumulate the layer's input Hessian
   H = 2/n sum x x^T with a forward hook (convolutions see their unfolded patches).
2. Dampen it (H += damp * mean(diag H) * I), take the upper Cholesky factor of H^-1.
3. Quantize columns left to right (largest diag(H) first with `act_order`); after each column,
   spread its rounding error over the columns not yet quantized, weighted by H^-1, in blocks
   of `block_size` columns with a lazy batch update of the rest.

The result is the same "affine" layout as `int4` (fp16 scale, optional zero point per group of
contiguous input columns), so it loads and runs exactly like round-to-nearest int4. Group
scales are fitted to the partially updated weights when a group starts; with `act_order` the
columns are visited out of order, so scales come from the original weights instead (GPTQ's
"static groups"), which keeps groups contiguous. Embeddings have no Hessian (their input is a
one-hot id) and are rounded to nearest.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from modelkit.errors import ConfigError
from modelkit.quantizers import _affine, _modules
from modelkit.quantizers.int4 import GROUP_SIZES


@dataclass(frozen=True, kw_only=True)
class GPTQConfig:
    """GPTQ for Linear and Conv2d weights (Embeddings: round to nearest).

    Args:
        bits: 4 (packed two per byte, fp16 scales) or 8.
        group_size: Input columns per scale: 32, 64 or 128.
        symmetric: No zero points if True.
        damp: Dampening, as a fraction of the mean of diag(H), added to H's diagonal.
        act_order: Quantize columns in order of decreasing diag(H) (scales from the original
            weights, so groups stay contiguous).
        block_size: Columns updated together before the lazy update of the rest.
        calibration_samples: Training examples run through the model (tinylm: 128-byte windows).
        batch_size: Examples per calibration batch.
        seed: Picks the calibration examples.
        skip: fnmatch patterns of module names left in float.

    Example:
        >>> from modelkit.models import build
        >>> q = apply(build("cnn", seed=0), GPTQConfig(calibration_samples=16))
        >>> q.fc1.scheme
        'gptq'
    """

    scheme: ClassVar[str] = "gptq"
    bits: int = 4
    group_size: int = 32
    symmetric: bool = True
    damp: float = 0.01
    act_order: bool = False
    block_size: int = 128
    calibration_samples: int = 128
    batch_size: int = 32
    seed: int = 0
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ConfigError(f"gptq: bits must be 4 or 8, got {self.bits!r}")
        if self.group_size not in GROUP_SIZES:
            raise ConfigError(f"gptq: group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size!r}")
        if not 0 < self.damp < 1:
            raise ConfigError(f"gptq: damp must be in (0, 1), got {self.damp!r}")
        for name in ("block_size", "calibration_samples", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"gptq: {name} must be a positive integer, got {getattr(self, name)!r}")
        _modules.check_skip(self)

    @property
    def spec(self) -> _affine.AffineSpec:
        return _affine.AffineSpec(bits=self.bits, group_size=self.group_size, symmetric=self.symmetric,
                                  scale_dtype=torch.float16 if self.bits == 4 else torch.float32)


def calibration_batches(model: nn.Module, *, samples: int, batch_size: int, seed: int = 0) -> list[torch.Tensor]:
    """Input batches from a reference model's own training split (a seeded random subset)."""
    from modelkit.models import MODELS, load_model_module

    name = getattr(type(model), "arch", None)
    if name not in MODELS:
        raise ConfigError(f"gptq: {type(model).__name__} is not a reference model; pass calibration batches")
    dataset = load_model_module(name).TASK.dataset("train", model)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:samples]
    inputs = torch.stack([dataset[int(i)][0] for i in order])
    return list(inputs.split(batch_size))


class _Stop(Exception):
    """Raised by the capture hook: the rest of the forward pass is not needed."""


def _layer_inputs(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The columns a layer's weight multiplies: (n, cols) float32."""
    if isinstance(module, nn.Conv2d):
        patches = F.unfold(x, module.kernel_size, dilation=module.dilation, padding=module.padding,
                           stride=module.stride)                                  # (B, C*kh*kw, L)
        return patches.transpose(1, 2).reshape(-1, patches.shape[1]).float()      # (B*L, C*kh*kw)
    return x.reshape(-1, x.shape[-1]).float()


@torch.no_grad()
def next_group(model: nn.Module, layers: list[nn.Module], batches: list[Any]) -> tuple[list[int], torch.Tensor]:
    """Which of `layers` run next, and the Hessian H = 2/n sum x x^T of their shared input.

    One pass per group: hooks on every remaining layer; the first to run defines the group,
    along with the layers that then receive the very same input tensor (q, k and v projections;
    gate and up), and the pass stops at the first layer given anything else.
    """
    members: list[int] = []
    state: dict[str, Any] = {"h": None, "count": 0, "input": None}

    def make_hook(index: int):
        def hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if state["input"] is None:           # the first layer to run in this batch
                state["input"] = x
                if not members:
                    members.append(index)
                elif members[0] != index:
                    raise _Stop
                cols = _layer_inputs(mod, x.detach()).double()
                state["h"] = (cols.T @ cols) if state["h"] is None else state["h"].add_(cols.T @ cols)
                state["count"] += cols.shape[0]
                return
            if x is state["input"] and (index in members or state["first_batch"]):
                if index not in members:
                    members.append(index)
                return
            raise _Stop
        return hook

    handles = [layer.register_forward_pre_hook(make_hook(i)) for i, layer in enumerate(layers)]
    try:
        for number, batch in enumerate(batches):
            state["input"], state["first_batch"] = None, number == 0
            try:
                model(*batch) if isinstance(batch, tuple) else model(batch)
            except _Stop:
                pass
    finally:
        for handle in handles:
            handle.remove()
    if state["h"] is None:
        return [], torch.empty(0)
    return members, (state["h"] * (2.0 / max(state["count"], 1))).float()


def gptq_levels(weight: torch.Tensor, h: torch.Tensor, spec: _affine.AffineSpec, *, damp: float,
                act_order: bool, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ for one (rows, cols) weight and its (cols, cols) Hessian -> (levels, scale, zero point)."""
    w = _affine.as_matrix(weight).clone()
    rows, cols = w.shape
    group = spec.group_size
    h = h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(cols)
    w, h = w[:, perm], h[perm][:, perm]
    h += torch.eye(cols) * (damp * torch.mean(torch.diag(h)))
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except torch.linalg.LinAlgError as e:
        raise ConfigError(f"gptq: the Hessian is not positive definite even after damping {damp}; raise damp") from e

    n_groups = cols // group
    scale = torch.empty(rows, n_groups, dtype=spec.scale_dtype)
    zero = None if spec.symmetric else torch.empty(rows, n_groups)
    if act_order:     # static groups: fitted to the original weights, in original column order
        static_scale, static_zero = _affine.scales(_affine.grouped(weight, spec), spec)
        scale.copy_(static_scale)
        if zero is not None:
            zero.copy_(static_zero)
    levels = torch.empty(rows, cols)
    block_size = max(block_size // group, 1) * group           # whole groups per block
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros(rows, i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            column = int(perm[i1 + i])                       # the original column index
            g = column // group
            if not act_order and column % group == 0:        # a group starts: fit its scale now
                s, z = _affine.scales(w1[:, i:i + group].reshape(rows, 1, group), spec)
                scale[:, g] = s[:, 0]
                if zero is not None:
                    zero[:, g] = z[:, 0]
            s_col = scale[:, g:g + 1]
            z_col = None if zero is None else zero[:, g:g + 1]
            col = w1[:, i:i + 1].reshape(rows, 1, 1)
            q = _affine.quantize_values(col, s_col, z_col, spec)                      # (rows, 1, 1)
            deq = _affine.dequantize_values(q, s_col, z_col, spec).reshape(rows)
            levels[:, i1 + i] = q.reshape(rows)
            e = (w1[:, i] - deq) / hinv1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    inverse = torch.argsort(perm)
    return levels[:, inverse].reshape(rows, n_groups, group), scale, zero


def apply(model: nn.Module, config: GPTQConfig, *, calibration: Iterable[Any] | None = None) -> nn.Module:
    """Return a GPTQ-quantized copy of `model` (the input is left unchanged).

    Args:
        model: The float model.
        config: GPTQ settings.
        calibration: Input batches (tensors, or tuples of tensors); default: a seeded subset of
            the reference model's training split.
    """
    batches = list(calibration) if calibration is not None else calibration_batches(
        model, samples=config.calibration_samples, batch_size=config.batch_size, seed=config.seed)
    spec = config.spec
    working = copy.deepcopy(model)                       # quantized group by group, in model order
    was_training = working.training
    working.eval()
    done = 0
    pending: list[tuple[str, nn.Module]] = []
    for name, layer in _modules.targets(working, (nn.Linear, nn.Conv2d, nn.Embedding), config.skip):
        reason = spec.fits(tuple(layer.weight.shape))
        if reason is None and isinstance(layer, nn.Conv2d) and layer.groups != 1:
            reason = "grouped convolutions are not supported"
        if reason is not None:
            _modules.log_kept(name, reason)
        elif isinstance(layer, nn.Embedding):        # no Hessian for a lookup: round to nearest
            working = _swap(working, name, layer, _affine.quantized_tensor(layer.weight, spec, scheme=config.scheme))
            done += 1
        else:
            pending.append((name, layer))
    while pending:
        members, h = next_group(working, [layer for _, layer in pending], batches)
        if not members:                              # never called by forward(): round to nearest
            for name, _ in pending:
                _modules.log_kept(name, "not reached by calibration inputs; rounded to nearest")
            members, h = list(range(len(pending))), None
        for index in members:
            name, layer = pending[index]
            levels = None if h is None else gptq_levels(layer.weight, h, spec, damp=config.damp,
                                                        act_order=config.act_order, block_size=config.block_size)
            working = _swap(working, name, layer, _affine.quantized_tensor(layer.weight, spec, scheme=config.scheme,
                                                                            levels=levels))
            done += 1
        pending = [item for i, item in enumerate(pending) if i not in members]
    if not done:
        raise ConfigError(f"gptq: no layer of {type(model).__name__} can be quantized with {config!r}")
    return working.train(was_training)


def _swap(model: nn.Module, name: str, layer: nn.Module, weight: Any) -> nn.Module:
    new = _modules.quantized_module(layer, weight)
    if not name:
        return new
    model.set_submodule(name, new)
    return model
