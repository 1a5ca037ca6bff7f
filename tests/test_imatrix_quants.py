"""Quantization under an importance matrix, and IQ4_NL / IQ4_XS: byte-identical to llama.cpp.

llama.cpp is the judge: fixtures/llama_cpp/imatrix.npz holds what its own library (through ctypes,
fixtures/llama_cpp/make_golden_imatrix.py, llama-cpp-python 0.3.36) wrote with
`ggml_quantize_chunk(type, ..., imatrix)` for seeded inputs paired with importance vectors (eight
decades, zero columns and a zero block, all ones, tiny and huge values; rows with outliers, zeros,
constants, one sign, subnormal scales), for Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL and IQ4_XS, plus
the IQ4 bytes without an importance matrix and the floats llama.cpp dequantizes them to.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from modelkit.errors import ConfigError
from modelkit.quantizers import gguf_arrays

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "llama_cpp" / "imatrix.npz"
WEIGHTED = ("q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")
IQ4 = tuple(gguf_arrays.IQ_TYPES)
CASES = {"normal", "wide", "holes", "mixed", "outliers", "tiny", "huge", "zeros"}


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN) as data:
        return {name: data[name] for name in data.files}


def test_golden_file_pins_llama_cpp(golden):
    assert str(golden["version"]) == "0.3.36"
    assert {name.split(".")[0] for name in golden if name.endswith(".input")} == CASES
    assert gguf_arrays.KERNEL_ISAS, "modelkit.quantizers._gguf_kernels did not build: these types need it"


@pytest.mark.parametrize("type_name", WEIGHTED)
def test_quantize_with_importance_is_byte_identical_to_llama_cpp(golden, type_name):
    for case in sorted(CASES):
        ours = gguf_arrays.quantize_array(golden[f"{case}.input"], type_name, importance=golden[f"{case}.imatrix"])
        expected = golden[f"{case}.{type_name}.bytes"]
        assert ours.shape == expected.shape, case
        differing = np.flatnonzero((ours != expected).any(-1))
        assert differing.size == 0, f"{case}: rows {differing.tolist()} differ from llama.cpp"


@pytest.mark.parametrize("type_name", IQ4)
def test_iq4_without_importance_and_dequantized(golden, type_name):
    for case in sorted(CASES):
        plain = golden[f"{case}.{type_name}.plain"]
        assert np.array_equal(gguf_arrays.quantize_array(golden[f"{case}.input"], type_name), plain), case
        values = gguf_arrays.dequantize_kquants(plain, type_name)
        assert np.array_equal(values.view(np.uint32), golden[f"{case}.{type_name}.values"].view(np.uint32)), case


def test_importance_changes_the_bytes_and_q8_0_ignores_it(golden):
    x, importance = golden["normal.input"], golden["normal.imatrix"]
    assert not np.array_equal(gguf_arrays.quantize_array(x, "q4_k", importance=importance),
                              gguf_arrays.quantize_array(x, "q4_k"))
    assert np.array_equal(gguf_arrays.quantize_array(x, "q8_0", importance=importance),
                          gguf_arrays.quantize_array(x, "q8_0"))


@pytest.mark.parametrize("type_name", ("q4_0", "q5_1", "q3_k", "iq4_xs"))
def test_threads_split_on_rows_under_importance(type_name):
    """Shares of rows across threads give the bytes of one thread."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((600, 512)) * 0.02).astype(np.float32)
    importance = rng.uniform(0, 2, 512).astype(np.float32)
    one = gguf_arrays.quantize_array(x, type_name, threads=1, importance=importance)
    assert np.array_equal(gguf_arrays.quantize_array(x, type_name, threads=3, importance=importance), one)


def test_refuses_importance_that_does_not_fit():
    x = np.zeros((2, 512), np.float32)
    with pytest.raises(ConfigError, match="256 values but the rows .* have 512"):
        gguf_arrays.quantize_array(x, "q4_k", importance=np.ones(256, np.float32))
    with pytest.raises(ConfigError, match="NaN or infinity"):
        gguf_arrays.quantize_array(x, "q4_0", importance=np.full(512, np.inf, np.float32))
    x[1, 3] = np.nan
    with pytest.raises(ConfigError, match="NaN or infinity \\(row 1\\)"):
        gguf_arrays.quantize_array(x, "q5_0", importance=np.ones(512, np.float32))
    with pytest.raises(ConfigError, match="whole 256-weight super-blocks.*IQ4_NL"):
        gguf_arrays.quantize_array(np.zeros((2, 96), np.float32), "iq4_xs")
