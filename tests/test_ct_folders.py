"""Folders other tools quantized with compressed-tensors (llm-compressor's W4A16, W8A8, W8A16, naive, FP8, mixed
config groups): modelkit reads them (modelkit/storage/compressed_tensors_read.py), judged by transformers with
the compressed-tensors package on the very same folder.

The folders are made here by compressed-tensors itself (0.20): a tiny random-weight LlamaForCausalLM, a
QuantizationConfig applied with `apply_quantization_config`, its weight scales set from the weights' ranges with
compressed-tensors' own `calculate_qparams` (what llm-compressor's min-max observer computes), then
`ModelCompressor.compress_model`, `save_pretrained` and `update_config`, as llm-compressor saves a model.
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, LlamaConfig, LlamaForCausalLM

import modelkit
from modelkit.checkpoint import QuantizedTensor, instantiate
from modelkit.cli import main
from modelkit.errors import FormatError
from modelkit.quantizers.fast_linear import use_isa

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "llama_cpp" / "hf" / "llama3"
COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
IDS = torch.randint(0, 505, (2, 12), generator=torch.Generator().manual_seed(1))
ATTN = "re:.*self_attn\\.(q|k|v|o)_proj$"


def _preset(name: str, targets=("Linear",)) -> QuantizationScheme:
    return preset_name_to_scheme(name, list(targets))


def _weights_only(args: QuantizationArgs, targets=("Linear",)) -> QuantizationScheme:
    return QuantizationScheme(targets=list(targets), weights=args)


# case -> (config groups, ignore, forced format, model dtype, what modelkit makes of the quantized weights)
CASES = {
    "w4a16": ({"group_0": _preset("W4A16")}, ["lm_head"], None, torch.float32, "int4"),
    "w4a16-asym": ({"group_0": _preset("W4A16_ASYM")}, ["lm_head"], None, torch.float32, "int4"),
    "w8a16": ({"group_0": _preset("W8A16")}, ["lm_head"], None, torch.float32, "int8"),
    "w8a8": ({"group_0": _preset("W8A8")}, ["lm_head"], None, torch.float32, "int8-dynamic"),
    "w3a16": ({"group_0": _preset("W3A16")}, ["lm_head"], None, torch.float32, "float32"),
    "naive-int8-asym": ({"group_0": _weights_only(QuantizationArgs(num_bits=8, strategy="channel", symmetric=False))},
                        ["lm_head"], "naive-quantized", torch.float32, "int8"),
    "int4-tensor-asym": ({"group_0": _weights_only(QuantizationArgs(num_bits=4, strategy="tensor", symmetric=False))},
                         ["lm_head"], None, torch.float32, "int4"),
    "fp8-weights": ({"group_0": _weights_only(_preset("FP8_DYNAMIC").weights)}, ["lm_head"], None, torch.float32,
                    "float32"),
    "fp8-dynamic": ({"group_0": _preset("FP8_DYNAMIC")}, ["lm_head"], None, torch.float32, "float32"),
    "fp8-static": ({"group_0": _preset("FP8")}, ["lm_head"], None, torch.float32, "float32"),
    "fp8-block": ({"group_0": _preset("FP8_BLOCK")}, ["lm_head"], None, torch.float32, "float32"),
    # several groups, each with its own format: attention by pattern (int4, packed), layer 0's MLP by
    # name (FP8 weights), every other Linear by class (W8A16); layer 1's up_proj and lm_head ignored; bfloat16
    # scales, so dequantizing rounds as compressed-tensors rounds in bfloat16
    "mixed-bf16": ({"attention": _weights_only(QuantizationArgs(num_bits=4, group_size=32, strategy="group"), [ATTN]),
                    "layer0_mlp": _weights_only(_preset("FP8_DYNAMIC").weights,
                                                [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]),
                    "rest": _preset("W8A16")},
                   ["lm_head", "re:.*layers\\.1\\.mlp\\.up_proj$"], None, torch.bfloat16, None),
}
# Loaded with CompressedTensorsConfig(dequantize=True): transformers 5.24 + compressed-tensors 0.20 cannot load
# packed asymmetric zero points compressed (their shapes mismatch the initialised parameters).
# (Its dequantize=True path fails on a folder of several formats: "mixed-bf16" is symmetric, loaded compressed.)
DEQUANTIZE_ON_LOAD = {"w4a16-asym", "int4-tensor-asym"}
# max |transformers' logits - modelkit's| (logits up to ~1.1), measured 2026-11-28, CPU float32 (mixed-bf16: its
# bfloat16 weights run in float32 by both; in bfloat16 transformers differs from modelkit's float32 by 4.7e-3):
# weight-only cases 0.0 (the same weights, bit for bit, and the same matmuls); w8a8 1.33e-2 (compressed-tensors
# rounds activations with max|x| / 127.5, modelkit's int8-dynamic with max|x| / 127; transformers vs the float
# model: 1.9e-2), pinned at 3e-2; FP8 with activations: transformers fake-quantizes the inputs to FP8, modelkit
# runs them in float (inspect says so): fp8-dynamic 4.1e-2, fp8-static 4.5e-2, fp8-block 3.8e-2 (transformers vs
# the float model: 5.6e-2 to 6.1e-2), pinned at 1e-1.
LOGITS_ATOL = {"w8a8": 3e-2, "fp8-dynamic": 1e-1, "fp8-static": 1e-1, "fp8-block": 1e-1}


def _calibrate(model: torch.nn.Module) -> None:
    """Each quantized module's weight scale (and zero point) from its weight's range, as a min-max observer sets
    them; static input scales from a fixed activation range."""
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args, w = scheme.weights, module.weight.data.float()
        if args.strategy == "group":
            g = w.reshape(w.shape[0], -1, args.group_size)
            low, high = g.amin(-1), g.amax(-1)
        elif args.strategy == "channel":
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif args.strategy == "block":
            bh, bw = args.block_structure
            padded = F.pad(w, (0, -w.shape[1] % bw, 0, -w.shape[0] % bh))
            blocks = padded.reshape(padded.shape[0] // bh, bh, padded.shape[1] // bw, bw).transpose(1, 2)
            low, high = blocks.amin((-1, -2)), blocks.amax((-1, -2))
        else:
            low, high = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(low, high, args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(module.weight_zero_point.shape)
        if hasattr(module, "input_scale") and not scheme.input_activations.dynamic:
            module.input_scale.data.fill_(4.0 / 448)


def _make(path: Path, groups, ignore, fmt, dtype, shard: str | None = None) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**COMMON)).to(dtype).eval()
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=ignore), show_progress=False)
    _calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    compressor.update_config(path)
    for f in FIXTURES.iterdir():
        shutil.copy(f, path / f.name)


def _transformers(path: Path, case: str) -> torch.nn.Module:
    kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if case in DEQUANTIZE_ON_LOAD else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with use_isa(None):          # transformers dequantizes: our quantized layers run their reference path too
        yield
    torch.set_num_threads(threads)


class _Cache(dict):
    """A session's folders (or transformers' results), each made the first time a test asks for it, so no one
    test pays for all of them (each folder: ~0.25 s)."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, case: str):
        self[case] = value = self.make(case)
        return value


@pytest.fixture(scope="session")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct-folders")

    def make(case: str) -> Path:
        groups, ignore, fmt, dtype, _ = CASES[case]
        _make(root / case, groups, ignore, fmt, dtype)
        return root / case
    return _Cache(make)


@pytest.fixture(scope="session")
def theirs(folders) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """transformers' logits and float weights (compressed-tensors' decompression) for each folder."""
    def run(case: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.no_grad():
            model = _transformers(folders[case], case)
            logits = model(IDS).logits              # the first forward decompresses the weights
            state = {k: v.clone() for k, v in model.state_dict().items()}
            if model.dtype != torch.float32:    # modelkit runs a bfloat16 folder in float32: so does transformers here,
                plain = LlamaForCausalLM(LlamaConfig(**COMMON)).eval()     # on its decompressed bfloat16 weights
                plain.load_state_dict({k: v.float() for k, v in state.items()
                                       if k.rpartition(".")[2] in ("weight", "bias")})
                logits = plain(IDS).logits
            return logits, state
    return _Cache(run)


def test_the_folders_are_what_compressed_tensors_writes(folders):
    config = json.loads((folders["w4a16"] / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert json.loads((folders["w8a8"] / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    mixed = json.loads((folders["mixed-bf16"] / "config.json").read_text())["quantization_config"]
    assert {g["format"] for g in mixed["config_groups"].values()} == {"pack-quantized", "naive-quantized"}


@pytest.mark.parametrize("case", CASES)
def test_weights_are_what_compressed_tensors_decompresses(folders, theirs, case):
    """Every tensor modelkit reads equals transformers' weight after compressed-tensors' decompression, bit for
    bit; the quantized ones are modelkit's QuantizedTensors where it holds them exactly."""
    ckpt = modelkit.load(folders[case])
    _, state = theirs[case]
    expected = CASES[case][4]
    quantized = {n: t for n, t in ckpt.tensors.items() if n.endswith("proj.weight")}
    assert len(quantized) == 14
    for name, tensor in ckpt.tensors.items():
        assert torch.equal(tensor.load(), state[name]), name
    if expected in ("int4", "int8", "int8-dynamic"):
        assert all(isinstance(t, QuantizedTensor) and t.scheme == expected for t in quantized.values())
    elif expected is not None:
        assert not any(isinstance(t, QuantizedTensor) for t in quantized.values())
        assert {t.dtype.name for t in quantized.values()} == {expected}
    assert set(ckpt.tensors) == {n for n in state if n.rpartition(".")[2] in ("weight", "bias")}


def test_mixed_groups_are_matched_by_name_pattern_and_class(folders):
    ckpt = modelkit.load(folders["mixed-bf16"])
    schemes = {n: (t.scheme, t.params["bits"]) if isinstance(t, QuantizedTensor) else t.dtype.name
               for n, t in ckpt.tensors.items() if n.endswith("proj.weight")}
    assert schemes["model.layers.1.self_attn.k_proj.weight"] == ("int4", 4)           # the pattern
    assert schemes["model.layers.0.mlp.down_proj.weight"] == "bfloat16"                # by name: FP8, dequantized
    assert schemes["model.layers.1.mlp.down_proj.weight"] == ("int8", 8)               # the class: W8A16
    assert schemes["model.layers.1.mlp.up_proj.weight"] == "bfloat16"                  # ignored: stored float


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(folders, theirs, case):
    logits, _ = theirs[case]
    with torch.no_grad():
        mine = instantiate(modelkit.load(folders[case]))(IDS).logits
    assert (mine.float() - logits.float()).abs().max().item() <= LOGITS_ATOL.get(case, 0.0)


def test_inspect_shows_each_group_and_how_it_is_read(folders):
    result = CliRunner().invoke(main, ["inspect", str(folders["w8a8"]), "--limit", "0"])
    assert result.exit_code == 0, result.output
    assert ("quantization group_0: int-quantized, weights int8 per channel, symmetric, inputs int8 per token, "
            "symmetric, dynamic; read: 14 as modelkit int8-dynamic (exact)") in result.output
    assert "quantization ignore: lm_head (left as stored)" in result.output
    result = CliRunner().invoke(main, ["inspect", str(folders["fp8-static"]), "--json"])
    info = json.loads(result.output)["model"]["quantization"]["groups"][0]
    assert info["read_as"] == {"float32, dequantized as compressed-tensors does": 14}
    assert info["not_applied"] == ["input activations (fp8 (e4m3) per tensor, symmetric)"]
    result = CliRunner().invoke(main, ["inspect", str(folders["mixed-bf16"]), "--limit", "0"])
    # compressed-tensors renames the groups group_0, group_1, ... as it writes them
    assert "quantization group_0: pack-quantized, weights int4 group 32, symmetric; read: 8 as modelkit int4" \
        in result.output
    assert "quantization group_1: naive-quantized, weights fp8 (e4m3) per channel, symmetric; read: 3 as " \
           "bfloat16, dequantized as compressed-tensors does" in result.output


@pytest.mark.parametrize("case", ["w4a16-asym", "w8a8", "fp8-weights"])
def test_compressed_to_compressed_keeps_the_quantized_tensors(folders, theirs, case, tmp_path):
    """Our folder of theirs: the int weights stay packed as they were (modelkit writes the same layout),
    FP8 ones are written in float; transformers loads it to the same logits."""
    out = tmp_path / "copy"
    result = CliRunner().invoke(main, ["convert", str(folders[case]), str(out)])
    assert result.exit_code == 0, result.output
    src, copy = modelkit.load(folders[case]), modelkit.load(out)
    for name, tensor in src.tensors.items():
        assert type(copy.tensors[name]) is type(tensor)
        if isinstance(tensor, QuantizedTensor):
            assert tensor.scheme == copy.tensors[name].scheme
            for part, lazy in tensor.parts.items():
                assert (lazy.array() == copy.tensors[name].parts[part].array()).all(), (name, part)
    with torch.no_grad():
        reloaded = _transformers(out, case)(IDS).logits
    assert torch.equal(reloaded, theirs[case][0])


def test_convert_to_float_safetensors_and_gguf_f16(folders, theirs, tmp_path):
    from safetensors.numpy import load_file

    runner = CliRunner()
    result = runner.invoke(main, ["convert", str(folders["w4a16"]), str(tmp_path / "f.safetensors"), "--dtype", "f32"])
    assert result.exit_code == 0, result.output
    stored = load_file(tmp_path / "f.safetensors")
    _, state = theirs["w4a16"]
    assert (stored["model.layers.0.mlp.down_proj.weight"] == state["model.layers.0.mlp.down_proj.weight"].numpy()).all()
    result = runner.invoke(main, ["convert", str(folders["fp8-dynamic"]), str(tmp_path / "f.gguf"), "--dtype", "f16"])
    assert result.exit_code == 0, result.output
    gguf = modelkit.load(tmp_path / "f.gguf")
    down = gguf.tensors["model.layers.0.mlp.down_proj.weight"].load()      # read back under Hugging Face names
    assert down.dtype == torch.float16
    assert torch.equal(down, theirs["fp8-dynamic"][1]["model.layers.0.mlp.down_proj.weight"].half())


def _edited(folders, tmp_path, case: str, edit) -> Path:
    folder = tmp_path / f"edited-{case}"
    shutil.copytree(folders[case], folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("edit, message", [
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask", "targets": ["Linear"]}),
     "sparsity format 'sparse-24-bitmask' \\(compressed-tensors\\) is not read; modelkit reads compressed-tensors' "
     "pack-quantized, int-quantized, naive-quantized, float-quantized folders"),
    (lambda q: q["config_groups"]["group_0"].update(format="marlin-24"),
     "config group 'group_0' is stored as 'marlin-24', which is not read; modelkit reads"),
    (lambda q: q["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
     "stored as 'nvfp4-pack-quantized', which is not read"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits="4"),
     "quantization_config config_groups.group_0.weights.num_bits: '4' is not an integer in 1..32"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=16),
     "config group 'group_0' has int weights of 16 bits, which are not read"),
    (lambda q: q["config_groups"]["group_0"].update(targets=["re:(a+)+$"]),
     "pattern 're:\\(a\\+\\)\\+\\$' repeats a repeated group"),
    (lambda q: q.update(ignore=["lm_head", "re:.*q_proj$"]),
     "module 'model.layers.0.self_attn.q_proj' stores quantized parts but the ignore list names it"),
    (lambda q: q.update(quantization_status="frozen"), "quantization_status 'frozen': the weights are not stored"),
    (lambda q: q.update(transform_config={"config_groups": {"u": {}}}), "compressed-tensors transforms"),
])
def test_what_cannot_be_read_is_refused_in_one_line(folders, tmp_path, edit, message):
    folder = _edited(folders, tmp_path, "w4a16", edit)
    with pytest.raises(FormatError, match=message) as info:
        modelkit.load(folder)
    assert "\n" not in str(info.value)
    result = CliRunner().invoke(main, ["convert", str(folder), str(tmp_path / "never.safetensors")])
    assert result.exit_code != 0 and not (tmp_path / "never.safetensors").exists()


def test_a_packed_weight_that_does_not_fit_its_shape_is_refused(folders, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(folders["w3a16"], folder)
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight_shape"] = torch.tensor([128, 999])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FormatError, match="down_proj: weight_packed is int32 \\[128, 24\\], weight_shape \\[128, 999\\]"):
        modelkit.load(folder)


def test_a_scale_that_does_not_fit_the_group_size_is_refused(folders, tmp_path):
    folder = _edited(folders, tmp_path, "w4a16", lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32))
    with pytest.raises(FormatError, match="down_proj: weight_scale \\[128, 2\\] does not fit a 128x256 weight "
                                          "quantized int4 group 32, symmetric"):
        modelkit.load(folder)


@pytest.mark.parametrize("case, part, value, message", [
    ("w4a16-asym", "weight_zero_point", torch.zeros(16, 3, dtype=torch.int32),
     "weight_zero_point is int32 \\[16, 3\\]; expected int32 \\[16, 2\\]"),
    ("w4a16-asym", "weight_scale", torch.ones(128, 2, dtype=torch.int32), "weight_scale is int32; expected a float"),
    ("w3a16", "weight_zero_point", torch.zeros(12, 2, dtype=torch.int32), "weight_zero_point is int32 \\[12, 2\\]"),
    ("w3a16", "weight_g_idx", torch.zeros(255, dtype=torch.int32), "weight_g_idx is int32 \\[255\\]"),
    ("w3a16", "weight_g_idx", torch.full((256,), 7, dtype=torch.int32), "weight_g_idx does not index the 2 groups"),
    ("fp8-dynamic", "weight", torch.zeros(128, 256, dtype=torch.float16), "float weights of 8 bits stored as float16"),
    ("fp8-dynamic", "weight_scale", torch.ones(128, 2), "weight_scale \\[128, 2\\] does not fit a 128x256 weight"),
])
def test_parts_that_do_not_fit_are_refused_naming_the_module(folders, tmp_path, case, part, value, message):
    """Wrong dtypes and shapes are refused before any data is read (a column order that points past the groups:
    when the weight is)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    shutil.copytree(folders[case], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors[f"model.layers.1.mlp.down_proj.{part}"] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FormatError, match="model.layers.1.mlp.down_proj: " + message):
        modelkit.load(folder).tensors["model.layers.1.mlp.down_proj.weight"].load()


def test_a_column_order_picks_each_columns_group(folders, theirs, tmp_path):
    """Older compressed-tensors releases store `weight_g_idx` (activation order "group"): column j has the scale
    of group g_idx[j]. Such weights are dequantized (modelkit's affine layout has no column order)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "g_idx"
    shutil.copytree(folders["w4a16"], folder)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj"
    in_order = torch.arange(256, dtype=torch.int32) // 128
    shuffled = in_order[torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    tensors[f"{name}.weight_g_idx"] = in_order
    tensors["model.layers.1.mlp.down_proj.weight_g_idx"] = shuffled
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    ckpt = modelkit.load(folder)
    plain = ckpt.tensors[f"{name}.weight"]
    assert not isinstance(plain, QuantizedTensor)
    assert torch.equal(plain.load(), theirs["w4a16"][1][f"{name}.weight"])       # groups in order: the same weight
    reordered = ckpt.tensors["model.layers.1.mlp.down_proj.weight"].load()
    exact = modelkit.load(folders["w4a16"]).tensors["model.layers.1.mlp.down_proj.weight"]
    scale = exact.parts["scale"].load()                                           # (128, 2)
    levels = torch.round(exact.load() / scale.repeat_interleave(128, dim=1))      # the stored integers
    assert torch.equal(reordered, levels * scale[:, shuffled.long()])


def test_quantize_to_gguf_blocks_dequantizes_with_allow_requantize(folders, theirs, tmp_path):
    """llama-quantize's rule: an already quantized folder is refused unless --allow-requantize, which reads the
    weights dequantized (as compressed-tensors computes them) and quantizes them again."""
    runner = CliRunner()
    result = runner.invoke(main, ["quantize", str(folders["w8a8"]), str(tmp_path / "q.gguf"), "--scheme", "q8_0"])
    assert result.exit_code != 0 and "already quantized (INT8-DYNAMIC)" in result.output
    result = runner.invoke(main, ["quantize", str(folders["w8a8"]), str(tmp_path / "q.gguf"), "--scheme", "q8_0",
                                  "--allow-requantize"])
    assert result.exit_code == 0, result.output
    ckpt = modelkit.load(tmp_path / "q.gguf")
    down = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, QuantizedTensor) and down.scheme == "q8_0"
    float_down = theirs["w8a8"][1]["model.layers.0.mlp.down_proj.weight"]
    assert (down.load() - float_down).abs().max().item() <= float_down.abs().max().item() / 127


def test_a_symmetric_weights_stored_zeros_are_dropped(folders, theirs, tmp_path):
    """Older compressed-tensors releases stored zero points of symmetric weights (all zeros, as the scale is
    shaped): the weight is still held exactly; a non-zero one is subtracted, as those releases did."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "zeros"
    shutil.copytree(folders["w8a8"], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight_zero_point"] = torch.zeros(128, 1, dtype=torch.int8)
    tensors["model.layers.1.mlp.down_proj.weight_zero_point"] = torch.ones(128, 1, dtype=torch.int8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    ckpt = modelkit.load(folder)
    kept, shifted = (ckpt.tensors[f"model.layers.{i}.mlp.down_proj.weight"] for i in (0, 1))
    assert isinstance(kept, QuantizedTensor) and kept.scheme == "int8-dynamic"
    assert torch.equal(kept.load(), theirs["w8a8"][1]["model.layers.0.mlp.down_proj.weight"])
    assert not isinstance(shifted, QuantizedTensor)
    exact = modelkit.load(folders["w8a8"]).tensors["model.layers.1.mlp.down_proj.weight"]
    levels, scale = exact.parts["qdata"].load().float(), exact.parts["scale"].load()
    assert torch.equal(shifted.load(), (levels - 1) * scale)


def test_a_sharded_folder_reads_the_same(folders, theirs, tmp_path):
    groups, ignore, fmt, dtype, _ = CASES["w4a16-asym"]
    _make(tmp_path / "sharded", groups, ignore, fmt, dtype, shard="150KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ckpt = modelkit.load(tmp_path / "sharded")
    state = theirs["w4a16-asym"][1]
    assert all(torch.equal(t.load(), state[n]) for n, t in ckpt.tensors.items())
    assert sum(isinstance(t, QuantizedTensor) for t in ckpt.tensors.values()) == 14
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "sharded"), "--limit", "0"])
    assert "read: 14 as modelkit int4 (exact)" in result.output


@pytest.mark.parametrize("case", ["w4a16", "fp8-weights"])
def test_generate_continues_as_transformers_does(folders, case):
    """Greedy decoding with the folder's tokenizer: modelkit's tokens are transformers' tokens."""
    from transformers import AutoTokenizer

    from modelkit.api import complete

    ours = complete(folders[case], "def main", max_new_tokens=8)
    ids = AutoTokenizer.from_pretrained(folders[case])("def main", return_tensors="pt").input_ids
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _transformers(folders[case], case).generate(ids, max_new_tokens=8, do_sample=False)
    assert ours.token_ids == theirs[0, ids.shape[1]:].tolist()


def test_kv_cache_scales_are_dropped_and_said_so(folders, theirs, tmp_path):
    """A kv_cache_scheme's k_scale / v_scale (on the attention modules) are not weights: dropped, and inspect says
    the KV cache quantization is not applied."""
    from safetensors.torch import load_file, save_file

    folder = _edited(folders, tmp_path, "w4a16", lambda q: q.update(kv_cache_scheme={
        "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}))
    tensors = load_file(folder / "model.safetensors")
    for layer in range(2):
        for name in ("k_scale", "v_scale"):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor([0.05])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    ckpt = modelkit.load(folder)
    assert set(ckpt.tensors) == set(modelkit.load(folders["w4a16"]).tensors)
    result = CliRunner().invoke(main, ["inspect", str(folder), "--limit", "0"])
    assert "quantization kv cache: (fp8 (e4m3) per tensor, symmetric) not applied (modelkit runs it in float)" \
        in result.output


@pytest.mark.parametrize("weights, strategy, group, block, actorder", [
    ({"num_bits": 4, "group_size": 128}, "group", 128, None, None),                    # strategy inferred
    ({"num_bits": 8, "group_size": -1}, "channel", None, None, None),
    ({"num_bits": 8}, "tensor", None, None, None),
    ({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": "128x64"}, "block", None, (128, 64), None),
    ({"num_bits": 4, "strategy": "group", "group_size": 32, "actorder": True}, "group", 32, None, "group"),
])
def test_older_releases_configs_parse(weights, strategy, group, block, actorder):
    """Fields older compressed-tensors releases wrote differently: no strategy, group_size -1, "NxM" blocks,
    actorder true."""
    from modelkit.parse import compressed_tensors as ct_parse

    config = ct_parse.parse({"quant_method": "compressed-tensors", "format": "pack-quantized",
                             "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}, source="c")
    args = config.groups[0].weights
    assert (args.strategy, args.group_size, args.block_structure, args.actorder) == (strategy, group, block, actorder)
    assert config.status == "compressed" and config.groups[0].format == "pack-quantized"


@pytest.mark.parametrize("bits", range(1, 9))
def test_unpack_reads_compressed_tensors_packing_of_every_width(bits):
    """compressed-tensors packs 1-8 bit values densely (values straddle words for 3, 5, 6, 7 bits)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from modelkit.storage.compressed_tensors_read import unpack

    for cols in (100, 256):
        values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (8, cols), dtype=torch.int8,
                               generator=torch.Generator().manual_seed(bits))
        assert (unpack(pack_to_int32(values, bits).numpy(), bits, cols) == values.numpy()).all()


def test_scan_passes_the_folder(folders):
    """The folder holds safetensors and JSON only: clean, nothing read as code."""
    result = CliRunner().invoke(main, ["scan", str(folders["w8a8"])])
    assert result.exit_code == 0, result.output
    assert "0 dangerous, 0 suspicious" in result.output
