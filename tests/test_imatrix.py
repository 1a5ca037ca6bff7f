"""Importance matrices: llama.cpp's file forms, `modelkit imatrix`, and `modelkit quantize --imatrix`.

The file layout is judged by gguf-py's reader (llama.cpp's own Python package): what llama-imatrix writes
(general.type, imatrix.datasets / chunk_count / chunk_size, `<W>.in_sum2` (n, 1) and `<W>.counts` (1, 1)
in F32). The legacy .dat form is built byte by byte from imatrix.cpp's save_imatrix_legacy. Quantizing
under an entry gives the bytes of gguf_arrays.quantize_array(importance=...), which
tests/test_imatrix_quants.py holds to llama.cpp's own bytes; fixtures/llama_cpp/check_imatrix_interop.py
runs llama.cpp's llama_model_quantize on our file (outside `make test`).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader
from safetensors.numpy import save_file

from modelkit.cli.app import main
from modelkit.errors import ConfigError, FormatError
from modelkit.quantizers import gguf_arrays
from modelkit.quantizers.imatrix import read_importance, write_imatrix

TINY = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64}


def _legacy(entries: dict[str, tuple[int, np.ndarray]], chunks: int = 0, dataset: bytes = b"") -> bytes:
    """save_imatrix_legacy's bytes: i32 count | (i32 len, name, i32 ncall, i32 nval, f32 values)... | trailer."""
    out = struct.pack("<i", len(entries))
    for name, (ncall, values) in entries.items():
        out += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, values.size)
        out += values.astype("<f4").tobytes()
    return out + (struct.pack("<ii", chunks, len(dataset)) + dataset if chunks else b"")


def test_written_file_has_llama_imatrix_layout_and_reads_back(tmp_path):
    path = tmp_path / "imatrix.gguf"
    sums = np.array([[4.0, 0.0, 2.0, 8.0]], dtype=np.float32)
    write_imatrix(path, {"blk.0.ffn_down.weight": (sums, [4]), "blk.0.attn_q.weight": (np.ones(4), 0)},
                  datasets=["calib.txt"], chunk_count=2, chunk_size=2)
    reader = GGUFReader(str(path))
    fields = {f.name: f for f in reader.fields.values()}
    assert bytes(fields["general.type"].parts[-1]) == b"imatrix"
    assert "general.architecture" not in fields
    assert int(fields["imatrix.chunk_count"].parts[-1][0]) == 2 and int(fields["imatrix.chunk_size"].parts[-1][0]) == 2
    tensors = {t.name: t for t in reader.tensors}
    assert list(tensors) == ["blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts",      # sorted by name
                             "blk.0.ffn_down.weight.in_sum2", "blk.0.ffn_down.weight.counts"]
    assert list(tensors["blk.0.ffn_down.weight.in_sum2"].shape) == [4, 1]
    assert list(tensors["blk.0.ffn_down.weight.counts"].shape) == [1, 1]
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}
    importance = read_importance(path)
    assert importance.datasets == ("calib.txt",) and importance.chunk_count == 2 and not importance.legacy
    assert importance.for_weight("blk.0.ffn_down.weight", 4).tolist() == [1.0, 0.0, 0.5, 2.0]    # sums / count
    assert importance.for_weight("blk.0.attn_q.weight", 4).tolist() == [1.0] * 4                # no tokens: ones
    assert importance.for_weight("blk.1.ffn_down.weight", 4) is None                            # missing: none
    with pytest.raises(ConfigError, match="has 4 values but its rows have 8 weights"):
        importance.for_weight("blk.0.ffn_down.weight", 8)


def test_legacy_dat_form_and_refusals(tmp_path):
    dat = tmp_path / "imatrix.dat"
    dat.write_bytes(_legacy({"blk.0.attn_v.weight": (4, np.array([4.0, 8.0, 0.0, 2.0])),
                             "token_embd.weight": (1, np.ones(3))}, chunks=4, dataset=b"wiki.txt"))
    importance = read_importance(dat)
    assert importance.legacy and importance.datasets == ("wiki.txt",) and importance.chunk_count == 4
    assert importance.for_weight("blk.0.attn_v.weight", 4).tolist() == [1.0, 2.0, 0.0, 0.5]   # values / ncall
    assert importance.for_weight("token_embd.weight", 8) is None      # llama.cpp ignores the embeddings' mismatch
    bare = tmp_path / "bare.gguf"                                     # GGUF form without llama-imatrix's metadata
    from gguf import GGUFWriter

    writer = GGUFWriter(str(bare), "x")
    writer.add_tensor("w.in_sum2", np.ones((1, 4), np.float32))
    writer.add_tensor("w.counts", np.ones((1, 1), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="without imatrix.datasets"):
        read_importance(bare)
    (tmp_path / "junk.dat").write_bytes(b"\xff\xff\xff\x7fjunk")
    with pytest.raises(FormatError, match="junk.dat.*not an importance matrix"):
        read_importance(tmp_path / "junk.dat")
    with pytest.raises(FormatError, match="no such importance-matrix file"):
        read_importance(tmp_path / "missing.gguf")


@pytest.fixture(scope="module")
def tinylm_run(tmp_path_factory) -> dict[str, Path]:
    """A tiny untrained tinylm (ffn_down rows of 256: real K blocks), calibration text and its imatrix."""
    from modelkit.checkpoint import Checkpoint
    from modelkit.models import build
    from modelkit.pipeline.load import save

    folder = tmp_path_factory.mktemp("imatrix")
    model = save(Checkpoint.from_module(build("tinylm", TINY, seed=0)), folder / "tinylm.safetensors")
    text = folder / "calib.txt"
    text.write_text(Path(json.__file__).read_text(encoding="utf-8")[:1000], encoding="utf-8")
    out = folder / "imatrix.gguf"
    result = CliRunner().invoke(main, ["imatrix", str(model), "--data", str(text), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return {"model": model, "text": text, "imatrix": out, "report": json.loads(result.stdout)}


def test_cli_imatrix_collects_what_llama_imatrix_does(tinylm_run):
    report = tinylm_run["report"]
    assert report["schema"] == "modelkit.imatrix/1" and report["ok"]
    assert report["chunks"] == 1000 // 64 and report["chunk_size"] == 64 and report["tokens"] == 15 * 64
    kinds = ("attn_k", "attn_output", "attn_q", "attn_v", "ffn_down", "ffn_gate", "ffn_up")
    assert report["names"] == [f"blk.{i}.{k}.weight" for i in range(2) for k in kinds]   # no token_embd, no output
    tensors = {t.name: np.asarray(t.data) for t in GGUFReader(str(tinylm_run["imatrix"])).tensors}
    assert all(float(tensors[f"{name}.counts"][0, 0]) == 15 * 64 for name in report["names"])
    q, k, v = (tensors[f"blk.0.attn_{x}.weight.in_sum2"] for x in "qkv")            # one input, three weights
    assert np.array_equal(q, k) and np.array_equal(q, v) and (q > 0).all()
    assert tensors["blk.1.ffn_down.weight.in_sum2"].shape == (1, 256)


def test_cli_imatrix_refuses_existing_output_and_non_language_models(tinylm_run, tmp_path):
    args = ["imatrix", str(tinylm_run["model"]), "--data", str(tinylm_run["text"]), "--out", str(tinylm_run["imatrix"])]
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["type"] == "OutputExistsError"
    result = CliRunner().invoke(main, [*args[:-1], str(tmp_path / "x.gguf"), "--context", "2000"])
    assert result.exit_code == 2 and "--context 2000" in result.output


def test_quantize_with_imatrix_uses_each_weights_entry(tinylm_run, tmp_path):
    """The zoo model's module path: weights found by their GGUF names, quantized under their entries."""
    from safetensors.numpy import load_file

    out = tmp_path / "q.gguf"
    result = CliRunner().invoke(main, ["quantize", str(tinylm_run["model"]), str(out), "--scheme", "q4_k",
                                       "--imatrix", str(tinylm_run["imatrix"]), "--json"])
    assert result.exit_code == 0, result.output
    source = load_file(str(tinylm_run["model"]))
    importance = read_importance(tinylm_run["imatrix"])
    stored = {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in GGUFReader(str(out)).tensors}
    for gguf_name, hf_name, ggml_type in (("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight", "q4_k"),
                                          ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", "q5_0")):
        expected = gguf_arrays.quantize_array(source[hf_name], ggml_type,
                                              importance=importance.for_weight(gguf_name, source[hf_name].shape[1]))
        assert stored[gguf_name][0] == ggml_type.upper()
        assert np.array_equal(stored[gguf_name][1].reshape(expected.shape), expected), gguf_name
    plain = gguf_arrays.quantize_array(source["model.embed_tokens.weight"], "q5_0")          # no entry: plain
    assert np.array_equal(stored["token_embd.weight"][1].reshape(plain.shape), plain)


def test_quantize_weight_file_with_imatrix_and_wrong_schemes(tmp_path):
    rng = np.random.default_rng(0)
    weights = {"a.weight": rng.standard_normal((8, 512)).astype(np.float32),
               "b.weight": rng.standard_normal((4, 512)).astype(np.float32)}
    src, imatrix = tmp_path / "w.safetensors", tmp_path / "w.imatrix"
    save_file(weights, str(src))
    importance = rng.uniform(0, 3, 512).astype(np.float32)
    imatrix.write_bytes(_legacy({"a.weight": (1, importance)}, chunks=1, dataset=b"t"))
    for scheme in ("iq4_xs", "q5_1"):
        out = tmp_path / f"{scheme}.gguf"
        result = CliRunner().invoke(main, ["quantize", str(src), str(out), "--scheme", scheme, "--imatrix", str(imatrix)])
        assert result.exit_code == 0, result.output
        stored = {t.name: np.asarray(t.data) for t in GGUFReader(str(out)).tensors}
        for name, vector in (("a.weight", importance), ("b.weight", None)):
            expected = gguf_arrays.quantize_array(weights[name], scheme, importance=vector)
            assert np.array_equal(stored[name].reshape(expected.shape), expected), (scheme, name)
    result = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "x.safetensors"), "--scheme", "int8",
                                       "--imatrix", str(imatrix)])
    assert result.exit_code == 2 and "unknown option 'imatrix'" in result.output
