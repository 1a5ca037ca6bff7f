"""GGUF block types: byte-identical to gguf-py's reference quantize, bit-identical dequantize.

gguf-py (`gguf.quants`) is the judge: the same float32 input must give the same bytes, and the
same bytes must give the same float32 values, bit for bit, on random tensors of awkward shapes,
on ties (+m and -m in one block), zeros of both signs, and across chunk boundaries.
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
from modelkit.quantizers import gguf_blocks  # noqa: E402

TYPES = sorted(gguf_blocks.BLOCK_TYPES)
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


@pytest.mark.parametrize("type_name", TYPES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), rows=st.integers(1, 9), blocks=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_quantize_is_byte_identical_to_gguf_py(type_name, kind, rows, blocks, seed):
    x = _data(kind, rows, blocks, seed)
    expected = gguf_quantize(x, GGMLQuantizationType[type_name.upper()])
    got = gguf_blocks.quantize(torch.from_numpy(x), type_name).numpy()
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


@pytest.mark.parametrize("type_name", TYPES)
@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.floats(min_value=-1e3, max_value=1e3, width=32, allow_subnormal=False),
                       min_size=64, max_size=64))
def test_element_level_fuzz(type_name, values):
    x = np.array(values, dtype=np.float32).reshape(2, 32)
    x[np.abs(x) < 1e-30] = 0.0          # scales stay normal numbers (see gguf_blocks' docstring)
    expected = gguf_quantize(x, GGMLQuantizationType[type_name.upper()])
    assert np.array_equal(gguf_blocks.quantize(torch.from_numpy(x), type_name).numpy(), expected)


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
    assert np.array_equal(gguf_blocks.quantize(torch.from_numpy(x), type_name).numpy(), expected)


@pytest.mark.parametrize("type_name", TYPES)
def test_chunks_and_threads_do_not_change_the_bytes(type_name, monkeypatch):
    x = _data("normal", 37, 3, seed=7)                  # 111 blocks: 12 chunks of 10 with a short last one
    expected = gguf_quantize(x, GGMLQuantizationType[type_name.upper()])
    monkeypatch.setattr(gguf_blocks, "_CHUNK_BLOCKS", 10)
    for threads in (1, 3):
        got = gguf_blocks.quantize(torch.from_numpy(x), type_name, threads=threads).numpy()
        assert np.array_equal(got, expected)


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
