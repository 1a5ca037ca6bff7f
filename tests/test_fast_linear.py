"""The packed-weight kernels (quantizers/fast_linear.py, _matmul_kernels.c) against the reference path.

The reference is what a quantized layer computed before: dequantize the weight, then a float product
(`use_isa(None)`). The kernels also round activations to int8 per block of 32, so they differ from it
by that rounding: at most RTOL of the largest output, for every scheme, shape and kernel. Every kernel
this CPU runs (the portable "generic" one included, which is what a CPU without AVX2 gets) is checked,
and the SIMD kernels agree with the generic one up to float summation order.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import modelkit
from modelkit.checkpoint import Checkpoint
from modelkit.errors import ConfigError
from modelkit.models import build
from modelkit.models.tinylm import example_inputs
from modelkit.quantizers import _modules, fast_forward, fast_linear, gguf_blocks, int4, int8
from modelkit.quantizers.gguf_arrays import Q4_0Config, Q4_K_MConfig, Q8_0Config

# max |kernel - reference| / max |reference|, pinned at about 1.5x the worst measured on 2026-11-25
# over the shapes below (0.0088, random weights and inputs): int8 activations in blocks of 32.
RTOL = 0.013
# SIMD kernels against the generic one: the same integers, float sums in another order.
ISA_RTOL = 1e-5

CONFIGS = {
    "int8": (int8, int8.Int8Config()),
    "int8 asymmetric": (int8, int8.Int8Config(symmetric=False)),
    "int8 per tensor": (int8, int8.Int8Config(per_channel=False)),
    "int4": (int4, int4.Int4Config()),
    "int4 g64 asymmetric": (int4, int4.Int4Config(group_size=64, symmetric=False)),
    "q8_0": (gguf_blocks, Q8_0Config()),
    "q4_0": (gguf_blocks, Q4_0Config()),
}
# (rows, columns): rows not a multiple of the kernels' 8; int8 also with columns not a multiple of 32
SHAPES = [(13, 64), (37, 128), (5, 100)]
# one row; fewer than a tile of 8; a tile and a tail; four tiles and a tail (VNNI: blocks transposed once per call)
BATCHES = (1, 3, 11, 35)


def _quantized(name: str, rows: int, cols: int) -> nn.Module | None:
    module, config = CONFIGS[name]
    if cols % 32 and not name.startswith("int8"):
        return None
    if cols % 64 and "g64" in name:
        return None
    layer = nn.Linear(cols, rows)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)))
    return module.apply(nn.Sequential(layer), config)[0]


CASES = [(n, s) for n in CONFIGS for s in SHAPES if _quantized(n, *s) is not None]


@pytest.mark.parametrize(("name", "shape"), CASES, ids=[f"{n}-{r}x{c}" for n, (r, c) in CASES])
def test_kernels_match_the_reference_path(name, shape):
    layer = _quantized(name, *shape)
    assert layer.packed() is not None, "this layout has a kernel"
    _every_kernel_matches(layer, BATCHES, RTOL, (name, shape))


def _every_kernel_matches(layer: nn.Module, batches: tuple[int, ...], rtol: float, label: object) -> None:
    """Every kernel of ISAS within rtol of the reference path, and within ISA_RTOL of the generic one."""
    for batch in batches:
        x = torch.randn(batch, layer.weight_shape[1], generator=torch.Generator().manual_seed(batch))
        with torch.no_grad(), fast_linear.use_isa(None):
            reference = layer(x)
        outputs = {}
        for isa in fast_linear.ISAS:
            with torch.no_grad(), fast_linear.use_isa(isa):
                outputs[isa] = layer(x)
        scale = float(reference.abs().max())
        for isa, y in outputs.items():
            assert float((y - reference).abs().max()) <= rtol * scale, (label, batch, isa)
            assert float((y - outputs["generic"]).abs().max()) <= ISA_RTOL * scale, (label, batch, isa)


def test_the_portable_kernel_is_always_built_and_can_be_forced():
    assert "generic" in fast_linear.ISAS
    assert fast_linear._chosen("generic") == "generic"          # what MODELKIT_MATMUL_ISA=generic picks
    assert fast_linear._chosen("off") is None and fast_linear._chosen(None) == fast_linear.ISAS[0]
    with pytest.raises(ConfigError, match="MODELKIT_MATMUL_ISA"):
        fast_linear._chosen("sse9")


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_conv2d_runs_as_a_product_with_its_patches(name):
    module, config = CONFIGS[name]
    conv = nn.Conv2d(8, 6, 2, stride=2, padding=1) if name == "int8" else nn.Conv2d(32, 5, 1)
    quantized = module.apply(nn.Sequential(conv), config)[0]
    assert quantized.packed() is not None
    x = torch.randn(2, conv.in_channels, 7, 7, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast = quantized(x)
        with fast_linear.use_isa(None):
            reference = quantized(x)
    assert fast.shape == reference.shape
    assert float((fast - reference).abs().max()) <= RTOL * float(reference.abs().max())


def test_layouts_without_a_kernel_keep_the_reference_path():
    """GPT-2's transposed blocks (the blocks run down the columns) have no kernel."""
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    stored = gguf_blocks.quantized_tensor(weight.T.contiguous(), "q8_0")
    layer = _modules.QuantizedLinear(replace(stored, shape=(32, 64), params={**stored.params, "transposed": True}))
    x = torch.randn(2, 64)
    assert layer.packed() is None
    with torch.no_grad():
        fast = layer(x)
        with fast_linear.use_isa(None):
            assert torch.equal(fast, layer(x))


# ---- the other GGUF block types (_matmul_kernels_kquants.h) -----------------------------------------

# max |kernel - reference| / max |reference| for the block types below, pinned at about 1.5x the worst
# measured on 2026-11-25 over GGUF_SHAPES x GGUF_BATCHES x every kernel (0.0076, q5_0; the K types, whose
# activations are int8 in blocks of 256 (q8_K), measured 0.0068-0.0072).
GGUF_RTOL = 0.0115
GGUF_TYPES = ("q4_1", "q5_0", "q5_1", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")
# (rows, columns): odd rows (the K kernels pair rows; the blocks of 32 run in tiles of 8 rows: 37 is four
# tiles and a clamped fifth, with rows two tiles on prefetched); whole blocks of the type (K types: 256)
GGUF_SHAPES = {32: (37, 96), 256: (11, 512)}
# K types: 1 and 3 the SIMD kernels' dot products on the stored blocks; 6 unpacked rows in 2 x 4 tiles (a tail of
# 2 activation rows); 11, 12 and 64 the VNNI kernels' interleaved 8-row tiles (AVX2: 2 x 4 tiles) on 8 activation
# rows at a time, with tails of 3 (one at a time) and 4. Blocks of 32: 1, 3, 6 one activation row at a time;
# 11 and 12 a tile of 8 and the rest alone; 64 eight tiles of 8 (VNNI: each block transposed once per call).
GGUF_BATCHES = (1, 3, 6, 11, 12, 64)


@pytest.fixture(scope="module")
def gguf_layers():
    from modelkit.quantizers.gguf_arrays import block_weights

    layers = {}
    for type_name in GGUF_TYPES:
        rows, cols = GGUF_SHAPES[block_weights(type_name)]
        generator = torch.Generator().manual_seed(rows * cols)
        weight, bias = torch.randn(rows, cols, generator=generator), torch.randn(rows, generator=generator)
        layers[type_name] = _modules.QuantizedLinear(gguf_blocks.quantized_tensor(weight, type_name), bias)
    return layers


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_block_kernels_match_the_reference_path(gguf_layers, type_name):
    layer = gguf_layers[type_name]
    assert layer.packed() is not None, "this block type has a kernel"
    _every_kernel_matches(layer, GGUF_BATCHES, GGUF_RTOL, type_name)


def test_k_types_take_whole_super_blocks_only():
    """A K type's rows must be whole 256-weight super-blocks (rows that are not are stored as the fallback type)."""
    stored = gguf_blocks.quantized_tensor(torch.randn(4, 256), "q4_k")
    parts = {"qdata": stored.parts["qdata"].load()}
    assert fast_linear.packed_form("gguf", stored.params, (4, 256), parts) is not None
    assert fast_linear.packed_form("gguf", stored.params, (8, 128), parts) is None


@pytest.fixture(scope="module")
def tinylm_files(tmp_path_factory):
    """A small tinylm quantized to int8 (safetensors) and q4_0 (GGUF), written through modelkit; and one with
    whole 256-weight rows as llama-quantize's Q4_K_M (Q4_K and Q6_K blocks)."""
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64}
    model = build("tinylm", config, seed=0).eval()
    out = tmp_path_factory.mktemp("fast")
    files = {}
    for suffix, (module, cfg) in {".safetensors": CONFIGS["int8"], ".gguf": CONFIGS["q4_0"]}.items():
        path = out / f"m{suffix}"
        modelkit.save(Checkpoint.from_module(module.apply(model, cfg)), path)
        files[suffix] = path
    wide = build("tinylm", {**config, "hidden_size": 256, "intermediate_size": 512}, seed=0).eval()
    files["q4_k_m.gguf"] = out / "m-q4_k_m.gguf"
    modelkit.save(Checkpoint.from_module(gguf_blocks.apply(wide, Q4_K_MConfig())), files["q4_k_m.gguf"])
    return files


@pytest.mark.parametrize("suffix", [".safetensors", ".gguf", "q4_k_m.gguf"])
def test_a_loaded_quantized_model_holds_no_float_copy(tinylm_files, suffix, monkeypatch):
    """Resident tensors of load_module's model <= 1.15x the file; its layers compute through the kernels."""
    path = tinylm_files[suffix]
    model = modelkit.load_module(path)
    calls = []
    real = fast_linear.matmul
    monkeypatch.setattr(fast_linear, "matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = example_inputs(2, seq_len=8)
    with torch.no_grad():
        model(x)                                   # the fused forward: the block stack in one C call, no matmul
        with fast_forward.unfused():
            model(x)                               # tinylm's torch path: one kernel call per quantized Linear
    assert fast_forward._PLANS[model].plan is not None
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    tensors.update({id(v): v.numel() * v.element_size() for m in model.modules() for v in m.__dict__.values()
                    if isinstance(v, torch.Tensor)})
    assert sum(tensors.values()) <= 1.15 * path.stat().st_size
    quantized = [m for m in model.modules() if isinstance(m, _modules.QuantizedLinear)]
    assert quantized and len(calls) == len(quantized)           # every quantized Linear ran a kernel
    if suffix == "q4_k_m.gguf":
        assert {"Q4_K", "Q6_K"} <= {m.params["ggml_type"] for m in quantized}


def test_embedding_dequantizes_only_the_rows_it_looks_up():
    table = nn.Embedding(50, 64)
    quantized = gguf_blocks.apply(nn.Sequential(table), Q8_0Config())[0]
    ids = torch.tensor([[3, 49, 3], [0, 7, 11]])
    assert torch.equal(quantized(ids), quantized.dequantize()[ids])


def test_int8_dynamic_small_layers_run_the_kernel_with_its_own_activations(monkeypatch):
    """Small int8-dynamic layers use the kernel with one activation scale per row: torch._int_mm's numbers."""
    from modelkit.quantizers import int8_dynamic

    layer = int8_dynamic.apply(nn.Sequential(nn.Linear(96, 40)), int8_dynamic.Int8DynamicConfig())[0]
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))
    calls = []
    real = fast_linear.matmul
    monkeypatch.setattr(fast_linear, "matmul", lambda *a, **k: calls.append(k) or real(*a, **k))
    with torch.no_grad():
        fast = layer(x)
        monkeypatch.setattr(int8_dynamic, "SMALL_WEIGHT", 0)
        int_mm = layer(x)
    assert calls == [{"rowwise": True}]
    assert float((fast - int_mm).abs().max()) <= ISA_RTOL * float(int_mm.abs().max())


def test_threads_share_rows_without_changing_a_bit():
    """The thread pool splits output rows: every row is computed as alone, so the result is bit for bit the same."""
    layer = _quantized("q4_0", 203, 256)
    x = torch.randn(19, 256, generator=torch.Generator().manual_seed(0))
    packed = layer.packed()
    alone = fast_linear.matmul(x, packed, layer.bias, threads=1)
    for threads in (2, 3, 8):
        for _ in range(3):
            assert torch.equal(fast_linear.matmul(x, packed, layer.bias, threads=threads), alone), threads
    # callers on several Python threads at once (a server): one uses the pool, the others run alone
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: fast_linear.matmul(x, packed, layer.bias, threads=2), range(16)))
    assert all(torch.equal(r, alone) for r in results)


def test_inputs_keep_their_leading_shape_and_a_wrong_width_is_refused():
    layer = _quantized("q8_0", 13, 64)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = layer(x)
        assert y.shape == (2, 3, 13) and torch.equal(y[1], layer(x[1]))
        assert layer(x[0, 0]).shape == (13,)
        with pytest.raises(ConfigError, match="64 input features"):
            fast_linear.matmul(torch.randn(2, 128), layer.packed())


def test_threads_share_only_products_large_enough_to_repay_them(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert fast_linear.threads_for(16, 512, 192) == 1          # tinylm's largest product at 16 tokens
    assert fast_linear.threads_for(1, 768, 768) == 1           # decode, ~0.6 MB of weights
    assert fast_linear.threads_for(1, 2048, 768) == 2          # decode, 1.5 Mi weights streamed from memory
    assert fast_linear.threads_for(64, 512, 192) == 2          # batch: weights reused over many rows


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64}


@pytest.mark.parametrize("scheme", ["float", "q8_0", "int4"])
def test_generate_with_a_kv_cache_gives_the_tokens_of_full_passes(scheme):
    """`modelkit generate` on tinylm (pipeline.generate.generate_bytes) decodes with serve's key/value cache:
    the greedy bytes of tinylm.generate's full pass per byte, before and past the 64-byte window."""
    from modelkit.models.tinylm import generate
    from modelkit.pipeline.generate import generate_bytes

    model = build("tinylm", TINY, seed=0).eval()
    if scheme != "float":
        module, config = CONFIGS[scheme]
        model = module.apply(model, config)
    for prompt, new in (("def ", 16), ("x" * 56, 12)):             # the second outgrows the window
        expected = generate(model, prompt.encode(), max_new_bytes=new)
        got = generate_bytes(model, prompt, max_new_tokens=new)
        assert got.completion == expected, (scheme, prompt)
        assert got.new_tokens == new and got.prompt_seconds > 0 and got.decode_seconds > 0
