"""llama.cpp's quantization recipes (Q2_K, Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M, Q6_K): modelkit picks the same type
for every tensor as llama.cpp's own quantizer.

fixtures/llama_cpp/make_golden_recipes.py built the MODELS below (tinylm-shaped and every Hugging Face family
of issue 14, at shapes whose rows are and are not whole 256-weight super-blocks, with enough layers for the
layer rules), wrote each as an F16 GGUF with modelkit, and ran llama.cpp's `llama_model_quantize`
(llama-cpp-python 0.3.36) on it for every recipe: recipes.json holds each input's tensors (name, dimensions,
row length), its hparams, and llama.cpp's type for every tensor, its general.file_type and its count of
fallbacks. Here:

- the rule function (`gguf_recipes.plan`) gives llama.cpp's types for every (model, recipe) from names and
  shapes alone (no weights), and llama.cpp's fallback count;
- the files modelkit writes carry them: the small models are built again (their F16 input hashes as
  recorded, so the verdict applies), quantized by `modelkit quantize --scheme Q4_K_M` (weight path for a
  Hugging Face folder's GGUF, module path for tinylm) and read back;
- an already quantized file is refused without --allow-requantize and requantized with it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from gguf import GGUFReader

import modelkit
from modelkit.cli.app import main
from modelkit.errors import ConfigError
from modelkit.quantizers import gguf_recipes

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "fixtures" / "llama_cpp" / "recipes.json"
RECIPES = tuple(gguf_recipes.RECIPES)

# name -> (family, or "tinylm"; shape: hidden, intermediate, layers, heads, kv heads). Rows of 320, 192, 160
# are not whole super-blocks (fallbacks), 80 not even 32-weight blocks (F16); 16 layers give Q3_K_M's first
# 1/16; GQA 4 moves Q2_K's attn_v to Q4_K.
MODELS: dict[str, tuple[str, dict[str, int]]] = {
    "tinylm": ("tinylm", dict(hidden_size=256, intermediate_size=320, num_hidden_layers=16, num_attention_heads=8,
                              num_key_value_heads=2)),
    "llama": ("llama", dict(hidden_size=320, intermediate_size=512, num_hidden_layers=16, num_attention_heads=5,
                            num_key_value_heads=5)),
    "mistral": ("mistral", dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
                                num_key_value_heads=2)),
    "qwen2": ("qwen2", dict(hidden_size=192, intermediate_size=512, num_hidden_layers=8, num_attention_heads=6,
                            num_key_value_heads=2)),
    "qwen3": ("qwen3", dict(hidden_size=256, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4,
                            num_key_value_heads=1)),
    "gemma2": ("gemma2", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                              num_key_value_heads=2)),
    "gemma3": ("gemma3", dict(hidden_size=160, intermediate_size=512, num_hidden_layers=16, num_attention_heads=4,
                              num_key_value_heads=1)),
    "phi3": ("phi3", dict(hidden_size=256, intermediate_size=320, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=8)),
    "gpt2": ("gpt2", dict(hidden_size=320, intermediate_size=512, num_hidden_layers=8, num_attention_heads=5)),
    # written again by the tests below (small: seconds)
    "llama-small": ("llama", dict(hidden_size=64, intermediate_size=80, num_hidden_layers=8, num_attention_heads=4,
                                  num_key_value_heads=1)),
    "tinylm-small": ("tinylm", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                                    num_key_value_heads=2)),
}
WRITTEN = ("llama-small", "tinylm-small")


def _hf_module():
    name = "test_hf_llama_cpp"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def build_f16(model: str, folder: Path) -> Path:
    """MODELS[model] as modelkit's F16 GGUF (seeded: the same bytes each run), the input both quantizers take."""
    family, shape = MODELS[model]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{model}-f16.gguf"
    if family == "tinylm":
        import torch

        from modelkit.checkpoint import Checkpoint
        from modelkit.models import build

        torch.manual_seed(0)
        module = build("tinylm", shape, seed=0)
        source = folder / "model.safetensors"
        modelkit.save(Checkpoint.from_module(module), source, force=True)
        modelkit.convert(source, path, dtype="f16", force=True)
    else:
        modelkit.convert(_hf_module().build_folder(family, folder / "hf", shape), path, dtype="f16", force=True)
    return path


def gguf_types(path: Path) -> dict[str, str]:
    """Tensor name -> its GGML type in lower case ("q4_k", "f16", "f32")."""
    return {t.name: t.tensor_type.name.lower() for t in GGUFReader(path).tensors}


def file_type(path: Path) -> int:
    field = GGUFReader(path).fields["general.file_type"]
    return int(field.parts[field.data[0]][0])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def _tensors(entry: dict) -> list[gguf_recipes.Tensor]:
    """The recorded input tensors ("name:dimensions:row length", llama.cpp's order)."""
    return [gguf_recipes.Tensor(name, int(ndim), int(row))
            for name, ndim, row in (t.rsplit(":", 2) for t in entry["tensors"].split())]


def _expected(entry: dict, recipe: str) -> dict[str, str]:
    """llama.cpp's output type per tensor name (kept tensors: their input type)."""
    return {t.name: q for t, q in zip(_tensors(entry), entry["recipes"][recipe]["types"].split(), strict=True)}


def _plan(entry: dict, recipe: str) -> gguf_recipes.Plan:
    return gguf_recipes.plan(recipe, _tensors(entry), gguf_recipes.ModelFacts(**entry["facts"]))


def test_golden_pins_llama_cpp_and_covers_every_model(golden):
    assert golden["llama_cpp_python"] == "0.3.36"
    assert set(golden["models"]) == set(MODELS)
    assert all(set(entry["recipes"]) >= set(RECIPES) for entry in golden["models"].values())


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("model", MODELS)
def test_choices_equal_llama_cpp(golden, model, recipe):
    entry = golden["models"][model]
    plan = _plan(entry, recipe)
    ours = {t.name: plan.types[t.name] or input_type for t, input_type in
            zip(_tensors(entry), entry["input_types"].split(), strict=True)}
    expected = _expected(entry, recipe)
    wrong = {n: (ours[n], expected[n]) for n in expected if ours[n] != expected[n]}
    assert not wrong, f"{model} {recipe}: (modelkit, llama.cpp) {wrong}"
    assert plan.fallbacks == entry["recipes"][recipe]["fallbacks"]
    assert plan.recipe.ftype == entry["recipes"][recipe]["file_type"]


def test_the_golden_models_exercise_every_rule(golden):
    """The recorded choices are not all the base type: each rule the recipes have shows up somewhere."""
    seen = {(recipe, q) for entry in golden["models"].values() for recipe in RECIPES
            for q in set(entry["recipes"][recipe]["types"].split())}
    for wanted in [("q2_k", "q3_k"), ("q2_k", "q4_k"), ("q2_k", "q6_k"), ("q2_k", "q4_0"), ("q3_k_m", "q5_k"),
                   ("q3_k_l", "q5_k"), ("q4_k_m", "q6_k"), ("q4_k_m", "q5_0"), ("q4_k_s", "q5_k"),
                   ("q5_k_m", "q6_k"), ("q5_k_s", "q5_1"), ("q6_k", "q8_0"), ("q4_k_m", "f16")]:
        assert wanted in seen, wanted


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recipes")
    return {model: build_f16(model, root / model) for model in WRITTEN}


@pytest.mark.parametrize("model", WRITTEN)
def test_files_modelkit_writes_carry_llama_cpps_types(golden, written, model, tmp_path):
    entry = golden["models"][model]
    source = written[model]
    assert sha256(source) == entry["f16_sha256"], (f"{model}: the F16 input changed since llama.cpp judged it; "
                                                   "rerun fixtures/llama_cpp/make_golden_recipes.py")
    for recipe in ("Q4_K_M", "q2_k") if model == "llama-small" else ("Q4_K_M",):     # tinylm: the module path, slower
        out = tmp_path / f"{model}-{recipe}.gguf"
        result = CliRunner().invoke(main, ["quantize", str(source), str(out), "--scheme", recipe])
        assert result.exit_code == 0, result.output
        assert gguf_types(out) == _expected(entry, recipe.lower())
        assert file_type(out) == entry["recipes"][recipe.lower()]["file_type"]


def test_requantizing_needs_allow_requantize(written, tmp_path):
    source = written["llama-small"]
    first = tmp_path / "q4_k_m.gguf"
    modelkit.quantize(source, first, scheme="q4_k_m")
    with pytest.raises(ConfigError, match="already quantized .*--allow-requantize") as error:
        modelkit.quantize(first, tmp_path / "again.gguf", scheme="q3_k_m")
    assert "\n" not in str(error.value)
    again = tmp_path / "again.gguf"
    modelkit.quantize(first, again, scheme="q3_k_m", allow_requantize=True)
    direct = tmp_path / "direct.gguf"
    modelkit.quantize(source, direct, scheme="q3_k_m")
    assert gguf_types(again) == gguf_types(direct)
    assert file_type(again) == gguf_recipes.RECIPES["q3_k_m"].ftype


def test_scheme_names_are_case_insensitive_and_listed_in_help_and_docs():
    from modelkit import schemes

    assert type(schemes.config_from_dict({"scheme": "Q4_K_M"})).scheme == "q4_k_m"
    text = CliRunner().invoke(main, ["quantize", "--help"]).output
    for recipe in gguf_recipes.RECIPES.values():
        assert recipe.name.upper() in text
    page = (ROOT / "docs" / "quantizers" / "gguf-recipes.md").read_text()
    assert gguf_recipes.markdown_table() in page, "regenerate the table: gguf_recipes.markdown_table()"
