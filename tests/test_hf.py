"""Hugging Face model folders: read, written and converted to GGUF the way llama.cpp stores each family.

The judges are transformers' own: `from_pretrained(folder)` for folders, and its GGUF reader
(`load_gguf_checkpoint`: its config keys, its GGUF -> Hugging Face name map and its tensor processors
that undo the Q/K permutation, Gemma's +1 and GPT-2's transposition) for GGUF. `from_pretrained(dir,
gguf_file=)` itself also needs the accelerate package, which the test environment does not install;
it runs the same reader. Every model is a tiny random-weight model of transformers' own classes,
saved with save_pretrained once per session, without tokenizer files (the tokenizer keys are tested
with modelkit.models.gguf_vocab).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import modelkit
from modelkit.checkpoint import Checkpoint, instantiate
from modelkit.errors import ConfigError, MissingDependencyError, UnknownModelError, UnsupportedConversionError
from modelkit.formats import detect_format
from modelkit.models import _hf, hf_families
from modelkit.pipeline.convert import convert
from modelkit.testing.gguf_files import as_llama_cpp_writes_it

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    # transformers' GGUF reader takes Qwen3's head_dim from its default (128): the test model uses it
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=128),
    # query_pre_attn_scalar = head_dim, as released Gemmas have it: llama.cpp can store no other query scale
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=16),
    "gemma3": lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=16, query_pre_attn_scalar=16),
    "phi3": lambda: transformers.Phi3Config(**COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                            bos_token_id=0, eos_token_id=0),
}
FAMILIES = sorted(CONFIGS)
IDS = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
# F16 GGUF (vectors F32) read by transformers, against the F32 model: measured 2026-11-25, largest |logit
# difference| 4.3e-04 (gemma3; logits up to 0.66), gemma2 3.8e-04, the others 3e-05 to 7e-05; pinned with headroom.
F16_ATOL = 2e-3


def test_every_family_is_tested():
    assert set(FAMILIES) == set(hf_families())


class Saved:
    """One family's model, its folder and its logits on IDS."""

    def __init__(self, model, folder: Path) -> None:
        self.model, self.folder = model, folder
        with torch.no_grad():
            self.logits = model(IDS).logits

    def logits_of(self, model) -> torch.Tensor:
        with torch.no_grad():
            return model.eval()(IDS).logits


@pytest.fixture(scope="session")
def saved(tmp_path_factory) -> dict[str, Saved]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
        with torch.no_grad():                  # norms and biases away from 0 / 1, so a missed +1 or a swap shows
            for p in model.parameters():
                if p.ndim == 1:
                    p.normal_(0.0, 0.2)
        model.save_pretrained(root / family)
        out[family] = Saved(model, root / family)
    return out


@pytest.fixture(scope="session")
def sharded(saved, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded") / "llama"
    saved["llama"].model.save_pretrained(folder, max_shard_size="100KB")
    return folder


@pytest.fixture(scope="session")
def ggufs(saved, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    for family, s in saved.items():
        convert(s.folder, root / f"{family}.gguf")
    return {family: root / f"{family}.gguf" for family in saved}


def _transformers_gguf(path: Path, original) -> tuple[object, dict]:
    """transformers' GGUF reader into a model of the original's config (llama.cpp stores Mistral as llama:
    transformers reads it as Llama)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = original.config
    if config.model_type == "mistral":
        config = transformers.LlamaConfig(**{k: v for k, v in config.to_dict().items() if k != "model_type"})
    model = transformers.AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model.eval(), parsed["config"]


# ------------------------------------------------------------------------------------------ folders


@pytest.mark.parametrize("family", FAMILIES)
def test_a_folder_is_detected_and_read_lazily_with_its_config(saved, family):
    folder = saved[family].folder
    assert detect_format(folder) == "hf"
    ckpt = modelkit.load(folder)
    assert ckpt.arch.name == family and ckpt.arch.config == json.loads((folder / "config.json").read_text())
    assert "generation_config.json" in ckpt.assets
    state = saved[family].model.state_dict()
    assert set(ckpt.tensors) <= set(state) and all(t.span is not None for t in ckpt.tensors.values())
    assert all(torch.equal(ckpt.tensors[n].load(), state[n]) for n in ckpt.tensors)


def test_a_sharded_folder_wins_over_the_safetensors_folder_detection(sharded, saved, tmp_path):
    assert detect_format(sharded) == "hf" and len(list(sharded.glob("model-*.safetensors"))) > 1
    convert(sharded, tmp_path / "out", to="hf", shard_size="60KB")
    assert json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(saved["llama"].logits_of(loaded), saved["llama"].logits)
    convert(sharded, tmp_path / "one.safetensors")
    assert modelkit.load(tmp_path / "one.safetensors").arch.name == "llama"


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3", "gpt2"])
def test_folder_to_folder_loads_in_transformers_with_the_same_logits(saved, family, tmp_path):
    report = convert(saved[family].folder, tmp_path / "out", to="hf")
    assert report.verify["passed"] and report.verify["method"] == "bit-exact"
    assert (tmp_path / "out" / "generation_config.json").read_bytes() == \
        (saved[family].folder / "generation_config.json").read_bytes()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(saved[family].logits_of(loaded), saved[family].logits)


def test_an_unknown_model_type_names_it_and_the_families(saved, tmp_path):
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((saved["llama"].folder / "model.safetensors").read_bytes())
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnknownModelError, match=r"model_type 'bert' is not a family modelkit knows; known families: "
                                                r"gemma2 \(gemma2\), gemma3 \(gemma3_text/gemma3\)"):
        modelkit.load(folder)


def test_a_zoo_model_is_not_written_as_a_folder(tmp_path):
    from modelkit.models import build

    with pytest.raises(UnsupportedConversionError, match="holds one of the families"):
        modelkit.save(Checkpoint.from_module(build("mlp", seed=0)), tmp_path / "mlp", format="hf")


def test_building_a_family_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'modelkit\[hf\]'"):
        _hf.build(hf_families()["llama"], {"model_type": "llama"})


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_folder_converts_to_torchscript_traced_as_a_causal_lm(saved, family, tmp_path):
    """TorchScript of a folder: the ONNX graph's signature (input_ids, attention_mask, position_ids -> logits),
    traced; verified on token batches, its weights read back under their Hugging Face names."""
    report = convert(saved[family].folder, tmp_path / "m.ts")
    assert report.verify["passed"] and report.verify["max_abs_err"] <= 1e-5
    state = saved[family].model.state_dict()
    back = modelkit.load(tmp_path / "m.ts")
    assert set(back.tensors) <= set(state) and all(torch.equal(t.load(), state[n]) for n, t in back.tensors.items())
    scripted = torch.jit.load(tmp_path / "m.ts")
    mask = torch.ones_like(IDS)
    positions = torch.arange(IDS.shape[1]).expand_as(IDS)
    with torch.no_grad():
        assert torch.allclose(scripted(IDS, mask, positions), saved[family].logits, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_instantiate_builds_transformers_model_from_a_folder(saved, family):
    model = instantiate(modelkit.load(saved[family].folder))
    assert type(model) is type(saved[family].model)
    assert torch.equal(saved[family].logits_of(model), saved[family].logits)


# --------------------------------------------------------------------------------------------- GGUF


def _fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}, reader


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_follows_llama_cpp_and_transformers_reads_the_same_logits(saved, ggufs, family):
    fields, reader = _fields(ggufs[family])
    arch = hf_families()[family].architecture
    assert fields["general.architecture"] == arch and fields["general.file_type"] == int(gguf.LlamaFileType.ALL_F32)
    known = {v.replace("{arch}", arch) for group in (gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope)
             for v in vars(group).values() if isinstance(v, str)}
    assert {k for k in fields if k.startswith(f"{arch}.")} <= known          # every key is one llama.cpp knows
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], 2)     # gguf-py's table, not ours
    for tensor in reader.tensors:
        base = tensor.name.rsplit(".", 1)[0]
        assert base in {names.get_name(n) for n in names.mapping}, tensor.name
        if tensor.data.ndim == 1:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
    assert ("output.weight" in {t.name for t in reader.tensors}) == (not saved[family].model.config.tie_word_embeddings)
    model, config = _transformers_gguf(ggufs[family], saved[family].model)
    assert torch.equal(saved[family].logits_of(model), saved[family].logits)
    original = saved[family].model.config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "n_embd", "n_layer"):
        if key in config:
            assert config[key] == getattr(original, key), key


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_gemma_query_scale_llama_cpp_cannot_hold_is_refused(saved, family, tmp_path):
    """llama.cpp scales Gemma's queries by 1/sqrt(head_dim) (hidden/heads for the 27B models): a config.json
    saying otherwise would give other logits there, so it is refused; a GGUF read back gets the value."""
    folder = tmp_path / family
    shutil.copytree(saved[family].folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "query_pre_attn_scalar": 256}))
    with pytest.raises(UnsupportedConversionError, match="query_pre_attn_scalar is 256, but llama.cpp scales this model's queries as if it were 16"):
        convert(folder, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
    from modelkit.models import _hf

    fields = {f"{family}.{k}": v for k, v in (("embedding_length", 64), ("block_count", 2), ("attention.head_count", 4),
                                               ("attention.key_length", 16))}
    assert _hf.config_from_gguf(hf_families()[family], fields, tied=True)["query_pre_attn_scalar"] == 16
    fields[f"{family}.block_count"] = hf_families()[family].query_scale_27b
    assert _hf.config_from_gguf(hf_families()[family], fields, tied=True)["query_pre_attn_scalar"] == 64 // 4


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gpt2"])
def test_f16_gguf_keeps_vectors_f32_and_stays_within_the_pinned_tolerance(saved, family, tmp_path):
    convert(saved[family].folder, tmp_path / "m.gguf", dtype="f16")
    fields, reader = _fields(tmp_path / "m.gguf")
    assert fields["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors if t.data.ndim == 1)
    model, _ = _transformers_gguf(tmp_path / "m.gguf", saved[family].model)
    error = (saved[family].logits_of(model) - saved[family].logits).abs().max().item()
    assert 0 < error < F16_ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_back_to_a_folder_gives_transformers_the_same_logits(saved, ggufs, family, tmp_path):
    convert(ggufs[family], tmp_path / "back", to="hf")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config == json.loads((saved[family].folder / "config.json").read_text())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert torch.equal(saved[family].logits_of(loaded), saved[family].logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_without_our_keys_reads_back_as_its_family(saved, ggufs, family, tmp_path):
    """A file as llama.cpp writes it (no modelkit.* keys): the family from general.architecture, the config
    from its keys, Hugging Face names with the storage undone."""
    as_llama_cpp_writes_it(ggufs[family], tmp_path / "plain.gguf")
    ckpt = modelkit.load(tmp_path / "plain.gguf")
    assert ckpt.arch.name == family           # mistral: llama's architecture, named by general.name ("Mistral")
    model = instantiate(ckpt)
    assert torch.allclose(saved[family].logits_of(model), saved[family].logits, atol=1e-5)


def test_llama3_rope_scaling_travels_as_rope_freqs(saved, tmp_path):
    """llama.cpp divides each rotary frequency by rope_freqs; transformers' own llama3 rule gives the same."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 512}, rope_parameters=scaling)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "l3")
    convert(tmp_path / "l3", tmp_path / "l3.gguf")
    fields, reader = _fields(tmp_path / "l3.gguf")
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert np.allclose(factors, (base / scaled).numpy(), rtol=1e-5)
    assert fields["llama.rope.freq_base"] == 500000.0
    convert(tmp_path / "l3.gguf", tmp_path / "back", to="hf")      # the tensor is derived: not a weight
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    # as llama.cpp writes it (no config of ours): the scaling comes back from rope_freqs alone
    as_llama_cpp_writes_it(tmp_path / "l3.gguf", tmp_path / "plain.gguf")
    ckpt = modelkit.load(tmp_path / "plain.gguf")
    assert ckpt.arch.config["rope_parameters"]["rope_type"] == "llama3"
    with torch.no_grad():
        # measured 2026-11-28: 0.0 (logits up to 0.64); room for settings that differ in float32 rounding
        assert torch.allclose(instantiate(ckpt)(IDS).logits, model(IDS).logits, atol=1e-5)


@pytest.mark.parametrize("settings", [
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 16.0, "original_max_position_embeddings": 64},
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.5, "original_max_position_embeddings": 512},
], ids=["llama-3.1", "llama-3.2", "blend-wide", "no-blended-frequency"])
def test_llama3_rope_settings_come_back_from_the_divisors(settings):
    """Any Llama-3 settings give back settings whose divisors are the same; Meta's come back as they were."""
    config = {"hidden_size": 2048, "num_attention_heads": 16,
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **settings}}
    factors = _hf.llama3_rope_factors(config)
    back = _hf.llama3_from_factors(config, 500000.0, [float(np.float32(f)) for f in factors])
    again = _hf.llama3_rope_factors({**config, "rope_parameters": {**back, "rope_theta": 500000.0}})
    assert back["rope_type"] == "llama3" and back["factor"] == settings["factor"]
    assert np.allclose(again, factors, rtol=1e-5)
    if settings["original_max_position_embeddings"] == 8192:
        assert {k: back[k] for k in settings} == settings


def test_rope_freqs_that_follow_no_rule_are_refused():
    with pytest.raises(ConfigError, match="does not follow Llama-3"):
        _hf.llama3_from_factors({"hidden_size": 64, "num_attention_heads": 4}, 10000.0, [1.0, 3.0, 1.0, 8.0, 2.0, 8.0, 8.0, 8.0])


# ------------------------------------------------------------------------------------- without torch

_NO_TORCH = "import sys\nsys.modules['torch'] = None\nfrom modelkit.cli import run\nrun(sys.argv[1:])\n"


def test_folder_commands_run_without_torch(saved, tmp_path):
    folder = saved["gemma2"].folder
    for args in (["convert", str(folder), "m.gguf"], ["convert", str(folder), "out", "--to", "hf"],
                 ["convert", "m.gguf", "back", "--to", "hf"], ["convert", "back", "m.safetensors"],
                 ["quantize", str(folder), "q.gguf", "--scheme", "q4_0"], ["inspect", str(folder)]):
        result = subprocess.run([sys.executable, "-c", _NO_TORCH, *args], cwd=tmp_path, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert torch.allclose(saved["gemma2"].logits_of(loaded), saved["gemma2"].logits, atol=1e-6)


# ------------------------------------------------------------------------------------ quantize a folder

# transformers' GGUF reader on `modelkit quantize FOLDER out.gguf`, against the F32 model: largest
# |logit difference| / largest |logit|, measured 2026-11-25 over the eight families: q8_0 2.1e-02
# (gemma3; llama 8.5e-03; gpt2 4.6e-03), q4_0 2.6e-01 (gemma3; llama 1.4e-01; gpt2 7.1e-02, its Conv1D
# weights quantized along llama.cpp's rows). Pinned with headroom.
QUANT_RTOL = {"q8_0": 5e-2, "q4_0": 0.5}


@pytest.mark.parametrize("scheme", sorted(QUANT_RTOL))
@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_quantize_streams_a_folder_to_gguf_blocks(saved, family, scheme, tmp_path, monkeypatch):
    from modelkit.models import _hf as hf_module

    monkeypatch.setattr(hf_module, "build", None)            # no module is built on this path
    report = modelkit.quantize(saved[family].folder, tmp_path / "q.gguf", scheme=scheme)
    assert report.stats["quantized_tensors"] > 0 and report.verify["passed"]
    fields, reader = _fields(tmp_path / "q.gguf")
    qtype = gguf.GGMLQuantizationType[scheme.upper()]
    assert {t.tensor_type for t in reader.tensors if t.data.ndim == 2 and "embd" not in t.name} == {qtype}
    back = modelkit.load(tmp_path / "q.gguf")          # GPT-2's transposed blocks come back in Hugging Face's shape
    state = saved[family].model.state_dict()
    assert all(back.tensors[n].shape == tuple(state[n].shape) for n in back.tensors)
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors if t.name.endswith("norm.weight"))
    monkeypatch.undo()
    model, _ = _transformers_gguf(tmp_path / "q.gguf", saved[family].model)
    error = (saved[family].logits_of(model) - saved[family].logits).abs().max().item()
    assert 0 < error < QUANT_RTOL[scheme] * saved[family].logits.abs().max().item()


# ------------------------------------------------------------------------- tokenizer files and inspect


@pytest.fixture(scope="session")
def with_tokenizer(saved, tmp_path_factory) -> Path:
    """The qwen2 folder plus a byte-level BPE tokenizer trained offline on a standard-library module, with a
    chat template (tokenizer files only: GGUF tokenizer keys are modelkit.models.gguf_vocab's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tokenizer") / "qwen2"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([Path(json.__file__).read_text()], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    saved["qwen2"].model.save_pretrained(folder, max_shard_size="100KB")
    fast.save_pretrained(folder)
    return folder


def test_inspect_a_folder_names_family_tokenizer_and_shards(with_tokenizer):
    info = modelkit.inspect(with_tokenizer)
    model = info.model
    assert (model["family"], model["model_type"], model["llama_cpp_architecture"]) == ("qwen2", "qwen2", "qwen2")
    assert model["parameters"] == info.num_parameters and model["dtype"] == "float32"
    assert (model["context_length"], model["vocab_size"]) == (128, 320)
    assert model["tokenizer"] == {"kind": "BPE", "style": "byte-level", "vocab_size": 300, "chat_template": True}
    shards = sorted(with_tokenizer.glob("model-*.safetensors"))
    assert model["shards"] == {"files": len(shards), "bytes": sum(p.stat().st_size for p in shards)} and len(shards) > 1
    from click.testing import CliRunner

    from modelkit.cli import main

    result = CliRunner().invoke(main, ["inspect", str(with_tokenizer), "--limit", "0"])
    assert result.exit_code == 0 and "tokenizer: BPE, byte-level, 300 tokens, chat template present" in result.output


def test_inspect_a_family_gguf(ggufs):
    model = modelkit.inspect(ggufs["gemma2"]).model
    assert (model["family"], model["llama_cpp_architecture"], model["context_length"]) == ("gemma2", "gemma2", 128)
    assert model["tokenizer"] is None and "shards" not in model


def test_tokenizer_files_travel_byte_for_byte(with_tokenizer, tmp_path):
    ckpt = modelkit.load(with_tokenizer)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= set(ckpt.assets)
    convert(with_tokenizer, tmp_path / "out", to="hf")
    for name in ckpt.assets:
        assert (tmp_path / "out" / name).read_bytes() == (with_tokenizer / name).read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    convert(with_tokenizer, tmp_path / "bf16", to="hf", dtype="bf16")         # a cast keeps them too
    assert set(modelkit.load(tmp_path / "bf16").assets) == set(ckpt.assets)
    assert modelkit.inspect(tmp_path / "bf16").model["dtype"] == "bfloat16"


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_template_injection_in_a_folder_is_refused(with_tokenizer, tmp_path, where):
    import shutil

    from modelkit.errors import UnsafeFileError

    folder = tmp_path / "evil"
    shutil.copytree(with_tokenizer, folder)
    payload = "{{ cycler.__init__.__globals__.os.popen('id').read() }}"
    if where == "chat_template.jinja":
        (folder / where).write_text(payload)
    else:
        config = json.loads((folder / where).read_text())
        (folder / where).write_text(json.dumps({**config, "chat_template": payload}))
    with pytest.raises(UnsafeFileError, match="refused"):
        modelkit.load(folder)


def test_the_tokenizer_travels_folder_gguf_folder(with_tokenizer, saved, tmp_path):
    """modelkit.models.gguf_vocab writes the tokenizer keys and rebuilds the files (tested there); here the
    folder paths call it: the ids and the logits come back."""
    convert(with_tokenizer, tmp_path / "m.gguf")
    fields, _ = _fields(tmp_path / "m.gguf")
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    convert(tmp_path / "m.gguf", tmp_path / "back", to="hf")
    text = Path(json.__file__).read_text()[:2000]
    original, back = (transformers.AutoTokenizer.from_pretrained(f) for f in (with_tokenizer, tmp_path / "back"))
    assert back(text)["input_ids"] == original(text)["input_ids"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert torch.equal(saved["qwen2"].logits_of(loaded), saved["qwen2"].logits)


def test_tinylm_becomes_a_llama_folder_transformers_runs(tmp_path):
    from modelkit.models import build

    tiny = build("tinylm", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}, seed=0)
    with torch.no_grad():
        for p in tiny.parameters():
            p.normal_(0.0, 0.2 if p.ndim == 2 else 1.0)
    modelkit.save(Checkpoint.from_module(tiny.eval()), tmp_path / "tiny", format="hf")
    assert modelkit.load(tmp_path / "tiny").arch.name == "llama"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny").eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = tiny(ids), loaded(ids).logits
    # measured 2026-11-25: 0.0 (logits up to 7.7): the same computation; a little room for other kernels
    assert (got - expected).abs().max().item() < 1e-5


def test_phi3_longrope_travels_as_rope_factors(tmp_path):
    """Phi-3's long-context rope (longrope) as llama.cpp stores it: the factors as rope_factors_long /
    short, the attention factor and original context as keys; GGUF -> folder gives the config back."""
    half = 8
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.0 + i / 4 for i in range(half)],
            "short_factor": [1.0 + i / 16 for i in range(half)]}
    config = transformers.Phi3Config(**{**COMMON, "max_position_embeddings": 256}, original_max_position_embeddings=64,
                                     rope_parameters=rope, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "phi")
    convert(tmp_path / "phi", tmp_path / "phi.gguf")
    fields, reader = _fields(tmp_path / "phi.gguf")
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert np.array_equal(tensors["rope_factors_long.weight"], np.float32(rope["long_factor"]))
    assert np.array_equal(tensors["rope_factors_short.weight"], np.float32(rope["short_factor"]))
    assert fields["phi3.rope.scaling.original_context_length"] == 64
    assert fields["phi3.rope.scaling.attn_factor"] == pytest.approx(np.sqrt(1 + np.log(4) / np.log(64)))
    convert(tmp_path / "phi.gguf", tmp_path / "back", to="hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    as_llama_cpp_writes_it(tmp_path / "phi.gguf", tmp_path / "plain.gguf")        # no config of ours
    ckpt = modelkit.load(tmp_path / "plain.gguf")
    assert ckpt.arch.config["original_max_position_embeddings"] == 64
    long_ids = torch.randint(0, 320, (1, 80), generator=torch.Generator().manual_seed(2))     # past 64: long factors
    with torch.no_grad():
        for ids in (IDS, long_ids):
            # measured 2026-11-28: 1.5e-07 and 1.8e-07 (logits up to 0.77; the attention factor is float32)
            assert torch.allclose(instantiate(ckpt)(ids).logits, model(ids).logits, atol=1e-5)
