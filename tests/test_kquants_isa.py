"""K-quant quantizers on every instruction set this CPU runs: the same bytes as llama.cpp, and as each other.

The AVX2 quantizers (quantizers/_gguf_kernels_kquants_avx2.h) fit eight sub-blocks side by side, one per
lane, each lane doing the portable kernel's float32 operations in its order; the portable ones
(_gguf_kernels_kquants.h, _gguf_kernels_imatrix.h) are what a CPU without AVX2 runs. Each ISA must write
llama.cpp's golden bytes (fixtures/llama_cpp/kquants.npz and imatrix.npz, from llama.cpp's own library),
and AVX2 must write the portable kernel's bytes on seeded random rows and adversarial ones (zeros,
constant rows and sub-blocks, ties of magnitude, one value, huge values whose squares overflow, tiny and
subnormal values, magnitudes spread over forty decades), without and with importance matrices (zero,
tiny, huge, spread over eight decades).
"""
from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest

from modelkit.quantizers import gguf_arrays

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "llama_cpp"
ISAS = gguf_arrays.KERNEL_ISAS
TYPES = gguf_arrays.K_QUANTIZED                 # q2_k .. q6_k
kernels = gguf_arrays._gguf_kernels


def _golden(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name) as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def golden() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    return _golden("kquants.npz"), _golden("imatrix.npz")


def _quantize(type_name: str, x: np.ndarray, isa: str, importance: np.ndarray | None = None) -> np.ndarray:
    block, size = gguf_arrays.KERNEL_TYPES[type_name]
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.size // block * size, dtype=np.uint8)
    assert kernels.kquantize(type_name, x.reshape(-1), out, importance, isa) == -1
    return out.reshape(x.shape[0], -1)


def _cpu_has_avx2() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
    return bool(flags) and "avx2" in flags[0].split()


def test_the_best_isa_is_picked_and_the_portable_one_is_kept():
    assert ISAS and ISAS[-1] == "generic", "modelkit.quantizers._gguf_kernels did not build: K-quants need it"
    if platform.system() == "Linux":
        assert ("avx2" in ISAS) == _cpu_has_avx2()
    x = np.zeros((1, 256), np.float32)
    with pytest.raises(ValueError, match="no sse9 kernels"):
        _quantize("q6_k", x, "sse9")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", TYPES)
def test_every_isa_writes_llama_cpps_bytes(golden, isa, type_name):
    plain, weighted = golden
    for record, with_importance in ((plain, False), (weighted, True)):
        for case in sorted(name.split(".")[0] for name in record if name.endswith(".input")):
            importance = record[f"{case}.imatrix"] if with_importance else None
            ours = _quantize(type_name, record[f"{case}.input"], isa, importance)
            differing = np.flatnonzero((ours != record[f"{case}.{type_name}.bytes"]).any(-1))
            assert differing.size == 0, f"{case} (importance: {with_importance}): rows {differing.tolist()} differ"


def _adversarial_rows() -> np.ndarray:
    """Rows of 256 values built to hit every branch of the scale searches."""
    rng = np.random.default_rng(15)
    normal = rng.standard_normal((4, 256))
    rows = [
        np.zeros(256), np.full(256, 0.5), np.full(256, -3.0),            # zeros, constant rows
        np.repeat(rng.standard_normal(16), 16),                         # constant sub-blocks of 16
        np.repeat(rng.standard_normal(8), 32),                          # constant sub-blocks of 32
        np.where(np.arange(256) == 77, 2.5, 0.0),                       # one value
        rng.choice([-1.0, 1.0], 256),                                   # every magnitude tied
        rng.choice([-2.0, -1.0, 0.0, 1.0, 2.0], 256),                   # ties and zeros
        rng.uniform(0.5, 2.0, 256), -rng.uniform(0.5, 2.0, 256),        # one sign
        normal[0] * 1e20, normal[1] * 1e30,                             # squares overflow to infinity
        normal[2] * 1e-30, normal[3] * 1e-40,                           # tiny, subnormal
        rng.standard_normal(256) * 1e-15,                               # about the all-zero threshold
        rng.standard_normal(256) * 10.0 ** rng.uniform(-20, 20, 256),   # forty decades
        np.repeat(10.0 ** rng.uniform(-18, 18, 16), 16) * rng.standard_normal(256),   # decades by sub-block
        rng.standard_t(1, 256),                                         # heavy tails
        np.where(rng.uniform(size=256) < 0.9, 0.0, rng.standard_normal(256)),         # mostly zeros
        (rng.standard_normal(256) * 0.02).astype(np.float16).astype(np.float64),      # fp16 weights
    ]
    return np.stack(rows).astype(np.float32)


def _importances() -> dict[str, np.ndarray | None]:
    rng = np.random.default_rng(16)
    holes = rng.uniform(0.1, 3.0, 256)
    holes[::5] = 0.0
    holes[32:64] = 0.0
    spiky = rng.uniform(0.5, 1.5, 256)
    spiky[[3, 100, 200]] = 1e6
    choices = {"none": None, "uniform": rng.uniform(0, 2, 256), "decades": 10.0 ** rng.uniform(-4, 4, 256),
               "holes": holes, "zeros": np.zeros(256), "tiny": np.full(256, 1e-30), "huge": rng.uniform(0, 1, 256) * 1e30,
               "spiky": spiky}
    return {k: None if v is None else v.astype(np.float32) for k, v in choices.items()}


@pytest.fixture(scope="module")
def adversarial() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(17)
    scales = 10.0 ** rng.uniform(-6, 3, (48, 1))
    return _adversarial_rows(), (rng.standard_normal((48, 512)) * scales).astype(np.float32)


@pytest.mark.skipif("avx2" not in ISAS, reason="this CPU has no AVX2: the portable kernels are the only ones")
@pytest.mark.parametrize("type_name", TYPES)
def test_avx2_writes_the_portable_bytes(adversarial, type_name):
    rows, random = adversarial
    for label, importance in _importances().items():
        for name, x in (("adversarial", rows), ("random", random)):
            weights = None if importance is None else np.tile(importance, x.shape[1] // 256)
            fast, portable = _quantize(type_name, x, "avx2", weights), _quantize(type_name, x, "generic", weights)
            differing = np.flatnonzero((fast != portable).any(-1))
            assert differing.size == 0, f"{name} rows {differing.tolist()} (importance {label}) differ"


@pytest.mark.parametrize("type_name", ("iq4_nl", "iq4_xs"))
def test_types_without_avx2_quantizers_run_the_portable_ones(adversarial, type_name):
    rows, _ = adversarial
    assert np.array_equal(_quantize(type_name, rows, ISAS[0]), _quantize(type_name, rows, "generic"))


@pytest.mark.parametrize("isa", ISAS)
def test_float16_sources_are_widened_exactly_in_the_kernels(adversarial, isa):
    """kquantize(..., half=True) on float16 gives the bytes of the float32 it widens to; a block holding
    infinity is reported by its index, under both."""
    rows, random = adversarial
    halves = np.concatenate([np.clip(rows, -6e4, 6e4).astype(np.float16), random[:, :256].astype(np.float16),
                             np.array([[6e-8, -6e-8, 1e-5, -0.0, 65504.0, -65504.0, 0.0, 3e-6] * 32], np.float16)])
    for type_name in (*TYPES, "iq4_nl", "iq4_xs"):
        block, size = gguf_arrays.KERNEL_TYPES[type_name]
        out = np.empty(halves.size // block * size, dtype=np.uint8)
        for importance in (None, _importances()["decades"]):
            assert kernels.kquantize(type_name, halves.reshape(-1), out, importance, isa, True) == -1
            expected = _quantize(type_name, halves.astype(np.float32), isa, importance)
            assert np.array_equal(out.reshape(expected.shape), expected), (type_name, importance is None)
    broken = halves.copy()
    broken[3, 40] = np.inf
    out = np.empty(broken.size // 256 * 210, dtype=np.uint8)
    assert kernels.kquantize("q6_k", broken.reshape(-1), out, None, isa, True) == 3
