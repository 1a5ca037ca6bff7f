"""The Checkpoint, its lazy tensors, quantized tensors and the ArchSpec."""
from __future__ import annotations

import pytest
import torch

from modelkit.checkpoint import ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import ConfigError, FormatError
from modelkit.models import build


def test_lazy_tensor_reads_only_when_loaded():
    calls = []

    def reader():
        calls.append(1)
        return torch.ones(2, 3)

    lazy = LazyTensor(torch.float32, (2, 3), reader)
    assert (lazy.numel, lazy.nbytes) == (6, 24)
    assert calls == []
    assert torch.equal(lazy.load(), torch.ones(2, 3))
    assert calls == [1]


def test_lazy_tensor_rejects_data_that_disagrees_with_header():
    lazy = LazyTensor(torch.float32, (2, 2), lambda: torch.ones(4), source="m.safetensors:w")
    with pytest.raises(FormatError, match=r"header says float32 \[2, 2\]"):
        lazy.load()


def test_from_module_fills_in_arch_and_all_parameters():
    model = build("cnn", {"channels": [4, 8], "hidden": 16}, seed=0)
    ckpt = Checkpoint.from_module(model)
    assert ckpt.arch == ArchSpec("cnn", {"channels": [4, 8], "hidden": 16, "num_classes": 10})
    assert ckpt.num_parameters == sum(p.numel() for p in model.parameters())
    assert ckpt.nbytes == 4 * ckpt.num_parameters
    state = ckpt.materialize()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_metadata_must_be_str_to_str():
    with pytest.raises(ConfigError, match="str to str"):
        Checkpoint({}, {"epochs": 3})


def test_arch_spec_json_round_trip():
    spec = ArchSpec("tinylm", {"hidden_size": 64, "num_hidden_layers": 2})
    assert ArchSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("text, message", [
    ('{"name": "os.system", "config": {}}', "not a registered model"),
    ("not json", "not valid JSON"),
    ('["cnn"]', "must look like"),
    ('{"name": "cnn", "config": []}', "must look like"),
])
def test_arch_spec_from_file_refuses_anything_but_registered_models(text, message):
    with pytest.raises(FormatError, match=message):
        ArchSpec.from_json(text, source="evil.safetensors")


def test_arch_spec_config_must_be_json_values():
    with pytest.raises(ConfigError):
        ArchSpec("mlp", {"hidden": object()})


def _quantize_affine(w: torch.Tensor, bits: int, group: int, symmetric: bool):
    """A reference quantizer for the test: per-row groups, round to nearest."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = g.abs().amax(-1) / qmax
        q = torch.clamp(torch.round(g / scale[..., None]), -qmax - 1, qmax)
        zero = None
    else:
        qmax = 2 ** bits - 1
        low, high = g.amin(-1), g.amax(-1)
        scale = (high - low) / qmax
        zero = torch.round(-low / scale)
        q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, qmax)
    return q.reshape(rows, cols).to(torch.int16), scale, zero


@pytest.mark.parametrize("bits, group, symmetric", [(8, 16, True), (8, 8, False), (4, 8, True), (4, 4, False)])
def test_quantized_tensor_dequantizes_the_affine_layout(bits, group, symmetric):
    w = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    q, scale, zero = _quantize_affine(w, bits, group, symmetric)
    if bits == 8:
        qdata = q.to(torch.int8) if symmetric else q.to(torch.uint8)
    else:
        nibbles = (q & 0xF).to(torch.uint8).reshape(6, 8, 2)
        qdata = nibbles[..., 0] | (nibbles[..., 1] << 4)                 # low nibble first
    parts = {"qdata": LazyTensor.of(qdata), "scale": LazyTensor.of(scale)}
    if zero is not None:
        parts["zero_point"] = LazyTensor.of(zero)
    qt = QuantizedTensor(f"int{bits}", "affine", (6, 16), torch.float32, parts,
                         {"bits": bits, "group_size": group, "symmetric": symmetric})
    expected = ((q.float() - (0 if zero is None else zero.repeat_interleave(group, -1))) *
                scale.repeat_interleave(group, -1))
    assert torch.allclose(qt.load(), expected)
    assert (qt.load() - w).abs().max() <= scale.max() * (0.5 + 1e-4) + 1e-6
    assert qt.nbytes == sum(p.nbytes for p in parts.values())
    assert qt.bits_per_weight < 32


def test_quantized_tensor_with_unknown_layout_is_a_format_error():
    qt = QuantizedTensor("x", "nope", (2,), torch.float32, {"qdata": LazyTensor.of(torch.zeros(2, dtype=torch.int8))})
    with pytest.raises(FormatError, match="unknown quantized layout 'nope'"):
        qt.load()


def test_one_rebuilder_for_float_and_quantized_checkpoints():
    """checkpoint.instantiate rebuilds quantized layers holding the stored parts, or (dequantize=True,
    what graph exporters trace) the float model with the dequantized values."""
    from modelkit.checkpoint import instantiate
    from modelkit.pipeline.quantize import quantize_module
    from modelkit.quantizers.int8 import Int8Config

    model = build("mlp", seed=0).eval()
    quantized = quantize_module(model, Int8Config()).eval()
    ckpt = Checkpoint.from_module(quantized)
    x = torch.randn(5, 2, generator=torch.Generator().manual_seed(0))
    rebuilt = instantiate(ckpt)
    assert type(rebuilt.net[0]) is type(quantized.net[0]) and torch.equal(rebuilt(x), quantized(x))
    floats = instantiate(ckpt, dequantize=True)
    assert isinstance(floats.net[0], torch.nn.Linear)
    assert torch.equal(floats.net[0].weight, ckpt.tensors["net.0.weight"].load())
    assert torch.equal(instantiate(Checkpoint.from_module(model))(x), model(x))


def test_each_quantized_layout_has_one_dequantizer():
    """The layout table is the only registration: no converter or quantizer registers one on import."""
    from pathlib import Path

    import modelkit.converters.gguf  # noqa: F401  (reading GGUF files used to register a second "gguf")
    from modelkit.quantizers import gguf_blocks
    from modelkit.storage.tensors import dequantizer

    assert dequantizer("gguf") is gguf_blocks.dequantize_layout
    root = Path(__file__).resolve().parents[1]
    registering = [p.name for folder in ("converters", "quantizers") for p in (root / folder).glob("*.py")
                   if "DEQUANTIZERS" in p.read_text()]
    assert registering == []
