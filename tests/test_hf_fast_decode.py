"""Hugging Face Llama-family models on the fused C decode step (pipeline/hf_llama_decoder.py,
quantizers/fast_decode.py) against transformers' own forward with its DynamicCache on the same packed layers.

Tiny random-weight models of transformers' own classes (norms and biases away from 1 / 0, so a missed
norm, bias or Q/K permutation shows): Llama from a q8_0 GGUF file (Q/K rows permuted in the file),
Llama-3 and YaRN rope scaling, Mistral, Qwen2 (q/k/v biases, tied embeddings), Qwen3 (per-head q/k norms).
Worst measured difference, 2026-11-28, over the cases below, 20 steps, every kernel (avx512vnni, avx2,
generic) at 1 and 2 threads, and the GGUF file: 2.9e-07 of the largest logit (the products are the same
kernels on the same rounded activations; only float summation order differs). Pinned at test_fast_decode's
RTOL (0.03), which also covers an int8 rounding tie going the other way in one of them.

Then the forward pass, `model(input_ids)` (quantizers/hf_forward.py: the whole stack in one C call): logits and
the returned DynamicCache against transformers' forward on the same packed layers (`type(model).forward`), a
generate continued from that cache, each case the fused path must leave to transformers, copies and replaced
layers. Last, transformers' own `generate` on the fused path (quantizers/hf_cache.py: its DynamicCache continued
through a shadow static cache): the tokens of transformers' forward, what falls back (beams, padding, an edited
cache).
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import gguf
import pytest
import torch

import modelkit
from modelkit import schemes
from modelkit.checkpoint import ALIASES_KEY, Checkpoint
from modelkit.errors import ConfigError
from modelkit.pipeline.generate import generate_tokens
from modelkit.pipeline.hf_llama_decoder import HFLlamaDecoder, llama_decoder, unsupported
from modelkit.pipeline.load import load_language_model
from modelkit.pipeline.quantize import quantize, quantize_module
from modelkit.pipeline.tinylm_decoder import Stream
from modelkit.quantizers import fast_decode, fast_linear
from modelkit.testing.gguf_files import as_llama_cpp_writes_it

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(fast_linear.kernels() is None, reason="modelkit was built without its C kernels")

RTOL = 0.03          # test_fast_decode's; worst measured 2.9e-07 (module docstring)
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CONFIGS = {
    "llama3-rope": lambda: transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA3),
    "llama-yarn": lambda: transformers.LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}),
    "llama-bias": lambda: transformers.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32),
}
CASES = [("llama3-rope", "q8_0"), ("llama-yarn", "int8"), ("llama-bias", "int4"), ("mistral", "q4_0"), ("qwen2", "int8"), ("qwen3", "q4_0")]
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "llama_cpp" / "hf"


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    with torch.no_grad():               # norms around 1, biases around 0, neither exactly
        for key, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (0 if key.endswith("bias") else 1))
    return model


def _quantized(name: str, scheme: str) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_module(_model(name), schemes.load_scheme(scheme)()).eval()


def _worst(model: torch.nn.Module, steps: int = 12) -> float:
    """Greedy from a 5-token prompt, both fed transformers' tokens: the largest |fused - transformers| logit
    difference over the prefill and the steps, as a fraction of the largest logit; the fused prefill and step
    taken every time."""
    from transformers.cache_utils import DynamicCache

    from modelkit.testing.causal_lm import _cache_argument, returned_cache

    cache = _cache_argument(model)
    decoder = llama_decoder(model, 1, 5 + steps)
    assert decoder is not None and decoder.plan is not None
    seq, worst = Stream([3, 17, 99, 250, 7]), 0.0
    calls = 0
    original = decoder.plan.step

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    decoder.plan.step = counted
    prefills = []
    fused_prefill = decoder.plan.forward
    decoder.plan.forward = lambda *args, **kwargs: prefills.append(1) or fused_prefill(*args, **kwargs)
    with torch.no_grad():
        got = decoder.prefill(seq)
        out = model(input_ids=torch.tensor([seq.ids]), use_cache=True, **{cache: DynamicCache(config=model.config)})
        for _ in range(steps):
            expected = out.logits[0, -1]
            worst = max(worst, float((got - expected).abs().max()) / float(expected.abs().max()))
            token = int(expected.argmax())
            seq.ids.append(token)
            got = decoder.step([seq])[0]
            out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{cache: returned_cache(out)})
    assert calls == steps and prefills == [1]            # the prompt in one fused call, every step fused
    return worst


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize(("name", "scheme"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_the_fused_step_equals_transformers(name, scheme):
    assert _worst(_quantized(name, scheme)) <= RTOL


def test_the_portable_kernels_on_one_thread():
    """What a CPU without AVX2 runs, with Qwen3's per-head norms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with fast_linear.use_isa("generic"):
            assert _worst(_quantized("qwen3", "q8_0")) <= RTOL
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q6_k", "int8"])
def test_an_embedding_row_is_the_layers_row(scheme):
    """fast_decode.row_reader (the fused step's lookup in a table too large to dequantize whole): the layer's rows, bit for
    bit, from the GGUF block bytes (q8_0, q4_0 in numpy; K-quants in C) or the layer itself (int8)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        embed = quantize_module(transformers.LlamaForCausalLM(config), schemes.load_scheme(scheme)()).model.embed_tokens
    read = fast_decode.row_reader(embed)
    with torch.no_grad():
        for token in (0, 17, 39):
            row = read(token)
            assert row.dtype == torch.float32 and row.is_contiguous() and torch.equal(row, embed(torch.tensor([token]))[0])


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> Path:
    """A q8_0 GGUF of a Llama folder with the llama3 tokenizer fixture (Q/K rows permuted in the file)."""
    root = tmp_path_factory.mktemp("hf-fused")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).save_pretrained(root / "llama")
    for f in (FIXTURES / "llama3").iterdir():
        shutil.copy(f, root / "llama" / f.name)
    quantize(root / "llama", root / "llama.gguf", scheme="q8_0")
    return root / "llama.gguf"


def test_a_gguf_file_decodes_fused_as_transformers(llama_gguf, monkeypatch):
    """`modelkit generate` (complete) on the GGUF: the fused step every token after the first, the tokens of
    transformers' generate, greedy and sampled."""
    loaded = load_language_model(llama_gguf)
    assert _worst(loaded.model) <= RTOL
    calls = []
    step = fast_decode.DecodePlan.step
    monkeypatch.setattr(fast_decode.DecodePlan, "step", lambda self, *a, **k: calls.append(1) or step(self, *a, **k))
    for options in ({}, {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 3}):
        calls.clear()
        fused = modelkit.complete(llama_gguf, "Hello there", max_new_tokens=16, **options)
        assert len(calls) == fused.new_tokens - 1 and fused.new_tokens > 1
        reference = generate_tokens(loaded.model, loaded.tokenizer, "Hello there", max_new_tokens=16, fused=False,
                                    **options)
        assert fused.token_ids == reference.token_ids and fused.stopped == reference.stopped


def test_a_tied_gguf_loads_with_one_table_and_decodes_fused(tmp_path):
    """A Qwen2 with tied embeddings as q8_0 GGUF (no output.weight: llama.cpp computes logits with token_embd):
    the head is a packed layer on the embedding's own bytes (one copy), the fused step equals transformers,
    and the logits stay near the float model's (worst measured 0.0097 of logits up to 0.88, q8_0's own error)."""
    folder = tmp_path / "qwen2"
    float_model = _model("qwen2")
    float_model.save_pretrained(folder)
    for f in (FIXTURES / "qwen2").iterdir():
        shutil.copy(f, folder / f.name)
    quantize(folder, tmp_path / "qwen2.gguf", scheme="q8_0")
    model = load_language_model(tmp_path / "qwen2.gguf").model
    head, table = model.lm_head, model.model.embed_tokens
    assert type(head).__name__ == "QuantizedLinear" and head.qdata.data_ptr() == table.qdata.data_ptr()
    assert llama_decoder(model, 1, 8).plan.head is not None
    again = Checkpoint.from_module(model)        # writable again, the table stored once (as llama.cpp stores it)
    assert json.loads(again.metadata[ALIASES_KEY]) == {"lm_head.weight": "model.embed_tokens.weight"}
    modelkit.save(again, tmp_path / "again.gguf")
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(tmp_path / "again.gguf").tensors}
    assert (tmp_path / "again.gguf").stat().st_size <= (tmp_path / "qwen2.gguf").stat().st_size * 1.01
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 400, 5]])
        assert float((model(ids).logits - float_model(ids).logits).abs().max()) <= 0.03
        assert torch.equal(load_language_model(tmp_path / "again.gguf").model(ids).logits, model(ids).logits)
    assert _worst(model) <= RTOL


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_file_as_llama_cpp_writes_it_decodes_fused(family, llama_gguf, tmp_path):
    """No modelkit keys: Llama's Q/K rows permuted by llama.cpp's rule, Qwen2 tied (no output.weight). The
    model read back has every product packed and the fused step equals transformers on it."""
    if family == "llama":
        source = llama_gguf
    else:
        folder = tmp_path / "qwen2"
        _model("qwen2").save_pretrained(folder)
        for f in (FIXTURES / "qwen2").iterdir():
            shutil.copy(f, folder / f.name)
        quantize(folder, tmp_path / "qwen2.gguf", scheme="q4_0")
        source = tmp_path / "qwen2.gguf"
    model = load_language_model(as_llama_cpp_writes_it(source, tmp_path / "plain.gguf")).model
    assert model.config.model_type == family and _worst(model) <= RTOL
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 400, 5]])
        assert torch.allclose(model(ids).logits, load_language_model(source).model(ids).logits, atol=1e-5)


def test_what_the_step_does_not_take_keeps_transformers():
    """A float model has no plan; a sliding window inside the cache, a length-dependent rope type and another
    family are refused with their reason."""
    assert llama_decoder(_model("mistral"), 1, 16) is None
    sliding = transformers.MistralConfig(**COMMON, sliding_window=8)
    assert "sliding window of 8" in unsupported(transformers.MistralForCausalLM(sliding), 16)
    assert unsupported(transformers.MistralForCausalLM(sliding), 8) is None
    dynamic = transformers.LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    assert "rope type dynamic" in unsupported(transformers.LlamaForCausalLM(dynamic), 16)
    phi = transformers.Phi3Config(**COMMON, pad_token_id=0)
    assert "not a model of" in unsupported(transformers.Phi3ForCausalLM(phi), 16)
    with pytest.raises(ConfigError, match="does not take this model: not a model of"):
        HFLlamaDecoder(transformers.Phi3ForCausalLM(phi), 1, window=16)


@pytest.mark.parametrize("name", ["qwen3", "mistral"])
def test_serve_decodes_packed_models_with_the_static_cache(name):
    """serve's decoder for a packed Llama-family model: sequences of different lengths prefilled, decoded
    together (batched torch steps), one leaving early, then the last alone (fused steps); each sequence's
    greedy tokens equal transformers' generate alone. A float model keeps HFDecoder."""
    from modelkit.pipeline.serve_text import HFDecoder, Job, Sampling, hf_decoder

    model = _quantized(name, "q8_0")
    assert type(hf_decoder(_model(name), 4)) is HFDecoder
    decoder = hf_decoder(model, 4)
    assert type(decoder) is HFLlamaDecoder and decoder.window == COMMON["max_position_embeddings"]
    prompts = [[5, 9, 200], [7] * 9, [300, 2, 11, 45, 8, 1]]
    jobs = [Job(list(p), Sampling(12), lambda event: None) for p in prompts]
    with torch.no_grad():
        for job in jobs:
            job.ids.append(int(decoder.prefill(job).argmax()))
        for step in range(11):
            if step == 3:
                decoder.release(jobs[1])            # its slot goes to the last sequence
            if step == 6:
                decoder.release(jobs[2])            # the first runs alone: fused steps
            running = [j for i, j in enumerate(jobs) if not (i == 1 and step >= 3) and not (i == 2 and step >= 6)]
            for job, logits in zip(running, decoder.step(running), strict=True):
                job.ids.append(int(logits.argmax()))
        expected = model.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False)[0].tolist()
    assert jobs[0].ids == expected
    for job, prompt, n in ((jobs[1], prompts[1], 4), (jobs[2], prompts[2], 7)):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0].tolist()
        assert job.ids == alone


# ---- the forward pass: model(input_ids) on the fused forward (quantizers/hf_forward.py) ----

def _counted(monkeypatch) -> list[int]:
    """DecodePlan.forward's calls from here on (one a fused forward pass)."""
    calls: list[int] = []
    forward = fast_decode.DecodePlan.forward
    monkeypatch.setattr(fast_decode.DecodePlan, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    return calls


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) <= RTOL * float(expected.abs().max())


def _caches_close(got, expected) -> None:
    from modelkit.testing.causal_lm import returned_cache

    got, expected = returned_cache(got), returned_cache(expected)
    assert type(got) is type(expected) and len(got.layers) == len(expected.layers)
    for a, b in zip(got.layers, expected.layers, strict=True):
        _close(a.keys, b.keys)
        _close(a.values, b.values)


@pytest.mark.parametrize(("name", "scheme"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_the_fused_forward_pass_equals_transformers(name, scheme, monkeypatch):
    """model(ids) at batch 3 (the config's use_cache: True): logits and the returned DynamicCache against
    transformers' forward on the same packed layers (the class's forward); the next step from either cache
    gives the same logits."""
    model = _quantized(name, scheme)
    calls = _counted(monkeypatch)
    ids = torch.randint(0, 512, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids)
        assert calls == [1]
        expected = type(model).forward(model, ids)
        _close(got.logits, expected.logits)
        _caches_close(got, expected)
        from modelkit.testing.causal_lm import _cache_argument, returned_cache

        step = ids[:, -1:] + 1
        after = [type(model).forward(model, step, **{_cache_argument(model): returned_cache(out)}) for out in (got, expected)]
        _close(after[0].logits, after[1].logits)


@pytest.mark.parametrize("name", ["llama3-rope", "qwen3"])
def test_the_returned_cache_continues_transformers_generate(name):
    """A greedy generate continued from the fused forward's cache gives the tokens of one continued from
    transformers' own cache (batch 2; past 64 rotary rows, so the tables grow)."""
    from modelkit.testing.causal_lm import _cache_argument, returned_cache

    model = _quantized(name, "q8_0")
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        runs = []
        for out in (model(ids), type(model).forward(model, ids)):
            runs.append(model.generate(ids, **{_cache_argument(model): returned_cache(out)}, max_new_tokens=6,
                                       do_sample=False, attention_mask=torch.ones_like(ids)))
        assert torch.equal(runs[0], runs[1]) and runs[0].shape == (2, 15)
        long = torch.randint(0, 512, (1, 70), generator=torch.Generator().manual_seed(3))
        _close(model(long, use_cache=False).logits, type(model).forward(model, long, use_cache=False).logits)


def test_many_sequences_run_in_groups_with_their_cache(monkeypatch):
    """20 sequences of 8 tokens (the C forward's groups of whole sequences, each writing its own rows of the
    cache); logits_to_keep=1, labels (the model's own loss), return_dict=False, use_cache False."""
    model = _quantized("llama-bias", "q8_0")
    calls = _counted(monkeypatch)
    ids = torch.randint(0, 512, (20, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, expected = model(ids), type(model).forward(model, ids)
        _close(got.logits, expected.logits)
        _caches_close(got, expected)
        last = model(input_ids=ids, logits_to_keep=1)
        _close(last.logits, expected.logits[:, -1:])
        loss = model(ids, labels=ids, use_cache=False)
        assert loss.cache is None and abs(float(loss.loss) - float(type(model).forward(model, ids, labels=ids).loss)) < 1e-3
        as_tuple = model(ids, return_dict=False, use_cache=False)
        assert type(as_tuple) is tuple and len(as_tuple) == 1
        _close(as_tuple[0], expected.logits)
    assert len(calls) == 4


def test_what_the_fused_forward_does_not_take_runs_transformers(monkeypatch):
    """Each case the fused path cannot answer as transformers would gives transformers' own result, bit for bit,
    without a fused call: padding, explicit positions, a cache, embeddings, hidden states asked for, other
    logits_to_keep, gradients, training mode, a hook on a block, a sliding window inside the input, unfused()."""
    from transformers.cache_utils import DynamicCache

    from modelkit.quantizers import fast_forward

    model = _quantized("qwen2", "q8_0")
    calls = _counted(monkeypatch)
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(5))
    padded = torch.ones_like(ids)
    padded[0, :2] = 0
    cases = [lambda: {"attention_mask": padded}, lambda: {"position_ids": torch.arange(6)[None] + 3},
             lambda: {"cache": DynamicCache(config=model.config)}, lambda: {"output_hidden_states": True},
             lambda: {"logits_to_keep": 2}]
    with torch.no_grad():
        for kwargs in cases:
            assert torch.equal(model(ids, **kwargs()).logits, type(model).forward(model, ids, **kwargs()).logits), kwargs()
        embeds = model.model.embed_tokens(ids)
        assert torch.equal(model(inputs_embeds=embeds).logits, type(model).forward(model, inputs_embeds=embeds).logits)
        with fast_forward.unfused():
            assert torch.equal(model(ids).logits, type(model).forward(model, ids).logits)
        handle = model.model.layers[1].mlp.register_forward_hook(lambda *_: None)
        assert torch.equal(model(ids).logits, type(model).forward(model, ids).logits)
        handle.remove()
        model.train()
        assert torch.equal(model(ids).logits, type(model).forward(model, ids).logits)
        model.eval()
    assert torch.equal(model(ids).logits, type(model).forward(model, ids).logits)        # gradients on
    assert calls == []
    with torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids))                 # an all-ones mask is no mask: fused
        assert calls == [1]
        sliding = _quantized("mistral", "q8_0")
        for layer in sliding.model.layers:
            layer.self_attn.sliding_window = 4
        sliding.config.sliding_window = 4                               # (read when its plan is built)
        assert torch.equal(sliding(ids).logits, type(sliding).forward(sliding, ids).logits) and calls == [1]


def test_float_models_copies_and_replaced_layers(monkeypatch):
    """A float model keeps transformers' forward (quantize_module leaves its input alone); a deep copy's and an
    unpickled model's fused forward run that model; the signature is transformers'; a replaced layer or a new
    tensor builds a new plan, a float product runs transformers."""
    import copy
    import inspect
    import pickle

    from modelkit.quantizers import fast_forward
    from modelkit.quantizers.hf_forward import FusedForward

    float_model = _model("llama3-rope")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = quantize_module(float_model, schemes.load_scheme("q4_0")()).eval()
    assert "forward" not in vars(float_model) and type(model.forward) is FusedForward
    assert "logits_to_keep" in inspect.signature(model.forward).parameters
    ids = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(6))
    calls = _counted(monkeypatch)
    with torch.no_grad():
        float_model(ids)
        assert calls == []
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert other.forward.model is other
            _close(other(ids).logits, type(model).forward(model, ids).logits)
        model(ids)
        first = fast_forward._PLANS[model]
        model(ids)
        assert fast_forward._PLANS[model] is first
        model.model.layers[1].mlp.down_proj = _quantized("llama3-rope", "q8_0").model.layers[1].mlp.down_proj
        _close(model(ids).logits, type(model).forward(model, ids).logits)
        assert fast_forward._PLANS[model] is not first and fast_forward._PLANS[model].plan is not None
        norm = model.model.norm
        norm.weight = torch.nn.Parameter(norm.weight * 2)
        second = fast_forward._PLANS[model]
        _close(model(ids).logits, type(model).forward(model, ids).logits)
        assert fast_forward._PLANS[model] is not second
        count = len(calls)
        model.model.layers[0].self_attn.q_proj = float_model.model.layers[0].self_attn.q_proj
        assert torch.equal(model(ids).logits, type(model).forward(model, ids).logits)
        assert fast_forward._PLANS[model].plan is None and len(calls) == count


def test_a_loaded_gguf_runs_the_fused_forward(llama_gguf, monkeypatch):
    """load_module's model of a GGUF file: model(ids) fused, as transformers' forward on its layers."""
    from modelkit.quantizers.hf_forward import FusedForward

    model = modelkit.load_module(llama_gguf)
    assert type(model.forward) is FusedForward
    calls = _counted(monkeypatch)
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 400, 5]])
        _close(model(ids).logits, type(model).forward(model, ids).logits)
    assert calls == [1]


def test_a_model_too_large_for_groups_runs_every_row_at_once(monkeypatch):
    """Blocks of more than the C forward's GROUP_WEIGHT_BYTES (8 MiB; here ~19 MB of q8_0) run 10 sequences of
    16 tokens in one group (re-reading the weights per group would stream them from memory again)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = quantize_module(transformers.LlamaForCausalLM(config).eval(), schemes.load_scheme("q8_0")()).eval()
    calls = _counted(monkeypatch)
    ids = torch.randint(0, 256, (10, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got, expected = model(ids), type(model).forward(model, ids)
    assert calls == [1]
    for b in range(10):
        _close(got.logits[b], expected.logits[b])
    _caches_close(got, expected)


def test_int8_dynamic_fuses_up_to_64_rows(monkeypatch):
    """int8-dynamic's products: fused up to ROWWISE_ROWS rows (4 x 16), transformers' forward (its layers on
    torch._int_mm) past them (5 x 16), bit for bit."""
    from modelkit.quantizers.hf_forward import ROWWISE_ROWS

    model = _quantized("llama3-rope", "int8-dynamic")
    calls = _counted(monkeypatch)
    with torch.no_grad():
        few = torch.randint(0, 512, (ROWWISE_ROWS // 16, 16), generator=torch.Generator().manual_seed(8))
        _close(model(few).logits, type(model).forward(model, few).logits)
        assert calls == [1]
        many = torch.randint(0, 512, (ROWWISE_ROWS // 16 + 1, 16), generator=torch.Generator().manual_seed(8))
        assert torch.equal(model(many).logits, type(model).forward(model, many).logits) and calls == [1]


# ---- transformers' generate on the fused forward: its DynamicCache continued (quantizers/hf_cache.py) ----

def _counted_steps(monkeypatch) -> tuple[list[int], list[int]]:
    """DecodePlan.forward's and DecodePlan.step's calls from here on."""
    forwards, steps = _counted(monkeypatch), []
    step = fast_decode.DecodePlan.step
    monkeypatch.setattr(fast_decode.DecodePlan, "step", lambda self, *a, **k: steps.append(1) or step(self, *a, **k))
    return forwards, steps


@pytest.mark.parametrize(("name", "scheme"), [("llama3-rope", "q4_0"), ("qwen3", "q8_0")])
def test_generate_runs_fused_on_its_cache(name, scheme, monkeypatch):
    """Greedy generate, 40 tokens: the prompt in one fused call, every step on the C decode step (the shadow cache
    grown from 16 to 64 positions on the way), the tokens of transformers' forward (unfused()); the returned cache
    equals transformers' and continues in transformers' forward as it does."""
    from modelkit.quantizers import fast_forward, hf_cache
    from modelkit.testing.causal_lm import _cache_argument, returned_cache

    model = _quantized(name, scheme)
    forwards, steps = _counted_steps(monkeypatch)
    ids = torch.tensor([[3, 17, 99, 250, 7]])
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
        assert forwards == [1] and len(steps) == 39
        assert hf_cache._SHADOWS[returned_cache(got)].keys.shape[3] == 64
        with fast_forward.unfused():
            expected = model.generate(ids, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(got.sequences, expected.sequences) and got.sequences.shape == (1, 45)
        _caches_close(got, expected)
        step = got.sequences[:, -1:]
        after = [type(model).forward(model, step, **{_cache_argument(model): returned_cache(out)})
                 for out in (got, expected)]
        _close(after[0].logits, after[1].logits)


def test_sampling_and_an_all_ones_mask_run_fused(monkeypatch):
    """Sampling (one seed) with an all-ones attention mask: fused, the tokens of transformers' forward."""
    from modelkit.quantizers import fast_forward

    model = _quantized("mistral", "q4_0")
    forwards, steps = _counted_steps(monkeypatch)
    ids = torch.tensor([[5, 6, 7, 300]])
    runs = []
    with torch.no_grad():
        for fused in (True, False):
            torch.manual_seed(9)
            with fast_forward.unfused() if not fused else warnings.catch_warnings():
                runs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=True,
                                           top_k=50, temperature=0.8))
    assert torch.equal(runs[0], runs[1]) and forwards == [1] and len(steps) == 19


def test_beams_padding_and_edited_caches_run_transformers(monkeypatch):
    """Beam search (the cache reordered), a padded batch and a cache cropped between calls run transformers'
    forward and give its result; chunks of several tokens continue the cache fused."""
    from transformers.cache_utils import DynamicCache

    from modelkit.quantizers import fast_forward

    model = _quantized("qwen2", "q8_0")
    forwards, steps = _counted_steps(monkeypatch)
    ids = torch.tensor([[3, 17, 99, 250, 7]])
    padded = torch.tensor([[0, 0, 9, 10, 11], [3, 17, 99, 250, 7]])
    mask = (padded != 0).long()
    with torch.no_grad():
        beams = model.generate(ids, max_new_tokens=8, do_sample=False, num_beams=2)
        batch = model.generate(padded, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert forwards == [] and steps == []
        with fast_forward.unfused():
            assert torch.equal(beams, model.generate(ids, max_new_tokens=8, do_sample=False, num_beams=2))
            assert torch.equal(batch, model.generate(padded, attention_mask=mask, max_new_tokens=8, do_sample=False))
        chunks = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(10))
        caches = [DynamicCache(config=model.config) for _ in range(2)]
        for part in (chunks[:, :5], chunks[:, 5:9], chunks[:, 9:10]):
            got, expected = model(part, cache=caches[0]), type(model).forward(model, part, cache=caches[1])
            _close(got.logits, expected.logits)
        assert forwards == [1, 1] and steps == [1]
        _caches_close(got, expected)
        for cache in caches:
            cache.crop(-3)
        rest = chunks[:, 10:]
        got, expected = model(rest, cache=caches[0]), type(model).forward(model, rest, cache=caches[1])
        assert torch.equal(got.logits, expected.logits) and forwards == [1, 1] and steps == [1]
        assert model(chunks[:, :4], cache=caches[0], position_ids=torch.arange(4)[None] + 9).logits is not None
        assert forwards == [1, 1]


def test_generates_in_two_threads_keep_their_own_caches(monkeypatch):
    """Two threads generating on one model at once (one plan, one binding, two shadows): each gets the tokens it
    gets alone, every step fused."""
    import sys
    import threading

    model = _quantized("llama3-rope", "q4_0")
    prompts = [torch.tensor([[3, 17, 99, 250, 7]]), torch.tensor([[400, 2, 81]])]
    with torch.no_grad():
        alone = [model.generate(p, max_new_tokens=24, do_sample=False) for p in prompts]
        forwards, steps = _counted_steps(monkeypatch)
        got: list[torch.Tensor | None] = [None, None]

        def run(i: int) -> None:
            with torch.no_grad():
                got[i] = model.generate(prompts[i], max_new_tokens=24, do_sample=False)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)                 # switch threads between any two bytecodes, as often as can be
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sys.setswitchinterval(interval)
    assert all(torch.equal(g, a) for g, a in zip(got, alone, strict=True))
    assert len(forwards) == 2 and len(steps) == 46
