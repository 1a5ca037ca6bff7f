"""The batch-1 decode step in C (quantizers/fast_decode.py, _matmul_kernels_decode.h) against the torch path
of the same decoder (pipeline/tinylm_decoder.py with fused=False), which calls the same weight kernels one
product at a time; then the forward over many tokens on the same plan (DecodePlan.forward,
_matmul_kernels_forward.h): tinylm's forward pass (quantizers/fast_forward.py) and the decoders' prefill,
against tinylm's torch path on the same packed layers (fast_forward.unfused).

The two agree to float summation order (~3e-7 of the largest logit) until a value that rounds to int8 on
a .5 boundary goes the other way in one of them; one such level moves the logits by up to 0.0112 of the
largest (worst measured 2026-11-27 over the shapes, schemes and kernels below), and stays in the cache.
The forward agrees the same way: worst 0.0110 of the largest logit over 162 runs of its cases, 2026-11-28
(docs/quantization.md).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from modelkit import schemes
from modelkit.errors import ConfigError
from modelkit.models import build
from modelkit.pipeline.quantize import quantize_module
from modelkit.pipeline.tinylm_decoder import Stream, TinyLMDecoder
from modelkit.quantizers import fast_decode, fast_forward, fast_linear

pytestmark = pytest.mark.skipif(fast_linear.kernels() is None, reason="modelkit was built without its C kernels")

RTOL = 0.03      # ~2.5x the worst measured (see the module docstring)
# Grouped-query ratios 1, 3 and 8; head widths 16, 16, 12; key/value rows 64, 32 and 12 (not a multiple of
# the kernels' 8-row tiles); a hidden size of 256 for whole K-quant super-blocks.
CONFIGS = {
    "gqa1": {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 4},
    "gqa3": {"hidden_size": 96, "intermediate_size": 160, "num_attention_heads": 6, "num_key_value_heads": 2},
    "gqa8": {"hidden_size": 96, "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 1},
    "k256": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2},
}
WINDOW = 24
# Each kind of activations the C code rounds (q8_0 blocks; int4's pair order; q8_K super-blocks, and q4_k_m's
# q5_0/q8_0 stand-ins at rows of 96; int8-dynamic's one scale per row), each grouped-query ratio.
CASES = [("gqa1", "q8_0"), ("gqa3", "int4"), ("gqa3", "q4_k_m"), ("gqa8", "q4_0"), ("gqa8", "int8"), ("k256", "q4_k_m"),
         ("gqa3", "q5_0"), ("gqa8", "q4_1"),      # q5_0 / q4_1: the legacy kernels (q4_k_m stores some rows so too)
         ("gqa3", "int8-dynamic")]


def _model(config: str, scheme: str | None, *, skip: tuple[str, ...] = ()) -> torch.nn.Module:
    model = build("tinylm", {**CONFIGS[config], "num_hidden_layers": 2, "max_position_embeddings": WINDOW},
                  seed=1).eval()
    if scheme is None:
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_module(model, schemes.load_scheme(scheme)(skip=skip)).eval()


def _compare(model: torch.nn.Module, *, isa: str | None = None, threads: int = 2) -> None:
    """Greedy decoding from a 3-token prompt to 2 tokens past the window, both decoders fed the torch path's
    tokens: logits within RTOL at every position, the caches too, and the fused path taken until the window."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with fast_linear.use_isa(isa or fast_linear.ISA), torch.no_grad():
            fused, reference = TinyLMDecoder(model, 1), TinyLMDecoder(model, 1, fused=False)
            assert fused.plan is not None and reference.plan is None
            a, b = Stream([1, 2, 3]), Stream([1, 2, 3])
            got, expected = fused.prefill(a), reference.prefill(b)
            while len(b.ids) < WINDOW + 2:
                token = int(expected.argmax())
                a.ids.append(token)
                b.ids.append(token)
                with fast_forward.unfused():            # past the window the reference runs tinylm's torch forward
                    expected = reference.step([b])[0]
                got = fused.step([a])[0]
                assert float((got - expected).abs().max()) <= RTOL * float(expected.abs().max()), len(b.ids)
                if len(b.ids) <= WINDOW:                    # cached: the step wrote this position's keys and values
                    for cache, other in ((fused.keys, reference.keys), (fused.values, reference.values)):
                        written = cache[:, 0, :, : len(b.ids)]
                        assert written.abs().max() > 0
                        assert float((written - other[:, 0, :, : len(b.ids)]).abs().max()) <= RTOL * float(written.abs().max())
            assert a.state is None and b.state is None                   # past the window: full passes, as tinylm's generate
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(("config", "scheme"), CASES, ids=[f"{c}-{s}" for c, s in CASES])
def test_the_fused_step_equals_the_torch_path(config, scheme):
    _compare(_model(config, scheme))


@pytest.mark.parametrize("isa", fast_linear.ISAS)
def test_every_kernel_and_one_thread(isa):
    """The portable kernel (what a CPU without AVX2 runs) and each SIMD one, on one thread and on two."""
    model = _model("gqa3", "q4_k_m")
    _compare(model, isa=isa, threads=1)
    _compare(model, isa=isa, threads=2)


def test_sequences_in_other_slots():
    """Single steps of sequences in slots 1 and 0 of a shared cache write and read their own slot only, and
    a batched (torch) step then reads what they wrote."""
    model = _model("gqa3", "q8_0")
    with torch.no_grad():
        fused, reference = TinyLMDecoder(model, 3), TinyLMDecoder(model, 3, fused=False)
        pairs = [(Stream([5 + i] * (2 + i)), Stream([5 + i] * (2 + i))) for i in range(3)]
        for a, b in pairs:
            fused.prefill(a)
            reference.prefill(b)
        fused.release(pairs[0][0])                   # slot 0 now holds the third sequence; slot 1 keeps the second
        reference.release(pairs[0][1])
        for _ in range(4):
            for a, b in pairs[1:]:
                got, expected = fused.step([a])[0], reference.step([b])[0]
                assert float((got - expected).abs().max()) <= RTOL * float(expected.abs().max())
                token = int(expected.argmax())
                a.ids.append(token)
                b.ids.append(token)
        assert [a.state for a, _ in pairs] == [None, 1, 0]
        assert float((fused.keys[:, :2] - reference.keys[:, :2]).abs().max()) <= RTOL * float(reference.keys.abs().max())
        for got, expected in zip(fused.step([a for a, _ in pairs[1:]]), reference.step([b for _, b in pairs[1:]]),
                                 strict=True):
            assert float((got - expected).abs().max()) <= RTOL * float(expected.abs().max())


def test_models_the_step_does_not_compute_keep_the_torch_path():
    """A float model and one product left in float: no plan (the torch path runs)."""
    assert TinyLMDecoder(_model("gqa1", None), 1).plan is None
    partial = _model("gqa1", "q8_0")
    partial.model.layers[1].mlp.up_proj = _model("gqa1", None).model.layers[1].mlp.up_proj
    assert TinyLMDecoder(partial, 1).plan is None


def test_wrong_shapes_are_refused():
    model = _model("gqa3", "q8_0")
    decoder = TinyLMDecoder(model, 1)
    body = model.model
    blocks = [(b.input_layernorm, b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj, b.self_attn.o_proj,
               b.post_attention_layernorm, b.mlp.gate_proj, b.mlp.up_proj, b.mlp.down_proj) for b in body.layers]
    with pytest.raises(ConfigError, match="a product of shape"):
        fast_decode.plan(blocks, body.norm, model.lm_head, fast_decode.Geometry(96, 6, 3, 16, 160))
    with pytest.raises(ConfigError, match="head_dim even"):
        fast_decode.Geometry(96, 6, 2, 15, 160)
    with pytest.raises(ConfigError, match="does not fit this plan"):
        decoder.plan.bind(decoder.cos, decoder.sin, decoder.keys[:1], decoder.values[:1])
    with pytest.raises(ConfigError, match="contiguous float32"):
        decoder.plan.bind(decoder.cos.double(), decoder.sin, decoder.keys, decoder.values)
    x = torch.zeros(96)
    with pytest.raises(ConfigError, match="input is 96 float32 values"):
        decoder.plan.step(x.double(), 0, 0)
    with pytest.raises(ConfigError, match="not a row of the bound embedding table"):
        decoder.plan.step(1, 0, 0)                      # no table bound yet: the decoder binds one at its first step
    with pytest.raises(ConfigError, match="an embedding table of"):
        decoder.plan.bind(decoder.cos, decoder.sin, decoder.keys, decoder.values, torch.zeros(256, 95))
    with pytest.raises(ConfigError, match="position 24 of slot 0 is outside"):
        decoder.plan.step(x, WINDOW, 0)
    with pytest.raises(ConfigError, match="slot 1 is outside"):
        decoder.plan.step(x, 0, 1)


# ---- the forward over many tokens (DecodePlan.forward) ----------------------------------------------

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
def test_the_forward_on_every_kernel_and_thread_count(isa):
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


def test_wrong_forward_inputs_are_refused():
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
    model = _model("gqa3", "q4_0", skip=("lm_head",))
    assert type(model.lm_head) is torch.nn.Linear
    got, expected = _forward_both(model, _ids(2, 7))
    assert fast_forward._PLANS[model].plan.head is None
    _close(got, expected)


def test_sequences_in_groups():
    """A batch runs as groups of whole sequences of ~64 rows, claimed by the threads (here 5, 5 and 2 sequences of
    13 tokens): the same logits on one thread and two, and each sequence's last row as last_only gives it."""
    model = _model("gqa3", "int8-dynamic")
    decoder = TinyLMDecoder(model, 1)
    ids = _ids(12, 13)
    previous = torch.get_num_threads()
    try:
        with torch.no_grad():
            x = model.model.embed_tokens(ids).contiguous()
            one = decoder.plan.forward(x, decoder.cos, decoder.sin, threads=1)
            torch.set_num_threads(2)
            got, expected = _forward_both(model, ids)
            last = decoder.plan.forward(x, decoder.cos, decoder.sin, threads=2, last_only=True)
    finally:
        torch.set_num_threads(previous)
    _close(got, expected)
    assert torch.allclose(got, one, rtol=0, atol=1e-6 * float(one.abs().max()))
    assert torch.allclose(last, got[:, -1], rtol=0, atol=1e-6 * float(one.abs().max()))


def test_a_batch_of_more_sequences_than_a_group_in_one_call():
    """6 sequences of 16 tokens: more sequences than one group's 64 rows hold, too few rows for groups, so one
    call runs them all (every sequence's logits, not the first four's alone)."""
    model = _model("gqa3", "q8_0")
    got, expected = _forward_both(model, _ids(6, 16))
    for b in range(6):
        _close(got[b], expected[b])
