"""K-quants: byte-identical to llama.cpp's quantization, bit-identical to its dequantization.

llama.cpp is the judge: fixtures/llama_cpp/kquants.npz holds what its own library (through
ctypes, fixtures/llama_cpp/make_golden_kquants.py, llama-cpp-python 0.3.36) wrote for seeded
inputs (normal weights, outliers, zeros, constant rows and sub-blocks, rows of one sign, tiny and
huge values) as Q2_K..Q6_K, and the floats its dequantizers gave back. Every K type must quantize
to exactly those bytes and dequantize to exactly those floats. Then the
schemes end to end: `modelkit quantize --scheme q6_k` on a weight file, llama.cpp's fallback type
for rows that are not whole super-blocks, and `modelkit convert` of the GGUF back to float.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from safetensors.numpy import load_file, save_file

from modelkit.cli.app import main
from modelkit.errors import ConfigError
from modelkit.quantizers import gguf_arrays, gguf_blocks, gguf_recipes

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "llama_cpp" / "kquants.npz"
QUANTIZED = gguf_arrays.K_QUANTIZED                         # q2_k .. q6_k
ALL = tuple(sorted(gguf_arrays.K_TYPE_SIZES))              # q2_k .. q6_k
# relative RMS error on normal weights, pinned at about 1.3x the values measured 2026-11-25
RMS_BOUND = {"q2_k": 0.39, "q3_k": 0.2, "q4_k": 0.093, "q5_k": 0.047, "q6_k": 0.023}   # 0.296, 0.151, 0.071, 0.036, 0.018


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN) as data:
        return {name: data[name] for name in data.files}


def _cases(golden: dict[str, np.ndarray]) -> list[str]:
    return sorted(name.split(".")[0] for name in golden if name.endswith(".input"))


def test_golden_file_pins_llama_cpp(golden):
    assert str(golden["version"]) == "0.3.36"
    assert set(_cases(golden)) == {"normal", "wide", "outliers", "zeros", "mixed", "heavy"}
    assert gguf_arrays.KERNEL_ISAS, "modelkit.quantizers._gguf_kernels did not build: K-quants need it"


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_quantize_is_byte_identical_to_llama_cpp(golden, type_name):
    for case in _cases(golden):
        ours = gguf_arrays.quantize_array(golden[f"{case}.input"], type_name)
        expected = golden[f"{case}.{type_name}.bytes"]
        assert ours.shape == expected.shape, case
        differing = np.flatnonzero((ours != expected).any(-1))
        assert differing.size == 0, f"{case}: rows {differing.tolist()} differ from llama.cpp"


@pytest.mark.parametrize("type_name", ALL)
def test_dequantize_is_bit_identical_to_llama_cpp(golden, type_name):
    for case in _cases(golden):
        ours = gguf_arrays.dequantize_kquants(golden[f"{case}.{type_name}.bytes"], type_name)
        expected = golden[f"{case}.{type_name}.values"]
        assert ours.dtype == np.float32 and ours.shape == expected.shape, case
        assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32)), case
        # the fallback where the extension is not built: gguf-py's numpy dequantizer, the same floats
        fallback = gguf_dequantize(golden[f"{case}.{type_name}.bytes"], GGMLQuantizationType[type_name.upper()])
        assert np.array_equal(fallback.astype(np.float32).view(np.uint32), expected.view(np.uint32)), case


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_threads_split_on_super_blocks(type_name):
    """Shares of super-blocks across threads give the bytes of one thread (a share boundary mid-row)."""
    x = (np.random.default_rng(7).standard_normal((4100, 512)) * 0.02).astype(np.float32)
    one = gguf_arrays.quantize_kquants(x, type_name, threads=1)
    assert np.array_equal(gguf_arrays.quantize_kquants(x, type_name, threads=3), one)
    values = gguf_arrays.dequantize_kquants(one, type_name, threads=1)
    assert np.array_equal(gguf_arrays.dequantize_kquants(one, type_name, threads=3), values)
    rms = float(np.sqrt(((values - x) ** 2).mean() / (x ** 2).mean()))
    assert rms < RMS_BOUND[type_name], rms


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_refuses_rows_that_are_not_super_blocks_and_nan(type_name):
    with pytest.raises(ConfigError, match=f"whole 256-weight super-blocks.*{gguf_arrays.K_FALLBACK[type_name].upper()}"):
        gguf_arrays.quantize_array(np.zeros((2, 96), np.float32), type_name)
    x = np.zeros((3, 512), np.float32)
    x[2, 300] = np.nan
    with pytest.raises(ConfigError, match="NaN or infinity \\(row 2\\)"):
        gguf_arrays.quantize_array(x, type_name)
    with pytest.raises(ConfigError, match="not whole"):
        gguf_arrays.dequantize_kquants(np.zeros((1, 100), np.uint8), type_name)


@pytest.fixture(scope="module")
def weight_file(tmp_path_factory) -> Path:
    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("kq") / "w.safetensors"
    save_file({"big.weight": (rng.standard_normal((16, 512)) * 0.05).astype(np.float32),
               "small.weight": rng.standard_normal((8, 96)).astype(np.float32),      # 32s, not 256s: fallback
               "odd.weight": rng.standard_normal((4, 100)).astype(np.float32),       # neither: kept
               "norm.bias": rng.standard_normal(512).astype(np.float32)}, str(path))
    return path


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_cli_quantize_and_convert_back(weight_file, tmp_path, type_name):
    from gguf import GGUFReader

    gguf_path, back = tmp_path / "w.gguf", tmp_path / "back.safetensors"
    result = CliRunner().invoke(main, ["quantize", str(weight_file), str(gguf_path), "--scheme", type_name])
    assert result.exit_code == 0, result.output
    reader = GGUFReader(str(gguf_path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    fallback = gguf_arrays.K_FALLBACK[type_name].upper()
    # q2_k and q6_k are llama.cpp's file types of those names (recipes): rows that are not whole 32-weight blocks
    # are F16 there, as llama-quantize writes them; the plain block types keep them as they are
    odd = "F16" if type_name in gguf_recipes.RECIPES else "F32"
    assert types == {"big.weight": type_name.upper(), "small.weight": fallback, "odd.weight": odd,
                     "norm.bias": "F32"}
    source = load_file(str(weight_file))
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert np.array_equal(stored["big.weight"].reshape(16, -1), gguf_arrays.quantize_array(source["big.weight"], type_name))
    result = CliRunner().invoke(main, ["convert", str(gguf_path), str(back), "--dtype", "f32"])
    assert result.exit_code == 0, result.output
    values = load_file(str(back))
    expected = gguf_arrays.dequantize_kquants(gguf_arrays.quantize_array(source["big.weight"], type_name), type_name)
    assert np.array_equal(values["big.weight"], expected)
    assert np.array_equal(values["odd.weight"], source["odd.weight"].astype(np.float16 if odd == "F16" else np.float32).astype(np.float32))
    small = gguf_arrays.quantize_array(source["small.weight"], fallback.lower())       # llama.cpp's fallback type
    assert torch.equal(torch.from_numpy(values["small.weight"]), gguf_blocks.dequantize(torch.from_numpy(small), fallback))


def test_scheme_config_and_module_path():
    from modelkit import schemes

    config = schemes.config_from_json(json.dumps({"scheme": "q6_k"}))
    assert type(config).__name__ == "Q6_KConfig"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 8), torch.nn.Linear(96, 4), torch.nn.Linear(100, 2))
    quantized = gguf_blocks.apply(model, config)
    assert [getattr(m, "params", {}).get("ggml_type") for m in quantized] == ["Q6_K", "Q8_0", None]
    expected = gguf_arrays.dequantize_kquants(gguf_arrays.quantize_array(model[0].weight.detach().numpy(), "q6_k"),
                                              "q6_k")
    assert torch.equal(quantized[0].dequantize(), torch.from_numpy(expected))
    assert torch.equal(quantized[2].weight, model[2].weight)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_k_tensors_round_trip_through_files(tmp_path, fmt):
    """K-typed QuantizedTensors are stored natively (the block bytes) and read back bit for bit."""
    import modelkit
    from modelkit.checkpoint import Checkpoint
    from modelkit.pipeline.write import write_checkpoint

    torch.manual_seed(1)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 4, bias=False) for _ in QUANTIZED))
    entries = {f"{i}.weight": gguf_blocks.quantized_tensor(layer.weight.detach(), t)
               for i, (layer, t) in enumerate(zip(model, QUANTIZED, strict=True))}
    path = tmp_path / f"k.{fmt}"
    write_checkpoint(Checkpoint(entries, {}), path, fmt, force=False, verify=True)
    back = modelkit.load(path).tensors
    for name, q in entries.items():
        assert back[name].params["ggml_type"] == q.params["ggml_type"]
        assert torch.equal(back[name].parts["qdata"].load().reshape(-1), q.parts["qdata"].load().reshape(-1))
        assert torch.equal(back[name].load(), q.load())
