"""The batch-1 decode step in C (quantizers/fast_decode.py, _matmul_kernels_decode.h) against the torch path
of the same decoder (pipeline/tinylm_decoder.py with fused=False), which calls the same weight kernels one
product at a time.

The two agree to float summation order (~3e-7 of the largest logit) until a value that rounds to int8 on
a .5 boundary goes the other way in one of them; one such level moves the logits by up to 0.0112 of the
largest (worst measured 2026-11-27 over the shapes, schemes and kernels below), and stays in the cache.
"""
from __future__ import annotations

import pytest
import torch

from modelkit.errors import ConfigError
from modelkit.pipeline.tinylm_decoder import Stream, TinyLMDecoder
from modelkit.quantizers import fast_decode, fast_forward, fast_linear
from modelkit.testing.packed_tinylm import CASES, WINDOW
from modelkit.testing.packed_tinylm import tinylm as _model

pytestmark = pytest.mark.skipif(fast_linear.kernels() is None, reason="modelkit was built without its C kernels")

RTOL = 0.03      # ~2.5x the worst measured (see the module docstring)


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
