"""GGUF: llama.cpp conventions for tinylm, lossless round trips, quantized files from other tools,
and a reader that survives hostile headers. The shared round trips are in test_formats.py."""
from __future__ import annotations

import math
import struct
import time

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

import modelkit
from modelkit.checkpoint import ArchSpec, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import FormatError, UnsupportedConversionError
from modelkit.formats import load_format
from modelkit.models import _hf, build
from modelkit.models.tinylm import example_inputs
from modelkit.quantizers.fast_linear import use_isa

converter = load_format("gguf")     # modelkit.converters.gguf, for its private helpers and keys
TINYLM = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
LLAMA_KEYS = ["context_length", "embedding_length", "block_count", "feed_forward_length", "rope.dimension_count",
              "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
              "rope.freq_base", "vocab_size"]
# Tolerances for running the file outside PyTorch: float32 sums in another order.
# 2026-11-21: measured 4.53e-06 for llama.cpp (llama-cpp-python 0.3.36, F32 KV cache; logits up to 4.9).
# With llama.cpp's default F16 KV cache the difference was 7.1e-03, so the test asks for F32.
LLAMA_CPP_ATOL = 2e-5


@pytest.fixture
def tinylm():
    """A small tinylm with weights spread out (std ~0.2), so that a wrong RoPE layout shows in the logits."""
    model = build("tinylm", TINYLM, seed=0).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.2)
    return model


@pytest.fixture
def tinylm_file(tinylm, tmp_path):
    return modelkit.save(Checkpoint.from_module(tinylm), tmp_path / "tinylm.gguf")


def _fields(path):
    reader = GGUFReader(path)
    return reader, {k: f.contents() for k, f in reader.fields.items()}


# ------------------------------------------------------------------------------ round trips


def test_every_reference_model_round_trips_bit_exact(small_model, model_name, tmp_path):
    ckpt = Checkpoint.from_module(small_model, metadata={"note": "hello", "empty": "", "modelkit.x": "{}"})
    path = modelkit.save(ckpt, tmp_path / "m.gguf")
    back = modelkit.load(path)
    assert back.arch == ckpt.arch and back.metadata == ckpt.metadata
    original, loaded = ckpt.materialize(), back.materialize()
    assert list(loaded) == list(original)
    for name, tensor in original.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_rebuilt_tinylm_gives_identical_logits(tinylm, tinylm_file):
    rebuilt = modelkit.load_module(tinylm_file)
    modelkit.assert_same_outputs(tinylm, rebuilt, example_inputs(2, seq_len=24), atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tinylm_keeps_norms_f32_and_round_trips(tinylm, dtype, tmp_path):
    ckpt = Checkpoint.from_module(tinylm.to(dtype))
    path = modelkit.save(ckpt, tmp_path / "half.gguf")
    reader, fields = _fields(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["output_norm.weight"] == types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType[{torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]]
    file_type = {torch.float16: gguf.LlamaFileType.MOSTLY_F16, torch.bfloat16: gguf.LlamaFileType.MOSTLY_BF16}[dtype]
    assert fields["general.file_type"] == file_type
    loaded = modelkit.load(path).materialize()
    for name, tensor in ckpt.materialize().items():
        assert loaded[name].dtype == dtype and torch.equal(loaded[name], tensor), name


def test_odd_shapes_names_and_dtypes_round_trip(tmp_path):
    long_name = "encoder." + "very_deep_module." * 5 + "weight"                       # > 63 bytes
    state = {
        long_name: torch.randn(3, 2),
        "five_d": torch.randn(2, 1, 3, 2, 2),                                         # GGUF allows 4 dims
        "empty": torch.zeros(0, 4),
        "f64": torch.randn(3, dtype=torch.float64),
        "u16": torch.tensor([0, 65535], dtype=torch.uint16),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),
    }
    path = modelkit.save(Checkpoint.from_state_dict(state), tmp_path / "odd.gguf")
    reader = GGUFReader(path)
    assert all(len(t.name.encode()) <= 63 and len(t.shape) <= 4 for t in reader.tensors)
    loaded = modelkit.load(path).materialize()
    assert list(loaded) == list(state)
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_tied_weights_are_stored_once(tmp_path):
    shared = torch.randn(4, 3)
    ckpt = Checkpoint.from_state_dict({"embed": shared, "head": shared})
    path = modelkit.save(ckpt, tmp_path / "tied.gguf")
    assert [t.name for t in GGUFReader(path).tensors] == ["embed"]
    back = modelkit.load(path)
    assert back.tensors["head"] is back.tensors["embed"] and torch.equal(back.tensors["head"].load(), shared)


def test_write_streams_one_tensor_at_a_time(tmp_path):
    loads = []

    def lazy(name, tensor):
        def reader():
            loads.append(name)
            return tensor
        return LazyTensor(tensor.dtype, tuple(tensor.shape), reader)

    tensors = {f"t{i}": lazy(f"t{i}", torch.full((8,), float(i))) for i in range(5)}
    modelkit.save(Checkpoint(tensors), tmp_path / "s.gguf", format="gguf", verify=False)   # the writer alone
    assert loads == list(tensors)     # the header comes from the specs: each tensor is read once, in order


def test_read_is_lazy(tmp_path):
    path = modelkit.save(Checkpoint.from_state_dict({"w": torch.zeros(4)}), tmp_path / "lazy.gguf")
    ckpt = modelkit.load(path)
    offset = GGUFReader(path).tensors[0].data_offset
    with path.open("r+b") as f:                               # same size, same inode: the map sees it
        f.seek(offset)
        f.write(struct.pack("<4f", 1, 2, 3, 4))
    assert ckpt.tensors["w"].load().tolist() == [1, 2, 3, 4]


# ---------------------------------------------------------------------- llama.cpp conventions


def test_the_reference_reader_sees_llama_conventions(tinylm, tinylm_file):
    reader, fields = _fields(tinylm_file)
    config = tinylm.config
    assert fields["general.architecture"] == "llama" and fields["general.name"] == "tinylm"
    assert fields["general.file_type"] == int(gguf.LlamaFileType.ALL_F32)
    expected = [config.max_position_embeddings, config.hidden_size, config.num_hidden_layers,
                config.intermediate_size, config.head_dim, config.num_attention_heads,
                config.num_key_value_heads, pytest.approx(config.rms_norm_eps), config.rope_theta, 256]
    assert [fields[f"llama.{key}"] for key in LLAMA_KEYS] == expected
    hf = Checkpoint.from_module(tinylm).materialize()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)    # gguf-py's own table
    assert [t.name for t in reader.tensors] == [names.get_name(n, try_suffixes=(".weight",)) for n in hf]
    by_name = {t.name: t for t in reader.tensors}
    assert all(t.tensor_type == GGMLQuantizationType.F32 for t in reader.tensors)
    assert list(by_name["token_embd.weight"].shape) == [config.hidden_size, 256]        # GGML order
    assert by_name["token_embd.weight"].data.shape == (256, config.hidden_size)         # numpy order
    assert ArchSpec.from_json(fields["modelkit.arch"]) == Checkpoint.from_module(tinylm).arch


def test_keys_agree_with_gguf_constants(tinylm_file):
    """Every hyperparameter key written for tinylm is one gguf-py's constants name for the llama architecture."""
    k = gguf.Keys
    known = {v.replace("{arch}", "llama") for group in (k.LLM, k.Attention, k.Rope) for v in vars(group).values()
             if isinstance(v, str)}
    _, fields = _fields(tinylm_file)
    written = {key for key in fields if key.startswith("llama.")}
    assert written and written <= known
    assert converter._KEYS.ADD_SPACE_PREFIX == k.Tokenizer.ADD_PREFIX
    assert converter._KEYS.TOKEN_TYPE == k.Tokenizer.TOKEN_TYPE and converter._KEYS.BOS_ID == k.Tokenizer.BOS_ID


def test_byte_tokenizer(tinylm_file):
    _, fields = _fields(tinylm_file)
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert fields["tokenizer.ggml.model"] == "llama" and len(tokens) == len(set(tokens)) == 256
    assert (tokens[0x0A], types[0x0A]) == ("<0x0A>", gguf.TokenType.BYTE)
    assert (tokens[0xE9], types[0xE9]) == ("<0xE9>", gguf.TokenType.BYTE)
    assert (tokens[ord("A")], types[ord("A")]) == ("A", gguf.TokenType.NORMAL)
    assert (tokens[0x20], types[0x20]) == ("\u2581", gguf.TokenType.NORMAL)           # SentencePiece's space
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (2, 3)
    assert fields["tokenizer.ggml.add_bos_token"] is False and fields["tokenizer.ggml.add_space_prefix"] is False


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Q/K reordering, written independently: per head, (2, hd/2) -> (hd/2, 2)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, -1).swapaxes(1, 2).reshape(w.shape)


def test_the_permutation_is_applied_and_undone_exactly(tinylm, tinylm_file):
    reader = GGUFReader(tinylm_file)
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    hf = Checkpoint.from_module(tinylm).materialize()
    config = tinylm.config
    for n in range(config.num_hidden_layers):
        q = hf[f"model.layers.{n}.self_attn.q_proj.weight"].numpy()
        k = hf[f"model.layers.{n}.self_attn.k_proj.weight"].numpy()
        assert np.array_equal(stored[f"blk.{n}.attn_q.weight"], _permute(q, config.num_attention_heads))
        assert np.array_equal(stored[f"blk.{n}.attn_k.weight"], _permute(k, config.num_key_value_heads))
        assert not np.array_equal(stored[f"blk.{n}.attn_q.weight"], q)
    loaded = modelkit.load(tinylm_file).materialize()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in hf.items())


def _llama_cpp_forward(reader: GGUFReader, tokens: list[int], *, unpermute: bool = False) -> torch.Tensor:
    """llama.cpp's LLM_ARCH_LLAMA graph from the GGUF tensors alone: ggml's normal RoPE rotates
    adjacent pairs (x[2i], x[2i+1]) by pos * freq_base^(-2i/n_rot)."""
    f = {k: v.contents() for k, v in reader.fields.items()}
    w = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    n_head, n_kv, n_embd = f["llama.attention.head_count"], f["llama.attention.head_count_kv"], f["llama.embedding_length"]
    eps, base, hd = f["llama.attention.layer_norm_rms_epsilon"], f["llama.rope.freq_base"], n_embd // n_head
    T = len(tokens)
    theta = torch.arange(T, dtype=torch.float32)[:, None] * base ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]                              # (T, 1, hd/2)

    def rope(v):                                                                              # (T, heads, hd)
        even, odd = v[..., 0::2], v[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)

    def rms(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight

    def proj(name, n):
        weight = w[name]
        if unpermute:   # the negative control: Hugging Face's row order under llama.cpp's RoPE
            weight = _hf.from_llama_rope(weight, n)
        return weight

    x = w["token_embd.weight"][torch.tensor(tokens)]                                          # (T, C)
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(f["llama.block_count"]):
        h = rms(x, w[f"blk.{i}.attn_norm.weight"])
        q = rope((h @ proj(f"blk.{i}.attn_q.weight", n_head).T).view(T, n_head, hd))
        k = rope((h @ proj(f"blk.{i}.attn_k.weight", n_kv).T).view(T, n_kv, hd))
        v = (h @ w[f"blk.{i}.attn_v.weight"].T).view(T, n_kv, hd)
        k, v = (t.repeat_interleave(n_head // n_kv, dim=1) for t in (k, v))                    # (T, nh, hd)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask
        y = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, n_embd)
        x = x + y @ w[f"blk.{i}.attn_output.weight"].T
        h = rms(x, w[f"blk.{i}.ffn_norm.weight"])
        x = x + (F.silu(h @ w[f"blk.{i}.ffn_gate.weight"].T) * (h @ w[f"blk.{i}.ffn_up.weight"].T)) @ w[f"blk.{i}.ffn_down.weight"].T
    return rms(x, w["output_norm.weight"]) @ w["output.weight"].T                           # (T, vocab)


def test_llama_cpp_conventions_reproduce_pytorch_logits(tinylm, tinylm_file):
    tokens = list(b"def f(x):\n    return x + 1  # caf\xc3\xa9")
    with torch.no_grad():
        expected = tinylm(torch.tensor([tokens]))[0]
    reader = GGUFReader(tinylm_file)
    # 2026-11-21: measured 3.76e-06 (float32 sums in another order; logits up to 4.9). The control,
    # Hugging Face's row order under llama.cpp's RoPE, was off by 6.3.
    assert (_llama_cpp_forward(reader, tokens) - expected).abs().max() < 2e-5
    assert (_llama_cpp_forward(reader, tokens, unpermute=True) - expected).abs().max() > 1.0


def test_llama_cpp_runs_the_file_with_pytorch_logits(tinylm, tinylm_file, llama_cpp_golden):
    """llama.cpp's logits on exactly these bytes (recorded by fixtures/llama_cpp/make_golden.py, and run
    live where llama-cpp-python is installed) agree with PyTorch's; its tokenizer sees one token per byte."""
    golden = llama_cpp_golden["tinylm-f32"]
    golden.check_bytes(tinylm_file)
    with torch.no_grad():
        expected = tinylm(torch.tensor([golden.prompt]))[0]
    assert golden.prompt == list(b"def f(x):\n    return x + 1  # caf\xc3\xa9")
    assert (torch.from_numpy(golden.logits) - expected).abs().max() < LLAMA_CPP_ATOL
    assert golden.tokenize_tokens == list(golden.tokenize_text)                        # one token per byte
    assert golden.detokenized == bytes(range(256))
    live = golden.run_live(tinylm_file)
    if live is not None:
        assert (torch.from_numpy(live) - expected).abs().max() < LLAMA_CPP_ATOL


# ------------------------------------------------------------------ files from other tools


def _quantized_file(path, arch="test"):
    writer = GGUFWriter(path, arch)
    rng = np.random.default_rng(0)
    data = {"q8": rng.standard_normal((4, 64), dtype=np.float32), "q4": rng.standard_normal((2, 32), dtype=np.float32)}
    writer.add_tensor("q8", quantize(data["q8"], GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("q4", quantize(data["q4"], GGMLQuantizationType.Q4_0), raw_dtype=GGMLQuantizationType.Q4_0)
    writer.add_tensor("f16", np.arange(6, dtype=np.float16).reshape(2, 3))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return data


def test_reads_block_quantized_files(tmp_path):
    path = tmp_path / "q.gguf"
    data = _quantized_file(path)
    ckpt = modelkit.load(path)
    q8 = ckpt.tensors["q8"]
    assert isinstance(q8, QuantizedTensor) and q8.layout == "gguf" and q8.params == {"ggml_type": "Q8_0"}
    assert q8.shape == (4, 64) and q8.bits_per_weight == 8.5
    for name, qtype in (("q8", GGMLQuantizationType.Q8_0), ("q4", GGMLQuantizationType.Q4_0)):
        expected = torch.from_numpy(dequantize(quantize(data[name], qtype), qtype))
        assert torch.equal(ckpt.tensors[name].load(), expected)
        assert (expected - torch.from_numpy(data[name])).abs().max() < 0.3        # it is the same tensor
    assert ckpt.tensors["f16"].dtype == torch.float16 and ckpt.metadata["general.architecture"] == "test"
    floats = modelkit.load(path, dequantize=True)
    assert isinstance(floats.tensors["q4"], LazyTensor) and floats.tensors["q4"].dtype == torch.float32
    assert torch.equal(floats.tensors["q4"].load(), ckpt.tensors["q4"].load())


def test_quantized_tensors_are_copied_natively(tmp_path):
    _quantized_file(tmp_path / "q.gguf")
    out = modelkit.save(modelkit.load(tmp_path / "q.gguf"), tmp_path / "copy.gguf")
    before, after = GGUFReader(tmp_path / "q.gguf").tensors, GGUFReader(out).tensors
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in before] == [(t.name, t.tensor_type, t.data.tobytes()) for t in after]


def test_reads_a_quantized_llama_file_from_another_tool(tinylm, tinylm_file, tmp_path):
    """Like llama-quantize's output: llama keys and names, permuted Q/K in Q8_0, no modelkit keys."""
    source = GGUFReader(tinylm_file)
    path = tmp_path / "q8.gguf"
    writer = GGUFWriter(path, "llama")
    for key, field in source.fields.items():
        if key.startswith(("llama.", "tokenizer.")):
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in source.tensors:
        array = np.array(t.data)
        if array.ndim == 2:
            writer.add_tensor(t.name, quantize(array, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, array)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    ckpt = modelkit.load(path)
    assert ckpt.arch == Checkpoint.from_module(tinylm).arch                    # the config is rebuilt from llama.*
    assert ckpt.metadata["general.architecture"] == "llama"
    q_name = "model.layers.1.self_attn.q_proj.weight"
    assert isinstance(ckpt.tensors[q_name], QuantizedTensor)
    original = Checkpoint.from_module(tinylm).materialize()
    q8 = GGMLQuantizationType.Q8_0
    # Q8_0 blocks run along rows, so quantizing commutes with the row permutation: exact equality
    assert torch.equal(ckpt.tensors[q_name].load(), torch.from_numpy(dequantize(quantize(original[q_name].numpy(), q8), q8)))
    # the model rebuilt from the file is tinylm with Q8_0-rounded matrices, exactly
    rounded = {name: torch.from_numpy(dequantize(quantize(t.numpy(), q8), q8)) if t.ndim == 2 else t
               for name, t in original.items()}
    expected = build("tinylm", TINYLM).eval()
    expected.load_state_dict(rounded)
    with use_isa(None):     # the reference path (dequantize, float product); tests/test_fast_linear.py checks the kernels
        modelkit.assert_same_outputs(expected, modelkit.load_module(path), example_inputs(2, seq_len=16), atol=0)


# ------------------------------------------------------------------------------ refusals


def test_write_refuses_what_gguf_cannot_hold_before_writing(tmp_path):
    bad = [Checkpoint.from_state_dict({"ok": torch.zeros(2), "c": torch.zeros(2, dtype=torch.complex64)}),
           Checkpoint({"w": QuantizedTensor("int8", "affine", (2, 2), torch.float32,
                                            {"qdata": LazyTensor.of(torch.zeros(2, 2, dtype=torch.int8)),
                                             "scale": LazyTensor.of(torch.ones(1, 1))})})]
    for ckpt in bad:
        with pytest.raises(UnsupportedConversionError):
            modelkit.save(ckpt, tmp_path / "bad.gguf")
        assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------- hostile input


def _header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _key(name: str, vtype: int) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", vtype)


def _info(dims: list[int], ggml_type: int, offset: int = 0) -> bytes:
    """One tensor info named "w": n_dims, dims (GGML order), type, data offset."""
    return struct.pack("<Q", 1) + b"w" + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


F32 = int(GGMLQuantizationType.F32)


@pytest.mark.parametrize("blob, reason", [
    (_header(10**12, 0) + bytes(64), "more than the file holds"),
    (_header(0, 10**12) + bytes(64), "more than the file holds"),
    (_header(0, 1) + _key("k", GGUFValueType.STRING) + struct.pack("<Q", 2**60) + b"abc", "only 3 remain"),
    # gguf's reader loops without end on this one (an array count past the end of the file)
    (_header(0, 1) + _key("k", GGUFValueType.ARRAY) + struct.pack("<IQ", GGUFValueType.UINT8, 2**60) + b"abc",
     "more than the file can hold"),
    (_header(0, 1) + _key("k", GGUFValueType.ARRAY) + struct.pack("<IQ", GGUFValueType.STRING, 2**40) + b"abc",
     "more than the file can hold"),
    (_header(0, 1) + _key("k", 99) + bytes(8), "unknown metadata value type"),
    (_header(1, 0) + _info([4], F32) + bytes(16), "past the end"),                     # data cut short
    (_header(1, 0) + _info([4], F32, offset=3) + bytes(64), "misaligned"),
    (_header(1, 0) + _info([4], 77) + bytes(64), "unknown tensor type"),
    (_header(1, 0) + _info([2**62], F32) + bytes(64), "past the end"),
    (_header(1, 0) + _info([2**32, 2**32, 2**32, 2**32], F32) + bytes(64), "past the end"),
    (_header(1, 0) + _info([33], int(GGMLQuantizationType.Q4_0)) + bytes(64), "whole blocks"),
    (_header(1, 0) + struct.pack("<Q", 1) + b"w" + struct.pack("<I", 9) + bytes(64), "dimensions"),
    (b"GGUF" + struct.pack("<I", 1) + bytes(20), "version 1"),
    (b"GGUF\x03\x00", "24-byte header"),
])
def test_hostile_headers_are_format_errors(tmp_path, blob, reason):
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    start = time.monotonic()
    with pytest.raises(FormatError, match=reason) as info:
        modelkit.load(path, format="gguf")
    assert time.monotonic() - start < 2 and str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> dict[str, bytes]:
    """Small valid files: a generic one with every kind of entry (float, integer and bool tensors, a
    0-d bf16, records, metadata, an ArchSpec) and a llama one (tokenizer arrays, permuted Q/K)."""
    folder = tmp_path_factory.mktemp("samples")
    state = {"w": torch.arange(12.0).reshape(3, 4), "i": torch.arange(5), "b": torch.tensor([True, False]),
             "s": torch.tensor(2.5, dtype=torch.bfloat16)}
    generic = Checkpoint.from_state_dict(state, arch=ArchSpec("mlp", {}), metadata={"k": "v"})
    tiny = build("tinylm", {"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                            "num_key_value_heads": 1, "max_position_embeddings": 8}, seed=0)
    return {"generic": modelkit.save(generic, folder / "g.gguf").read_bytes(),
            "llama": modelkit.save(Checkpoint.from_module(tiny), folder / "l.gguf").read_bytes()}


@pytest.fixture(scope="module")
def sample(samples) -> bytes:
    return samples["generic"]


def test_detect_reads_the_header_only(tmp_path, sample):
    path = tmp_path / "model.bin"
    path.write_bytes(sample[:24])
    assert converter.detect(path)                        # the data need not be there yet
    path.write_bytes(sample[:23])
    assert not converter.detect(path)
    assert not converter.detect(tmp_path)
