"""Quantization-aware training: train against the quantized weights, then fold them in.

`prepare_qat(model, config)` returns a copy whose target layers compute with fake-quantized
weights: the forward pass uses exactly the values the quantized model will use (the same
`_affine` code computes them), the backward pass treats rounding as the identity (the
straight-through estimator, Bengio et al. 2013), so the float weights keep learning. With
`Int8DynamicConfig` the layer inputs are fake-quantized too, per row, as the int8 kernel will
see them. The prepared model keeps its class and parameter names, so the zoo's own training
loop trains it unchanged, under torchrun DDP as well.

`convert_qat(model)` folds the trained weights into real quantized layers by running the PTQ
scheme on them: the result is bit for bit what `apply(float_model, config)` gives for those
weights.

Example:
    >>> from modelkit.models import build
    >>> from modelkit.quantizers.int4 import Int4Config
    >>> qat = prepare_qat(build("cnn", seed=0), Int4Config(group_size=32))
    >>> # modelkit.pipeline.train.train("cnn", "runs/cnn-qat", model=qat, config=TrainConfig(epochs=3))
    >>> type(convert_qat(qat).fc1).__name__
    'QuantizedLinear'
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modelkit.errors import ConfigError
from modelkit.quantizers import _affine, _modules
from modelkit.quantizers.int4 import Int4Config
from modelkit.quantizers.int8 import Int8Config
from modelkit.quantizers.int8_dynamic import SPEC as DYNAMIC_SPEC
from modelkit.quantizers.int8_dynamic import Int8DynamicConfig, fake_quantize_rows

QATConfig = Int8Config | Int4Config | Int8DynamicConfig


def _plan(config: Any) -> tuple[_affine.AffineSpec, bool, tuple[type[nn.Module], ...]]:
    """(weight spec, quantize activations, layer kinds) of a config QAT can train for."""
    if isinstance(config, Int8DynamicConfig):
        return DYNAMIC_SPEC, True, (nn.Linear,)
    if isinstance(config, (Int8Config, Int4Config)):
        return config.spec, False, (nn.Linear, nn.Conv2d, nn.Embedding)
    scheme = getattr(type(config), "scheme", None) or type(config).__name__
    raise ConfigError(f"QAT trains int8, int4 or int8-dynamic weights; got {scheme} (GPTQ, GGUF block types, "
                      "fp16/bf16 and TF.js encodings are post-training only: quantize without --qat)")


def check_config(config: Any) -> None:
    """Raise ConfigError (one line) unless QAT can train for `config` (int8, int4, int8-dynamic)."""
    _plan(config)


class _FakeQuant:
    """Mixin for the QAT layers: the weight (and input) as the quantized layer will see them."""

    qat_spec: _affine.AffineSpec
    qat_activations: bool

    def qat_weight(self) -> torch.Tensor:
        w = self.weight
        return w + (_affine.fake_quantize(w.detach(), self.qat_spec) - w).detach()   # straight-through

    def qat_input(self, x: torch.Tensor) -> torch.Tensor:
        if not self.qat_activations:
            return x
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        return (flat + (fake_quantize_rows(flat) - flat).detach()).reshape(shape)


class QATLinear(_FakeQuant, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.qat_input(x), self.qat_weight(), self.bias)


class QATConv2d(_FakeQuant, nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.qat_weight(), self.bias)


class QATEmbedding(_FakeQuant, nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.qat_weight(), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)


_QAT_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: QATLinear, nn.Conv2d: QATConv2d, nn.Embedding: QATEmbedding,
}


def prepare_qat(model: nn.Module, config: QATConfig) -> nn.Module:
    """A copy of `model` that trains against `config`'s quantized weights (the input is left unchanged).

    The layers `apply(model, config)` would quantize become fake-quantizing subclasses of their
    own class (same parameters, same names); everything else is untouched.
    """
    spec, activations, kinds = _plan(config)
    prepared = copy.deepcopy(model)
    changed = 0
    for name, layer in _modules.targets(prepared, kinds, config.skip):
        reason = spec.fits(tuple(layer.weight.shape))
        if reason is not None:
            _modules.log_kept(name, reason)
            continue
        layer.__class__ = _QAT_CLASSES[type(layer)]      # same state, a forward that fake-quantizes
        layer.qat_spec, layer.qat_activations, layer.qat_config = spec, activations, config
        changed += 1
    if not changed:
        raise ConfigError(f"QAT: no layer of {type(model).__name__} can be quantized with {config!r}")
    return prepared


def qat_config(model: nn.Module) -> QATConfig:
    """The config a prepared model trains for."""
    configs = {m.qat_config for m in model.modules() if isinstance(m, _FakeQuant)}
    if len(configs) != 1:
        raise ConfigError("not a model from prepare_qat (no fake-quantizing layers)" if not configs
                          else "the model mixes layers prepared with different QAT configs")
    return next(iter(configs))


def convert_qat(model: nn.Module) -> nn.Module:
    """Fold a trained QAT model into real quantized layers: the PTQ scheme run on its trained weights."""
    from modelkit import schemes

    config = qat_config(model)
    plain = copy.deepcopy(model)
    for module in plain.modules():
        if isinstance(module, _FakeQuant):
            base = next(k for k, v in _QAT_CLASSES.items() if isinstance(module, v))
            module.__class__ = base
            for attribute in ("qat_spec", "qat_activations", "qat_config"):
                module.__dict__.pop(attribute, None)
    return schemes.apply(plain.eval(), config)
