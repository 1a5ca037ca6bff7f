"""GGUF block types: byte-identical to gguf-py's reference quantize, bit-identical dequantize.

gguf-py (`gguf.quants`) is the judge: the same float32 input must give the same bytes, and the
same bytes must give the same float32 values, bit for bit, on random tensors of awkward shapes,
on ties (+m and -m in one block), zeros of both signs, and across chunk and thread boundaries;
for every implementation of quantize this machine has (the C kernels: avx2 and generic, and
eager torch).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from modelkit.errors import ConfigError  # noqa: E402
from modelkit.quantizers import gguf_arrays, gguf_blocks  # noqa: E402

TYPES = sorted(gguf_blocks.BLOCK_TYPES)
IMPLEMENTATIONS = gguf_blocks.IMPLEMENTATIONS
KINDS = ("normal", "uniform", "ties", "zeros", "small", "large", "integers", "outlier")


def _data(kind: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Float32 (rows, blocks * 32) test data of one kind; finite, block scales above float32's subnormals."""
    rng = np.random.default_rng(seed)
    shape = (rows, blocks * 32)
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "uniform":
        x = rng.uniform(-1, 1, shape)
    elif kind == "ties":             # +m and -m in the same block; argmax must pick the first
        x = rng.choice([-2.0, -1.0, 0.0, 1.0, 2.0], shape)
    elif kind == "zeros":            # all-zero first blocks, +0.0 or -0.0 (see test_mixed_signed_zeros)
        x = rng.standard_normal(shape)
        x[:, :32] = np.where(rng.random((rows, 1)) < 0.5, -0.0, 0.0)
    elif kind == "small":
        x = rng.standard_normal(shape) * 1e-20
    elif kind == "large":
        x = rng.standard_normal(shape) * 1e4
    elif kind == "integers":         # exact .5 products appear: the rounding rule matters
        x = rng.integers(-127, 128, shape).astype(np.float64) / 4
    else:
        x = rng.standard_normal(shape) * 0.02
        x[rng.random(shape) < 0.01] = 3.0
    return x.astype(np.float32)


def test_the_c_kernels_are_built_here():
    """CI has a C compiler: a silent fallback to eager torch (the extension is optional) must show."""
    assert IMPLEMENTATIONS[0] != "torch", "modelkit.quantizers._gguf_kernels did not build: see setup.py"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("type_name", TYPES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), rows=st.integers(1, 9), blocks=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_quantize_is_byte_identical_to_gguf_py(type_name, implementation, kind, rows, blocks, seed):
    x = _data(kind, rows, blocks, seed)
    expected = gguf_quantize(x, GGMLQuantizationType[type_name.upper()])
    got = gguf_blocks.quantize(torch.from_numpy(x), type_name, implementation=implementation).numpy()
    assert got.shape == expected.shape and got.dtype == np.uint8
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("type_name", TYPES)
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_dequantize_is_bit_identical_to_gguf_py(type_name, rows, blocks, seed):
    kind = gguf_blocks.block_type(type_name)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows * blocks, kind.type_size), dtype=np.uint8)
    scales = rng.standard_normal((rows * blocks, 2)).astype(np.float16)       # finite d (and m)
    data[:, :2] = scales[:, :1].view(np.uint8)
    if type_name in ("q4_1", "q5_1"):
        data[:, 2:4] = scales[:, 1:].view(np.uint8)
    data = data.reshape(rows, blocks * kind.type_size)
    expected = gguf_dequantize(data, GGMLQuantizationType[type_name.upper()])
    got = gguf_blocks.dequantize(torch.from_numpy(data), type_name).numpy()
    assert got.shape == expected.shape
    assert np.array_equal(got.view(np.uint32), expected.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("type_name", TYPES)
@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.floats(min_value=-1e3, max_value=1e3, width=32, allow_subnormal=False),
                       min_size=64, max_size=64))
def test_element_level_fuzz(type_name, implementation, values):
    x = np.array(values, dtype=np.float32).reshape(2, 32)
    x[np.abs(x) < 1e-30] = 0.0          # scales stay normal numbers (see gguf_blocks' docstring)
    expected = gguf_quantize(x, GGMLQuantizationType[type_name.upper()])
    got = gguf_blocks.quantize(torch.from_numpy(x), type_name, implementation=implementation).numpy()
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("type_name", TYPES)
def test_extreme_finite_values(type_name, implementation):
    """Scales and minima that overflow float16 (stored as inf, as gguf-py does) and huge ranges.

    (Ranges beyond float32, max - min = inf, make gguf-py cast NaN to uint8, which numpy leaves
    to the CPU: no reference there.)"""
    x = np.array([[1e30, -1e30] + [1.0] * 30, [7e4] * 32, [-1e6] + [1e6] * 31, [1e5, -1e-3] * 16,
                  [65504.0, -65520.0] * 16], np.float32)
    expected = gguf_quantize(x, GGMLQuantizationType[type_name.upper()])
    got = gguf_blocks.quantize(torch.from_numpy(x), type_name, implementation=implementation).numpy()
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_infinity_are_refused_with_the_row(type_name, implementation, bad):
    x = torch.randn(6, 64)
    x[4, 40] = bad
    with pytest.raises(ConfigError, match=r"holds NaN or infinity \(row 4\)"):
        gguf_blocks.quantize(x, type_name, implementation=implementation)


def test_a_model_with_nan_weights_names_the_module():
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.ReLU(), torch.nn.Linear(8 * 4, 4))
    with torch.no_grad():
        model[0].weight[3, 5] = float("nan")
    with pytest.raises(ConfigError, match=r"^0\.weight: cannot quantize to Q8_0: .*NaN or infinity \(row 3\)"):
        gguf_blocks.apply(model, gguf_blocks.Q8_0Config())


def test_unknown_implementation_names_the_available_ones():
    with pytest.raises(ConfigError, match="available: .*torch"):
        gguf_blocks.quantize(torch.randn(1, 32), "q8_0", implementation="cuda")


@pytest.mark.skipif("torch" == IMPLEMENTATIONS[0], reason="no C kernels")
def test_half_conversion_matches_numpy():
    """Every block's scale goes through the kernels' float32 -> float16 rounding: compared with
    numpy on every float32 exponent (normal, subnormal-half, overflow, NaN, inf), every 2**-13
    mantissa step around the rounding points, and random bit patterns."""
    from modelkit.quantizers import _gguf_kernels

    exponents = np.arange(256, dtype=np.uint32) << 23
    near_rounding = (np.arange(1 << 10, dtype=np.uint32) << 13)[:, None] + np.array([0, 1, 0xfff, 0x1000, 0x1001, 0x1fff])
    mantissas = np.concatenate([np.arange(0, 1 << 23, 4093, dtype=np.uint32), near_rounding.ravel().astype(np.uint32)])
    patterns = (exponents[:, None] | mantissas[None, :]).ravel()
    patterns = np.concatenate([patterns, patterns | 0x80000000,
                               np.random.default_rng(0).integers(0, 2**32, 1_000_000, dtype=np.uint32)])
    values = patterns.view(np.float32)
    got = np.empty(values.size, np.uint16)
    _gguf_kernels.half_bits(values, got.view(np.uint8))
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(np.float16).view(np.uint16)
    nan = np.isnan(values)
    assert np.array_equal(got[~nan], expected[~nan])
    assert np.all((got[nan] & 0x7c00) == 0x7c00) and np.all(got[nan] & 0x03ff)      # NaN stays NaN


@pytest.mark.parametrize("type_name", ["q8_0", "q4_0", "q5_0"])
def test_mixed_signed_zeros(type_name):
    """Blocks of +0.0 and -0.0 mixed: the first zero decides the sign of d, as gguf-py's argmax does.

    (For q4_1 / q5_1 the stored minimum of such a block is a zero whose sign numpy's SIMD min
    picks by lane order, which differs between CPUs; docs/quantizers/gguf.md says so.)
    """
    x = np.zeros((4, 64), np.float32)
    x[0, 0], x[1, 5], x[2, :] = -0.0, -0.0, -0.0
    x[3, 1::2] = -0.0
    expected = gguf_quantize(x, GGMLQuantizationType[type_name.upper()])
    for implementation in IMPLEMENTATIONS:
        got = gguf_blocks.quantize(torch.from_numpy(x), type_name, implementation=implementation).numpy()
        assert np.array_equal(got, expected), implementation


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("type_name", TYPES)
def test_chunks_and_threads_do_not_change_the_bytes(type_name, implementation, monkeypatch):
    x = _data("normal", 37, 3, seed=7)                  # 111 blocks: 12 chunks of 10 with a short last one
    expected = gguf_quantize(x, GGMLQuantizationType[type_name.upper()])
    monkeypatch.setattr(gguf_blocks, "_CHUNK_BLOCKS", 10)
    monkeypatch.setattr(gguf_arrays, "MIN_SHARE", 10)  # the C kernels' shares: 37 + 37 + 37 blocks
    for threads in (1, 3):
        got = gguf_blocks.quantize(torch.from_numpy(x), type_name, threads=threads, implementation=implementation)
        assert np.array_equal(got.numpy(), expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_empty_tensors(implementation):
    assert gguf_blocks.quantize(torch.empty(0, 64), "q4_0", implementation=implementation).shape == (0, 36)


def test_thread_setting_is_restored():
    before = torch.get_num_threads()
    gguf_blocks.quantize(torch.randn(4, 64), "q4_0", threads=2)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("type_name", TYPES)
def test_leading_dimensions_are_rows(type_name):
    x = torch.randn(2, 3, 64)
    flat = gguf_blocks.quantize(x.reshape(6, 64), type_name)
    assert torch.equal(gguf_blocks.quantize(x, type_name), flat)
    back = gguf_blocks.dequantize(flat, type_name, (2, 3, 64))
    assert back.shape == (2, 3, 64)


@pytest.mark.parametrize("shape", [(4, 33), (4, 31), (10,), (3, 48)])
def test_rows_not_a_multiple_of_the_block_size_get_a_clear_error(shape):
    with pytest.raises(ConfigError, match="multiple of 32"):
        gguf_blocks.quantize(torch.randn(shape), "q4_0")


def test_unknown_type_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"known: q8_0, q4_0.*did you mean 'q5_1'"):
        gguf_blocks.quantize(torch.randn(1, 32), "q5_l")


def test_bits_per_weight_match_ggml():
    assert {n: t.bits_per_weight for n, t in gguf_blocks.BLOCK_TYPES.items()} == {
        "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0}
    for name, kind in gguf_blocks.BLOCK_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]] == (32, kind.type_size)


def test_gguf_layout_dequantizes_through_the_checkpoint():
    from modelkit.checkpoint import QuantizedTensor

    w = torch.randn(8, 64)
    q = gguf_blocks.quantized_tensor(w, "q5_1")
    assert isinstance(q, QuantizedTensor) and q.layout == "gguf" and q.params == {"ggml_type": "Q5_1"}
    expected = gguf_dequantize(q.parts["qdata"].load().numpy(), GGMLQuantizationType.Q5_1)
    assert np.array_equal(q.load().numpy(), expected)
    assert q.bits_per_weight == 6.0
