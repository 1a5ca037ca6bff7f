"""`modelkit quantize FOLDER OUT` for Hugging Face folders: a compressed-tensors folder that transformers
loads (judged by `AutoModelForCausalLM.from_pretrained` with the compressed-tensors package) with modelkit's
logits, read back by modelkit to the same quantized tensors; the same quantized model as ONNX, judged by
onnxruntime; and `--kv-cache` ONNX export from a folder.

Tiny random-weight Llama and Qwen2 (tied embeddings) built with transformers' own classes, with the
tokenizer files of fixtures/llama_cpp/hf/ copied in (gptq calibrates on text they tokenize).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from compressed_tensors.quantization import QuantizationConfig
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

import modelkit
from modelkit.checkpoint import QuantizedTensor, instantiate
from modelkit.cli import main
from modelkit.errors import ConfigError, UnsupportedConversionError
from modelkit.models import hf_families
from modelkit.pipeline.convert import convert
from modelkit.pipeline.quantize import quantize
from modelkit.quantizers.fast_linear import use_isa
from modelkit.quantizers.gptq import GPTQConfig
from modelkit.quantizers.int4 import Int4Config


@pytest.fixture(autouse=True)
def _reference_path():
    """transformers and onnxruntime dequantize the weights they load: our quantized layers run their reference
    path here (dequantize, float product), not the packed-weight kernels (tests/test_fast_linear.py)."""
    with use_isa(None):
        yield

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "llama_cpp" / "hf"
COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": (lambda: LlamaConfig(**COMMON), "llama3"),
    "qwen2": (lambda: Qwen2Config(**COMMON, tie_word_embeddings=True), "qwen2"),
}
IDS = torch.randint(0, 505, (2, 12), generator=torch.Generator().manual_seed(1))
GPTQ = GPTQConfig(calibration_samples=8, batch_size=4)          # a few windows: the layout and the path are the point
# (family, case) -> scheme and options for `quantize`; "asym" cases load with dequantize=True (below).
CASES = {
    ("llama", "int4-g32"): dict(scheme="int4", group_size=32),
    ("llama", "int4-g64"): dict(scheme="int4", group_size=64),
    ("llama", "int4-g128"): dict(scheme="int4", group_size=128),
    ("llama", "int4-g32-asym"): dict(scheme=Int4Config(group_size=32, symmetric=False)),
    ("llama", "int8"): dict(scheme="int8"),
    ("llama", "int8-dynamic"): dict(scheme="int8-dynamic"),
    ("llama", "gptq"): dict(scheme=GPTQ),
    ("qwen2", "int4-g32"): dict(scheme="int4", group_size=32),
    ("qwen2", "int8"): dict(scheme="int8"),
    ("qwen2", "gptq"): dict(scheme=GPTQ),
}
# transformers 5.23 + compressed-tensors 0.20 cannot load packed asymmetric zero points compressed (see
# tests/test_compressed_tensors.py, test_transformers_default_load_fails_on): only with dequantize=True.
DEQUANTIZE_ON_LOAD = {"int4-g32-asym"}
# max |transformers' logits - modelkit's quantized model's| (logits up to 1.1-1.4), measured 2026-11-25, CPU
# float32: weight-only compressed loads 0.0 in every case (the same float32 weights, the same matmuls), pinned
# at 1e-6; int4-g32-asym with dequantize=True 3.2e-4 (compressed-tensors dequantizes in the float16 scale's
# dtype), pinned at 1e-3; int8-dynamic 1.35e-2 (compressed-tensors rounds activations with max|x| / 127.5, ours
# with max|x| / 127: the scheme's own size of error, 1.5e-2 from the float logits), pinned at 3e-2.
# For scale, quantized vs float logits: int4 g32/g64/g128 0.14/0.20/0.27, gptq 0.17-0.18, int8 0.010-0.011.
LOGITS_ATOL = {"int4-g32-asym": 1e-3, "int8-dynamic": 3e-2}
DEFAULT_ATOL = 1e-6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread while these tiny models run: on the 2-core CI machine two threads spend more time
    synchronising than computing (this file: 37 s with two, 18 s with one, measured 2026-11-25)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hfq")
    out = {}
    for family, (make, tokenizer) in FAMILIES.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make()).eval()
        model.save_pretrained(root / family)
        for f in (FIXTURES / tokenizer).iterdir():
            shutil.copy(f, root / family / f.name)
        out[family] = root / family
    return out


@pytest.fixture(scope="module")
def float_logits(folders) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {family: AutoModelForCausalLM.from_pretrained(folder).eval()(IDS).logits for family, folder in folders.items()}


@pytest.fixture(scope="module")
def quantized(folders, tmp_path_factory) -> dict[tuple[str, str], tuple[Path, object]]:
    root = tmp_path_factory.mktemp("hfq-out")
    out = {}
    for (family, case), options in CASES.items():
        target = root / f"{family}-{case}"          # no suffix, from a folder: a folder (--to hf not needed)
        out[family, case] = target, quantize(folders[family], target, **options)
    return out


@pytest.mark.parametrize("family, case", CASES)
def test_transformers_loads_the_folder_with_our_logits(quantized, float_logits, family, case, from_pretrained):
    folder, report = quantized[family, case]
    assert report.target["format"] == "hf" and report.verify["rebuilt_outputs"] == "identical"
    loaded, info, noisy = from_pretrained(folder, dequantize=case in DEQUANTIZE_ON_LOAD)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert noisy == []
    ours = instantiate(modelkit.load(folder))
    with torch.no_grad():
        theirs, mine = loaded(IDS).logits, ours(IDS).logits
    assert (theirs - mine).abs().max().item() <= LOGITS_ATOL.get(case, DEFAULT_ATOL)
    assert not torch.equal(theirs, float_logits[family])             # really quantized


@pytest.mark.parametrize("family, case", CASES)
def test_the_folder_holds_config_assets_and_float_embeddings(quantized, folders, family, case):
    folder, _ = quantized[family, case]
    config = json.loads((folder / "config.json").read_text())
    parsed = QuantizationConfig.model_validate(config["quantization_config"])
    assert parsed.quant_method == "compressed-tensors" and parsed.quantization_status == "compressed"
    assert parsed.ignore == ["lm_head", "model.embed_tokens"]        # the family's float modules
    ckpt = modelkit.load(folder)
    targets = {t for g in parsed.config_groups.values() for t in g.targets}
    assert targets == {n.removesuffix(".weight") for n, t in ckpt.tensors.items() if isinstance(t, QuantizedTensor)}
    assert "quantization_config" not in ckpt.arch.config             # storage, not architecture
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (folder / name).read_bytes() == (folders[family] / name).read_bytes()
    bits = {g.weights.num_bits for g in parsed.config_groups.values()}
    assert bits == ({4} if case.startswith("int4") or case == "gptq" else {8})


@pytest.mark.parametrize("family", FAMILIES)
def test_reading_back_gives_the_tensors_quantize_module_makes(quantized, folders, family):
    """int4 g32 is deterministic: the folder read back holds exactly what quantizing the float model
    in memory gives (the family's float modules skipped), part for part."""
    from modelkit.checkpoint import Checkpoint
    from modelkit.pipeline.quantize import quantize_module

    model = modelkit.load_module(folders[family])
    expected = Checkpoint.from_module(quantize_module(model, Int4Config(group_size=32,
                                                                        skip=("model.embed_tokens", "lm_head"))))
    back = modelkit.load(quantized[family, "int4-g32"][0])
    assert set(back.tensors) == set(expected.tensors)
    for name, entry in expected.tensors.items():
        got = back.tensors[name]
        assert isinstance(got, QuantizedTensor) == isinstance(entry, QuantizedTensor), name
        parts = entry.parts if isinstance(entry, QuantizedTensor) else {"": entry}
        stored = got.parts if isinstance(got, QuantizedTensor) else {"": got}
        assert all(np.array_equal(parts[p].array(), stored[p].array()) for p in parts), name


@pytest.mark.parametrize("family, case", [("llama", "int4-g32"), ("qwen2", "gptq")])
def test_reading_back_gives_the_same_quantized_tensors(quantized, family, case, tmp_path):
    """Our folder read back, written again as safetensors, read again: the same stored parts bit for bit;
    `inspect` names the scheme of each quantized weight."""
    folder, _ = quantized[family, case]
    ckpt = modelkit.load(folder)
    modelkit.save(ckpt, tmp_path / "again.safetensors")
    again = modelkit.load(tmp_path / "again.safetensors")
    quantized_names = [n for n, t in ckpt.tensors.items() if isinstance(t, QuantizedTensor)]
    assert len(quantized_names) == 14
    for name in quantized_names:
        a, b = ckpt.tensors[name], again.tensors[name]
        assert dict(a.params) == dict(b.params)
        assert all(np.array_equal(a.parts[p].array(), b.parts[p].array()) for p in a.parts)
    inspection = modelkit.inspect(folder)
    scheme = "gptq" if case == "gptq" else "int4"
    assert {t.quantized for t in inspection.tensors if t.name in quantized_names} == {scheme}
    assert inspection.model["family"] == family and inspection.model["tokenizer"]["chat_template"]


def test_the_cli_writes_a_folder_with_to_hf(folders, tmp_path):
    result = CliRunner().invoke(main, ["quantize", str(folders["llama"]), str(tmp_path / "q.v1"), "--to", "hf",
                                       "--scheme", "int8", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["reports"][0]
    assert report["target"]["format"] == "hf" and (tmp_path / "q.v1" / "config.json").is_file()


def test_several_schemes_make_a_folder_each(folders, tmp_path):
    result = CliRunner().invoke(main, ["quantize", str(folders["qwen2"]), str(tmp_path / "all"), "--to", "hf",
                                       "--scheme", "int8,int4", "--json"])
    assert result.exit_code == 0, result.output
    assert [r["target"]["format"] for r in json.loads(result.stdout)["reports"]] == ["hf", "hf"]
    assert all((tmp_path / "all" / s / "config.json").is_file() for s in ("int8", "int4"))


def test_eval_measures_bits_per_byte_before_and_after_with_the_folders_tokenizer(folders, tmp_path):
    report = quantize(folders["llama"], tmp_path / "q", scheme="int8", evaluate=True, latency=False)
    metric = report.metric
    assert metric["name"] == "bits_per_byte" and 0 < metric["float"] < 20 and 0 < metric["quantized"] < 20
    assert abs(metric["relative"]) < 0.05 and metric["higher_is_better"] is False      # int8: a small change
    assert any("tokens of the held-out text" in note for note in report.notes)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folders["llama"] / name, bare / name)
    with pytest.raises(ConfigError, match="carries no tokenizer.json"):
        quantize(bare, tmp_path / "never", scheme="int8", evaluate=True)
    assert not (tmp_path / "never").exists()                  # refused before anything is written


def test_a_quantized_folder_of_another_method_is_refused(folders, tmp_path):
    """compressed-tensors folders of other tools are read (tests/test_ct_folders.py); AWQ, GPTQ (auto-gptq),
    bitsandbytes ... folders are refused in one line naming the method."""
    from modelkit.errors import FormatError

    other = tmp_path / "other"
    shutil.copytree(folders["llama"], other)
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "format": "gemm"}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match="quant_method 'awq', format 'gemm'.*reads quant_method 'compressed-tensors'"):
        modelkit.load(other)


def test_large_folders_are_sharded(folders, tmp_path, monkeypatch):
    from modelkit.converters import hf

    monkeypatch.setattr(hf, "DEFAULT_SHARD_SIZE", 100_000)
    quantize(folders["llama"], tmp_path / "sharded", scheme="int4")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(IDS).logits, instantiate(modelkit.load(tmp_path / "sharded"))(IDS).logits)


def test_gptq_without_a_tokenizer_is_refused(folders, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folders["llama"] / name, bare / name)
    with pytest.raises(ConfigError, match="tokenizer.json"):
        quantize(bare, tmp_path / "out", scheme=GPTQ)


def test_gguf_blocks_have_no_folder_form(folders, tmp_path):
    with pytest.raises(UnsupportedConversionError, match="GGUF blocks go to"):
        quantize(folders["llama"], tmp_path / "out", scheme="q8_0", format="hf")


def test_every_family_keeps_its_embeddings_and_head_in_float():
    """Each family's float_modules name transformers' own input embeddings and output head."""
    from transformers import AutoConfig

    for name, family in hf_families().items():
        config = AutoConfig.for_model(family.model_types[0], **{"vocab_size": 64, "hidden_size": 32,
                                      "num_hidden_layers": 1, "num_attention_heads": 2, "n_embd": 32, "n_layer": 1,
                                      "n_head": 2, "intermediate_size": 64, "head_dim": 16, "pad_token_id": 0})
        config = getattr(config, "text_config", config) if family.text_config else config
        model = AutoModelForCausalLM.from_config(config)
        names = {m: n for n, m in model.named_modules()}
        wanted = {names[model.get_input_embeddings()], names[model.get_output_embeddings()]}
        assert wanted <= set(family.float_modules), name


# ------------------------------------------------------------------------------------------ ONNX


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_folder_to_onnx_runs_in_onnxruntime(folders, tmp_path, scheme):
    """The QDQ graph in onnxruntime against modelkit's quantized torch model (the file's weights read back).

    onnxruntime's default session fuses DequantizeLinear -> MatMul into MatMulNBits, which rounds the
    activations to int8 (accuracy level 4); at level 1 it computes in float32, as the graph says
    (converters/onnx.py `runnable`, docs/formats/onnx.md)."""
    import onnxruntime as ort

    from modelkit.converters.onnx import QDQ_ACCURACY_LEVEL
    from modelkit.testing import causal_lm

    path = tmp_path / f"{scheme}.onnx"
    report = quantize(folders["llama"], path, scheme=scheme)
    assert report.verify["runtime"]["passed"] and report.verify["rebuilt_outputs"] == "identical"
    ckpt = modelkit.load(path)
    assert sum(isinstance(t, QuantizedTensor) for t in ckpt.tensors.values()) == 14      # embeddings, head: float
    ours = instantiate(ckpt)
    ids, mask, positions = causal_lm.token_batch(512, 3, 10, seed=4)
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "position_ids": positions.numpy()}
    with torch.no_grad():
        want = ours(input_ids=ids, attention_mask=mask, position_ids=positions).logits[mask.bool()].numpy()
    keep = mask.bool().numpy()
    errors = {}
    for level in ("1", None):
        options = ort.SessionOptions()
        if level is not None:
            options.add_session_config_entry(QDQ_ACCURACY_LEVEL, level)
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        errors[level] = float(np.abs(session.run(["logits"], feed)[0][keep] - want).max())
    # measured 2026-11-25 (onnxruntime 1.31.1; logits up to 1.1): level 1 1.9e-7 (int8) / 2.4e-7 (int4),
    # summation order only; the default session 4.5e-3 / 5.0e-3 (int8 activations), pinned at 2e-2.
    assert errors["1"] <= 1e-5 and errors[None] <= 2e-2


# ------------------------------------------------------------------------------------------ --kv-cache


def test_kv_cache_export_from_a_folder(folders, tmp_path):
    import onnx

    result = CliRunner().invoke(main, ["convert", str(folders["qwen2"]), str(tmp_path / "kv.onnx"), "--kv-cache",
                                       "--json"])
    assert result.exit_code == 0, result.output
    verify = json.loads(result.stdout)["verify"]
    assert verify["passed"] and verify["inputs"] == 4                 # prefill and decode, two batches
    graph = onnx.load(tmp_path / "kv.onnx", load_external_data=False).graph
    assert [i.name for i in graph.input][3:5] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in graph.output][1] == "present.0.key"


def test_kv_cache_is_refused_where_it_does_not_apply(folders, tmp_path):
    from modelkit.models import build

    with pytest.raises(ConfigError, match="applies to ONNX output"):
        convert(folders["llama"], tmp_path / "x.safetensors", kv_cache=True)
    with pytest.raises(UnsupportedConversionError, match="kv_cache applies to Hugging Face causal LMs"):
        modelkit.export(build("mlp", seed=0), tmp_path / "mlp.onnx", kv_cache=True)
