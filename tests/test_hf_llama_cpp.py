"""llama.cpp's verdict on the GGUF files modelkit writes from Hugging Face folders, every family (issue 14).

For each family a tiny random-weight model of transformers' own classes, with a tokenizer in the family's
style (trained offline once; the files are in fixtures/llama_cpp/hf/), is saved with save_pretrained and
converted by modelkit to GGUF F32 and F16 and quantized to q8_0 and q4_0. fixtures/llama_cpp/make_golden_hf.py
ran llama.cpp (llama-cpp-python, pinned) on exactly those bytes: its token ids for a set of prompts and its
logits for one prompt. Here the same files are made again and must hash the same, so the verdict applies,
then:

- llama.cpp's ids equal the Hugging Face tokenizer's for every prompt as `gguf_vocab.llamacpp_prompt` gives it
  (the prompt itself, except Metaspace(first)'s leading space written out), and for the prompt itself exactly
  where that is the prompt;
- llama.cpp's logits equal transformers' (the original model for F32; transformers' own GGUF reader,
  `from_pretrained(..., gguf_file=)`, for F16 / q8_0 / q4_0, so both run the very same weights) within the
  tolerances pinned below with their measured values.

Where llama-cpp-python is importable the files are also run live (`run_live`).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers  # the judge (the hf extra, installed for tests): not skipped when missing

import modelkit
from modelkit.models.gguf_vocab import llamacpp_prompt
from modelkit.testing.prompts import TOKENIZER_PROMPTS

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "fixtures" / "llama_cpp"
TOKENIZERS = GOLDEN_DIR / "hf"
GOLDEN, LOGITS = GOLDEN_DIR / "golden_hf.json", GOLDEN_DIR / "logits_hf.npz"

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


@dataclass(frozen=True)
class Family:
    config: type                 # transformers' config class
    tokenizer: str               # folder under fixtures/llama_cpp/hf/ (tests/test_gguf_vocab.py's style of that name)
    extra: tuple = ()            # config values beyond COMMON


FAMILIES = {
    "llama": Family(transformers.LlamaConfig, "llama3",
                    (("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),)),
    # Mistral's released v0.1 tokenizer.json is the Llama-2 layout (Prepend + Replace); v0.3's is Metaspace(first),
    # which llama.cpp follows only on prompts as gguf_vocab.llamacpp_prompt gives them (docs/formats/gguf.md)
    "mistral": Family(transformers.MistralConfig, "llama2", (("sliding_window", 128),)),
    "mistral_v03": Family(transformers.MistralConfig, "mistral", (("sliding_window", 128),)),
    "qwen2": Family(transformers.Qwen2Config, "qwen2", (("tie_word_embeddings", True),)),
    # transformers' GGUF reader takes Qwen3's head_dim from its default (128), not from key_length
    "qwen3": Family(transformers.Qwen3Config, "qwen2", (("head_dim", 128), ("tie_word_embeddings", True))),
    # llama.cpp scales Gemma's queries by 1/sqrt(head_dim), as the released models' query_pre_attn_scalar does
    "gemma2": Family(transformers.Gemma2Config, "gemma", (("head_dim", 16), ("query_pre_attn_scalar", 16),
                                                          ("sliding_window", 128))),
    "gemma3": Family(transformers.Gemma3TextConfig, "gemma", (("head_dim", 16), ("query_pre_attn_scalar", 16),
                                                              ("sliding_window", 128))),
    "phi3": Family(transformers.Phi3Config, "phi3"),
    "gpt2": Family(transformers.GPT2Config, "gpt2"),
}
KINDS = ("f32", "f16", "q8_0", "q4_0")
PROMPTS = list(TOKENIZER_PROMPTS)
LOGITS_PROMPT = 1           # the prompt whose logits are compared: its first LOGITS_TOKENS ids
LOGITS_TOKENS = 16


def build_folder(family: str, folder: Path, shape: dict | None = None) -> Path:
    """The family's tiny model with its tokenizer, as save_pretrained writes it (seeded: the same bytes each run).
    `shape` replaces COMMON's sizes (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads; GPT-2 takes the first four as n_embd, n_inner, n_layer, n_head)."""
    spec = FAMILIES[family]
    given, shape = shape or {}, {**COMMON, **(shape or {})}
    folder.mkdir(parents=True, exist_ok=True)
    for file in (TOKENIZERS / spec.tokenizer).iterdir():
        shutil.copyfile(file, folder / file.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = {k: tokenizer.convert_tokens_to_ids(getattr(tokenizer, f"{k}_token")) for k in ("bos", "eos", "pad")
           if getattr(tokenizer, f"{k}_token", None) is not None}
    values = {**shape, **dict(spec.extra), "vocab_size": len(tokenizer) + 3,        # spare rows, as Qwen2's
              **{f"{k}_token_id": v for k, v in ids.items()}}
    if family == "gpt2":
        # n_positions as released GPT-2 has it: transformers' GGUF reader does not read it from context_length
        values = {"vocab_size": values["vocab_size"], "n_embd": shape["hidden_size"], "n_layer": shape["num_hidden_layers"],
                  "n_head": shape["num_attention_heads"], "n_positions": 1024,
                  **({"n_inner": given["intermediate_size"]} if "intermediate_size" in given else {}),
                  **{f"{k}_token_id": v for k, v in ids.items()}}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(spec.config(**values)).eval()
    with torch.no_grad():                  # norms and biases away from 0 / 1, so a missed +1 or a swap shows
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("transformers_version", None)           # the bytes must not depend on the judge's version
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = folder / "generation_config.json"
    if generation.exists():
        values = json.loads(generation.read_text())
        values.pop("transformers_version", None)
        generation.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    return folder


def write_gguf(folder: Path, kind: str, path: Path) -> Path:
    """modelkit's GGUF of `kind` from the folder, as a user makes it."""
    if kind in ("f32", "f16"):
        modelkit.convert(folder, path, dtype=None if kind == "f32" else "f16")
    else:
        modelkit.quantize(folder, path, scheme=kind)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hf_ids(folder: Path) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return [tokenizer.encode(p) for p in PROMPTS]


def llamacpp_prompts(folder: Path) -> list[str]:
    """PROMPTS as llama.cpp must be given them to tokenize like the folder's tokenizer.json."""
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    return [llamacpp_prompt(tokenizer_json, p) for p in PROMPTS]


def transformers_logits(folder: Path, gguf_file: Path | None, ids: list[int]) -> np.ndarray:
    """transformers' logits on `ids` from `transformers_model(folder, gguf_file)`."""
    with torch.no_grad():
        return transformers_model(folder, gguf_file)(torch.tensor([ids])).logits[0].numpy()


def transformers_model(folder: Path, gguf_file: Path | None) -> torch.nn.Module:
    """The folder's model in eval mode, or with the weights transformers' own GGUF reader
    (load_gguf_checkpoint, what from_pretrained(..., gguf_file=) runs) takes from `gguf_file`, in a model of
    the folder's config (the reader rebuilds some configs only partly: Gemma's query_pre_attn_scalar,
    Qwen3's head_dim, GPT-2's n_positions)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    if gguf_file is not None:
        loader = model        # llama.cpp stores Mistral as llama, and transformers' reader maps names by model type
        if model.config.model_type == "mistral":
            loader = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                **{k: v for k, v in model.config.to_dict().items() if k != "model_type"}))
        tensors = load_gguf_checkpoint(gguf_file, return_tensors=True, model_to_load=loader)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
    return model.eval()


# ----------------------------------------------------------------------------------------- the tests

# Largest |llama.cpp - transformers| / max |transformers logit| over the compared positions, per kind.
# Measured 2026-11-25 (llama-cpp-python 0.3.36, F32 KV cache, 1 thread; every family's figure is in
# fixtures/llama_cpp/golden_hf.json "measured"): f32 3e-07 (llama, mistral, qwen2, qwen3, phi3), 1.8e-05
# (gpt2), 3.4e-04 (gemma3: ggml's GELU table); f16 6e-04 (gemma3); q8_0 1.8e-02, q4_0 1.7e-02 (gemma3):
# llama.cpp rounds activations to q8 in its block dot products. q8_0/q4_0 pinned at tinylm's own margin
# (tests/test_quantizers.py: 0.01 on logits up to 0.39, 2.6%).
RTOL = {"f32": 1e-3, "f16": 1e-3, "q8_0": 0.026, "q4_0": 0.026}


@pytest.fixture(scope="module")
def golden() -> dict:
    doc = json.loads(GOLDEN.read_text())
    with np.load(LOGITS) as logits:
        doc["logits"] = {name: logits[name] for name in logits.files}
    return doc


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """Each family's folder and its four GGUF files, made once for the module."""
    root = tmp_path_factory.mktemp("hf-llama-cpp")
    return {family: build_folder(family, root / family) for family in FAMILIES}


def _gguf(made: dict[str, Path], family: str, kind: str) -> Path:
    path = made[family] / f"{family}-{kind}.gguf"
    return path if path.exists() else write_gguf(made[family], kind, path)


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_tokenizes_like_the_hugging_face_tokenizer(made, golden, family):
    entry = golden["families"][family]
    path = _gguf(made, family, "f32")
    assert sha256(path) == entry["files"]["f32"]["sha256"], _stale(family, "f32", golden)
    ours = hf_ids(made[family])
    forms = llamacpp_prompts(made[family])
    assert entry["llama_cpp_form_ids"] == ours
    rewritten = {i for i, (p, f) in enumerate(zip(PROMPTS, forms, strict=True)) if p != f}
    assert {i for i, (a, b) in enumerate(zip(entry["llama_cpp_ids"], ours, strict=True)) if a != b} == rewritten
    assert bool(rewritten) is (family == "mistral_v03")
    live = _live_ids(path, forms)
    if live is not None:
        assert live == ours


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_logits_equal_transformers(made, golden, family, kind):
    entry = golden["families"][family]
    path = _gguf(made, family, kind)
    assert sha256(path) == entry["files"][kind]["sha256"], _stale(family, kind, golden)
    ids = entry["llama_cpp_ids"][LOGITS_PROMPT][:LOGITS_TOKENS]
    reference = transformers_logits(made[family], None if kind == "f32" else path, ids)
    llama = golden["logits"][f"{family}-{kind}"]
    assert llama.shape == reference.shape
    assert np.abs(llama - reference).max() / np.abs(reference).max() <= RTOL[kind]
    live = _live_logits(path, ids)
    if live is not None:
        assert np.abs(live - reference).max() / np.abs(reference).max() <= RTOL[kind]


def _stale(family: str, kind: str, golden: dict) -> str:
    return (f"{family} {kind}: modelkit now writes other GGUF bytes than llama.cpp {golden['llama_cpp_python']} was "
            "run on; if the change is meant, rerun fixtures/llama_cpp/make_golden_hf.py")


# ------------------------------------------------------------------------------ llama.cpp, where installed


def _llama(path: Path, **options):
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_threads=1, seed=0, verbose=False, **options)


def _live_ids(path: Path, prompts: list[str]) -> list[list[int]] | None:
    llm = _llama(path, vocab_only=True)
    return None if llm is None else [llm.tokenize(p.encode("utf-8"), add_bos=True, special=True) for p in prompts]


def _live_logits(path: Path, ids: list[int]) -> np.ndarray | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    llm = _llama(path, logits_all=True, n_ctx=128, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)
