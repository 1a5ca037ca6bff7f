"""The forward over many tokens in C (DecodePlan.forward, _matmul_kernels_forward.h): tinylm's forward pass
(quantizers/fast_forward.py) and the decoders' prefill, against tinylm's torch path on the same packed layers
(fast_forward.unfused: the same weight kernels one product at a time, norms / rotary / SDPA / SwiGLU in torch).

As in test_fast_decode, the two agree to float summation order (~3e-7 of the largest logit) until a value
that rounds to int8 on a .5 boundary goes the other way in one of them, which moves the logits of that token
and the later ones by ~1e-2 of the largest (worst measured 2026-11-28 over the cases below: see
docs/quantization.md). Pinned at test_fast_decode's RTOL.
"""
from __future__ import annotations

import pytest
import torch

from modelkit.errors import ConfigError
from modelkit.pipeline.tinylm_decoder import Stream, TinyLMDecoder
from modelkit.quantizers import fast_forward, fast_linear
from modelkit.testing.packed_tinylm import CASES, WINDOW
from modelkit.testing.packed_tinylm import tinylm as _model

RTOL = 0.03          # test_fast_decode's

pytestmark = pytest.mark.skipif(fast_linear.kernels() is None, reason="modelkit was built without its C kernels")


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) <= RTOL * float(expected.abs().max())


def _ids(batch: int, tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def _forward_both(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        with fast_forward.unfused():
            expected = model(ids)
        return model(ids), expected


@pytest.mark.parametrize(("config", "scheme"), CASES, ids=[f"{c}-{s}" for c, s in CASES])
def test_the_fused_forward_equals_the_torch_path(config, scheme):
    """3 sequences of 11 tokens (rows not a multiple of the 8-row tiles), every activation kind and GQA 1/3/8."""
    model = _model(config, scheme)
    got, expected = _forward_both(model, _ids(3, 11))
    assert fast_forward._PLANS[model].plan is not None            # the fused path ran
    _close(got, expected)


@pytest.mark.parametrize("isa", fast_linear.ISAS)
def test_every_kernel_on_one_and_two_threads(isa):
    """The portable kernel (what a CPU without AVX2 runs) and each SIMD one; one row and 40 (past the kernels'
    32-row transposed tiles) in a window."""
    model = _model("gqa3", "q4_k_m")
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with fast_linear.use_isa(isa):
                for ids in (_ids(1, 1), _ids(2, 20)):
                    _close(*_forward_both(model, ids))
    finally:
        torch.set_num_threads(previous)


def test_a_changed_layer_builds_a_new_plan_or_runs_the_torch_path():
    model = _model("gqa1", "q8_0")
    ids = _ids(2, 5)
    with torch.no_grad():
        model(ids)
        first = fast_forward._PLANS[model]
        model(ids)
        assert fast_forward._PLANS[model] is first                         # kept while nothing changes
        other = _model("gqa1", "q4_0")
        model.model.layers[1].mlp.down_proj = other.model.layers[1].mlp.down_proj
        _close(*_forward_both(model, ids))
        assert fast_forward._PLANS[model] is not first and fast_forward._PLANS[model].plan is not None
        second = fast_forward._PLANS[model]
        norm = model.model.layers[0].input_layernorm
        norm.weight = torch.nn.Parameter(norm.weight * 2)                    # a new tensor: a new plan reads it
        _close(*_forward_both(model, ids))
        assert fast_forward._PLANS[model] is not second
        model.model.layers[1].self_attn.q_proj = _model("gqa1", None).model.layers[1].self_attn.q_proj
        _close(*_forward_both(model, ids))
        assert fast_forward._PLANS[model].plan is None                       # a float product: the torch path


def test_gradients_and_float_models_take_the_torch_path():
    model = _model("gqa1", "int8")
    assert fast_forward.tinylm_logits(model, _ids(1, 4)) is None           # gradients on
    with torch.no_grad():
        assert fast_forward.tinylm_logits(model, _ids(1, 4)) is not None
        assert fast_forward.tinylm_logits(_model("gqa1", None), _ids(1, 4)) is None


@pytest.mark.parametrize(("config", "scheme"), [("gqa3", "q4_k_m"), ("gqa8", "int4"), ("gqa1", "int8-dynamic")])
def test_prefill_fills_the_cache_as_the_torch_path(config, scheme):
    """The decoder's fused prefill (one call writing the cache) against its torch prefill: logits, cache, and
    greedy tokens after it equal."""
    model = _model(config, scheme)
    with torch.no_grad():
        fused, reference = TinyLMDecoder(model, 2), TinyLMDecoder(model, 2, fused=False)
        for prompt in ([9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11], [42]):
            a, b = Stream(list(prompt)), Stream(list(prompt))
            got, expected = fused.prefill(a), reference.prefill(b)
            _close(got, expected)
            T = len(prompt)
            for cache, other in ((fused.keys, reference.keys), (fused.values, reference.values)):
                _close(cache[:, a.state, :, :T], other[:, b.state, :, :T])
            for _ in range(3):
                token = int(expected.argmax())
                assert int(got.argmax()) == token
                a.ids.append(token)
                b.ids.append(token)
                got, expected = fused.step([a])[0], reference.step([b])[0]
                _close(got, expected)


def test_a_prefill_in_two_parts_equals_one():
    """Tokens 5..8 after tokens 0..4 in the cache attend to the cached positions too."""
    model = _model("gqa3", "q8_0")
    decoder = TinyLMDecoder(model, 2)
    plan, ids = decoder.plan, _ids(1, 9)
    with torch.no_grad():
        x = model.model.embed_tokens(ids).contiguous()
        whole = plan.forward(x, decoder.cos, decoder.sin, slot=0)
        plan.forward(x[:, :5].contiguous(), decoder.cos, decoder.sin, slot=1)
        rest = plan.forward(x[:, 5:].contiguous(), decoder.cos, decoder.sin, start=5, slot=1, last_only=True)
    _close(rest, whole[:, -1])
    _close(decoder.keys[:, 1, :, :9], decoder.keys[:, 0, :, :9])
    assert float(decoder.keys[:, 1, :, 9:].abs().max()) == 0.0


def test_wrong_inputs_are_refused():
    model = _model("gqa3", "q8_0")
    decoder = TinyLMDecoder(model, 1)
    plan, cos, sin = decoder.plan, decoder.cos, decoder.sin
    x = torch.zeros(1, 4, 96)
    with pytest.raises(ConfigError, match="float32 values, contiguous"):
        plan.forward(x.double(), cos, sin)
    with pytest.raises(ConfigError, match="rotary tables of"):
        plan.forward(x, cos[:3], sin[:3])
    with pytest.raises(ConfigError, match="starts at position 0"):
        plan.forward(x, cos, sin, start=1)
    with pytest.raises(ConfigError, match="into slot 1 of a cache of 1 slots"):
        plan.forward(x, cos, sin, slot=1)
    with pytest.raises(ConfigError, match=f"from position {WINDOW - 2} into slot 0"):
        plan.forward(x, cos, sin, start=WINDOW - 2, slot=0)


def test_a_float_head_runs_after_the_fused_blocks():
    """An output head kept in float (--skip lm_head): the C call ends at the final norm, the head runs in torch."""
    import warnings

    from modelkit import schemes
    from modelkit.pipeline.quantize import quantize_module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = quantize_module(_model("gqa3", None), schemes.load_scheme("q4_0")(skip=("lm_head",))).eval()
    assert type(model.lm_head) is torch.nn.Linear
    got, expected = _forward_both(model, _ids(2, 7))
    assert fast_forward._PLANS[model].plan.head is None
    _close(got, expected)
