"""Legacy llama.cpp files (ggml, ggmf, ggjt v1-v3): read as a Hugging Face llama, converted to GGUF that llama.cpp loads.

The files are written by modelkit.testing.legacy_ggml from the format's definition. fixtures/ggml/judge.json holds
llama.cpp's verdict (llama-cpp-python 0.3.36) on the GGUF files converted from exactly these bytes: loaded, the
same tokens as the tokenizer.json modelkit derives, logits equal to transformers' on the legacy weights.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from gguf import GGUFReader

import modelkit
from modelkit.errors import UnsupportedConversionError
from modelkit.formats import detect_format
from modelkit.parse import ggml as legacy
from modelkit.scan import Severity, scan
from modelkit.testing.legacy_ggml import tiny_llama, vocabulary

TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
KV_HEADS = 2                       # as fixtures/ggml/make_judge.py
# llama.cpp's logits against transformers' on the same (dequantized) weights, measured 2026-11-25 by
# make_judge.py: F32 6.6e-07, F16 8.6e-04, Q4_0 2.0e-02, Q4_1 2.1e-02, Q8_0 2.5e-02 (logits up to 1.5).
LOGIT_BOUND = {"F32": 1e-5, "F16": 2e-3, "Q4_0": 5e-2, "Q4_1": 5e-2, "Q8_0": 5e-2}


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def judge(fixtures_dir):
    return json.loads((fixtures_dir / "ggml" / "judge.json").read_text())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """type -> (legacy file, its GGUF), made as make_judge.py makes them."""
    folder = tmp_path_factory.mktemp("ggml")
    out = {}
    for type_name in TYPES:
        source = tiny_llama(folder / f"tiny-{type_name}.bin", type_name, n_kv_head=KV_HEADS)
        target = folder / f"tiny-{type_name}.gguf"
        report = modelkit.convert(source, target)
        assert report.verify["passed"] and report.target["format"] == "gguf"
        out[type_name] = (source, target)
    return out


@pytest.mark.parametrize("type_name", TYPES)
def test_llama_cpp_loads_exactly_these_gguf_bytes(converted, judge, type_name):
    source, target = converted[type_name]
    verdict = judge["files"][type_name]
    assert _sha(source) == verdict["ggjt_sha256"]          # the legacy writer is deterministic
    assert _sha(target) == verdict["gguf_sha256"]          # ...and so is the conversion: the verdict is about these bytes
    assert verdict["llama_cpp_loaded"] and verdict["n_vocab"] == len(legacy.read(source.read_bytes()).tokens)
    assert verdict["llama_cpp_tokens"] == verdict["tokenizer_json_tokens"]
    assert verdict["max_abs_logit_diff_vs_transformers"] < LOGIT_BOUND[type_name]


@pytest.mark.parametrize("type_name", TYPES)
def test_gguf_tensors_are_the_legacy_bytes(converted, type_name):
    """Blocks are copied, and Q/K come back in llama.cpp's row order after the trip through Hugging Face's."""
    source, target = converted[type_name]
    raw = source.read_bytes()
    old = {t.name: raw[t.offset:t.offset + t.nbytes] for t in legacy.read(raw).tensors}
    new = {t.name: bytes(t.data.tobytes()) for t in GGUFReader(target).tensors}
    renames = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
               "layers.1.attention.wq.weight": "blk.1.attn_q.weight", "layers.0.attention.wk.weight": "blk.0.attn_k.weight",
               "layers.0.feed_forward.w2.weight": "blk.0.ffn_down.weight"}
    for ours, theirs in renames.items():
        assert new[theirs] == old[ours], theirs
    assert len(new) == len(old)


def test_read_as_a_hugging_face_llama(converted):
    ckpt = modelkit.load(converted["Q4_0"][0])
    config = ckpt.arch.config
    assert ckpt.arch.name == "llama" and config["num_key_value_heads"] == KV_HEADS
    assert config["intermediate_size"] == 64 and config["num_hidden_layers"] == 2 and config["vocab_size"] == len(vocabulary()[0])
    q = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.scheme == "q4_0" and q.shape == (32, 32)
    assert str(ckpt.tensors["model.norm.weight"].dtype) == "float32"
    tokens = json.loads(ckpt.assets["tokenizer.json"])["model"]["vocab"]
    assert tokens["<0x41>"] == 3 + 0x41 and "\u2581the" in tokens
    assert detect_format(converted["F32"][0]) == "ggml"


@pytest.mark.parametrize("kind, version", [("ggml", None), ("ggmf", 1), ("ggjt", 1), ("ggjt", 2)])
def test_older_float_files_convert(tmp_path, kind, version):
    source = tiny_llama(tmp_path / "old.bin", "F16", kind=kind, version=version, n_layer=1)
    report = modelkit.convert(source, tmp_path / "old.gguf")
    assert report.verify["passed"]
    assert modelkit.load(source).metadata["modelkit.ggml.source"].startswith(kind)


@pytest.mark.parametrize("kind, version, type_name", [("ggjt", 2, "Q4_0"), ("ggjt", 1, "Q8_0"), ("ggmf", 1, "Q4_1")])
def test_older_quantized_blocks_are_refused_with_the_reason(tmp_path, kind, version, type_name):
    source = tiny_llama(tmp_path / "old.bin", type_name, kind=kind, version=version, n_layer=1)
    with pytest.raises(UnsupportedConversionError, match="predate ggjt v3"):
        modelkit.convert(source, tmp_path / "old.gguf")
    assert not (tmp_path / "old.gguf").exists()


def test_scan_checks_the_records(converted, tmp_path):
    assert scan(converted["Q8_0"][0]).worst == Severity.SAFE
    cut = tmp_path / "cut.bin"
    cut.write_bytes(converted["Q8_0"][0].read_bytes()[:-7])
    flagged = [f for f in scan(cut).findings if f.severity > Severity.SAFE]
    assert [(f.severity, f.rule) for f in flagged] == [(Severity.DANGEROUS, "ggml.header.malformed")]
    assert "needs" in flagged[0].detail


def test_writing_ggml_is_refused(converted, tmp_path):
    with pytest.raises(UnsupportedConversionError, match="write GGUF"):
        modelkit.convert(converted["F32"][1], tmp_path / "x.ggml", to="ggml")
    assert list(tmp_path.iterdir()) == []


def test_dequantized_read_matches_gguf_dequantization(converted):
    from gguf import dequantize

    source, target = converted["Q4_1"]
    floats = modelkit.load(source, dequantize=True).tensors["model.layers.0.mlp.down_proj.weight"].load().numpy()
    tensor = next(t for t in GGUFReader(target).tensors if t.name == "blk.0.ffn_down.weight")
    assert np.array_equal(floats, dequantize(tensor.data, tensor.tensor_type).reshape(floats.shape))
