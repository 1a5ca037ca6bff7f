"""Hugging Face causal LMs to ONNX: dynamic batch and sequence axes, logits (and a KV-cache variant)
checked in onnxruntime against transformers' own forward (docs/formats/onnx.md, "Hugging Face causal LMs")."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers
from click.testing import CliRunner
from torch import nn

import modelkit
from modelkit.checkpoint import ARCH_KEY, Checkpoint
from modelkit.cli import EXIT_ERROR, main
from modelkit.errors import ConfigError, UnsupportedConversionError, VerificationError
from modelkit.formats import WriteOptions, load_format
from modelkit.models import arch_spec, build
from modelkit.pipeline.measure import session_module
from modelkit.pipeline.verify import verify_graph
from modelkit.pipeline.write import write_checkpoint
from modelkit.testing import causal_lm

# Largest |onnxruntime - transformers| / max |logit| accepted, float32, CPU execution provider.
# Measured 2026-11-25 (torch 2.13.0, transformers 5.23.0, onnxruntime 1.32.0, opset 20) over the
# prompts below at both lengths and batch sizes: llama 3.1e-07, qwen2 3.8e-07; the KV-cache prefill
# and decode steps (llama): 3.1e-07; verification's own check inputs: llama 3.1e-07, qwen2 2.8e-07.
# The bar is 1e-4 (issue 14); only the summation order of kernels differs.
RTOL = 1e-4
PROMPTS = [b"def main():\n    return 0", b"import os\nprint(os.getcwd())", b"The quick brown fox jumps"]
LENGTHS = (8, 24)          # 8 cuts every prompt; 24 left-pads every one of them
BATCHES = ((0,), (0, 1, 2))  # the prompts fed one alone and all three together


def _tiny(family: str, *, tied: bool = False) -> nn.Module:
    """hidden 64, 2 layers, vocab 320, seeded random weights, eval mode: transformers' own classes."""
    torch.manual_seed(0)
    shape = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape)).eval()
    raise AssertionError(family)


def _prompts(rows: tuple[int, ...], length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Byte ids of the prompts, cut to their last `length` bytes or left-padded (id 0, mask 0) to it."""
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for row, index in enumerate(rows):
        tokens = list(PROMPTS[index][-length:])
        ids[row, length - len(tokens):] = torch.tensor(tokens)
        mask[row, length - len(tokens):] = 1
    return ids, mask, causal_lm.position_ids(mask)


def _relative(got: np.ndarray, want: torch.Tensor, keep: torch.Tensor) -> float:
    """max |got - want| / max |want| over the positions the attention mask keeps."""
    want = want.detach().numpy()[keep.bool().numpy()]
    return float(np.abs(got[keep.bool().numpy()] - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Each family exported once through modelkit.export, verified on the way (verify compares logits):
    llama with the prompts as example inputs, added to the check; qwen2 with none, the converter's own."""
    files = {}

    def export(family: str) -> tuple[nn.Module, object, dict]:
        if family not in files:
            model = _tiny(family)
            path = tmp_path_factory.mktemp(family) / f"{family}.onnx"
            given = _prompts((0, 1, 2), LENGTHS[1])[:2] if family == "llama" else None
            report = modelkit.export(model, path, example_inputs=given)
            files[family] = model, path, report.verify
        return files[family]

    return export


@pytest.fixture(scope="module")
def exported_kv(tmp_path_factory):
    """llama with kv_cache, through the write path with no example inputs (the converter makes its own);
    its output head tied to the embedding and stored once, as a Hugging Face folder stores it."""
    model = _tiny("llama", tied=True)
    path = tmp_path_factory.mktemp("kv") / "llama-kv.onnx"
    ckpt = Checkpoint.from_module(model)
    ckpt = Checkpoint({n: t for n, t in ckpt.tensors.items() if n != "lm_head.weight"}, {}, None)
    result, _ = write_checkpoint(ckpt, path, "onnx", WriteOptions(module=model, final_path=path, kv_cache=True),
                                 force=False, module=model)
    return model, path, result


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_export_verifies_logits_and_declares_dynamic_axes(exported, family):
    model, path, verify = exported(family)
    assert verify["passed"] and verify["weights"] == "bit-exact"
    assert verify["inputs"] == len(causal_lm.CHECK_SHAPES) + (family == "llama") and verify["max_relative_err"] <= RTOL
    graph = onnx.load(str(path)).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*graph.input, *graph.output]}
    assert dims == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"],
                    "position_ids": ["batch", "sequence"], "logits": ["batch", "sequence", 320]}
    assert {i.name: i.type.tensor_type.elem_type for i in graph.input} == dict.fromkeys(causal_lm.INPUT_NAMES, onnx.TensorProto.INT64)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("rows", BATCHES, ids=lambda rows: f"batch{len(rows)}")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_onnxruntime_logits_match_transformers(exported, family, rows, length):
    model, path, _ = exported(family)
    run = load_format("onnx").runnable(path)
    ids, mask, positions = _prompts(rows, length)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    got = run(ids, mask, positions).numpy()
    assert got.shape == (len(rows), length, 320)
    assert _relative(got, want, mask) <= RTOL


def test_kv_cache_decode_steps_match_a_full_forward(exported_kv):
    model, path, verify = exported_kv
    assert verify["passed"] and verify["inputs"] == 2 * len(causal_lm.CHECK_SHAPES)
    assert verify["tensors_checked"] == len(model.state_dict()) - 1        # lm_head.weight is embed_tokens.weight
    session = load_format("onnx").runnable(path).session
    names = [i.name for i in session.get_inputs()]
    assert names == causal_lm.input_names(2, kv_cache=True)
    assert [o.name for o in session.get_outputs()] == causal_lm.output_names(2, kv_cache=True)
    assert names[3:5] == ["past_key_values.0.key", "past_key_values.0.value"]
    ids, mask, positions = _prompts((0, 1, 2), LENGTHS[1])
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    steps = 2                                   # prefill all but the last two tokens, then one token at a time
    prefill = ids.shape[1] - steps
    empty = np.zeros((3, 2, 0, 16), np.float32)   # [batch, kv_heads, past 0, head_dim]
    feeds = {"input_ids": ids[:, :prefill].numpy(), "attention_mask": mask[:, :prefill].numpy(),
             "position_ids": positions[:, :prefill].numpy(), **{n: empty for n in names[3:]}}
    outputs = session.run(None, feeds)
    assert _relative(outputs[0], full[:, :prefill], mask[:, :prefill]) <= RTOL
    for step in range(prefill, ids.shape[1]):
        feeds = {"input_ids": ids[:, step:step + 1].numpy(), "attention_mask": mask[:, :step + 1].numpy(),
                 "position_ids": positions[:, step:step + 1].numpy(), **dict(zip(names[3:], outputs[1:], strict=True))}
        outputs = session.run(None, feeds)
        assert outputs[1].shape == (3, 2, step + 1, 16)      # present = past + this token
        assert _relative(outputs[0][:, -1], full[:, step], torch.ones(3, dtype=torch.long)) <= RTOL


def test_causal_lms_are_recognised_by_config_and_forward():
    assert causal_lm.is_causal_lm(_tiny("llama"))
    assert not causal_lm.is_causal_lm(build("tinylm", seed=0))        # a Llama of ours: forward(input_ids) only
    assert not causal_lm.is_causal_lm(nn.Linear(2, 2))


def test_kv_cache_needs_a_causal_lm(tmp_path):
    mlp = build("mlp", seed=0)
    with pytest.raises(UnsupportedConversionError, match="kv_cache applies to Hugging Face causal LMs"):
        write_checkpoint(Checkpoint.from_module(mlp), tmp_path / "m.onnx", "onnx",
                         WriteOptions(module=mlp, final_path=tmp_path / "m.onnx", kv_cache=True), force=False, module=mlp)
    assert not (tmp_path / "m.onnx").exists()


def test_verification_compares_kept_positions_and_nothing_else():
    """The check ignores logits at padded positions and catches an error of 1e-3 anywhere else."""
    model = _tiny("llama")
    graph = causal_lm.CausalLMGraph(model)

    def padding_differs(ids, mask, positions):
        with torch.no_grad():
            return graph(ids, mask, positions) + 5.0 * (1 - mask)[..., None]

    def off(ids, mask, positions):
        with torch.no_grad():
            return graph(ids, mask, positions) + 1e-3

    assert verify_graph(model, padding_differs, "onnx", WriteOptions(), label="x")["max_abs_err"] == 0.0
    with pytest.raises(VerificationError, match="outputs differ"):
        verify_graph(model, off, "onnx", WriteOptions(), label="x")


@pytest.mark.parametrize(("dynamic", "names"), [({"input_ids": [0]}, None), (None, ("ids",))])
def test_a_causal_lm_signature_is_fixed(tmp_path, dynamic, names):
    """Input names and dynamic axes of a causal LM graph are the contract's; others are refused before export."""
    model = _tiny("llama")
    ids, mask, _ = _prompts((0, 1), 8)
    options = WriteOptions(module=model, example_inputs=(ids, mask), input_names=names, dynamic_axes=dynamic,
                           final_path=tmp_path / "m.onnx")
    with pytest.raises(ConfigError, match="a causal LM's graph"):
        write_checkpoint(Checkpoint.from_module(model), tmp_path / "m.onnx", "onnx", options, force=False, module=model)
    assert not (tmp_path / "m.onnx").exists()


# ------------------------------------------------------------------ modelkit eval of an export (onnxruntime)

# bits per byte of the export in onnxruntime against the folder in torch (`modelkit eval FOLDER`), relative:
# measured 2026-11-28 on the text below, 300 tokens (2 windows of 128, 1 of 44) and all 2566 (21 windows of 128):
# llama 7.1e-8 and 6.6e-8, its KV-cache export the same, qwen2 0 (logits within 1.8e-7); pinned with headroom.
EVAL_RTOL = 1e-6
EVAL_TEXT = Path(json.__file__).read_text(encoding="utf-8")[:4000]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A byte-level BPE tokenizer of 320 ids (the tiny models' vocabulary), trained offline on the evaluation
    text, BOS <s>, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([EVAL_TEXT], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    folder = tmp_path_factory.mktemp("tokenizer")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>").save_pretrained(folder)
    return folder


def _copy(onnx_path: Path, model: nn.Module, folder: Path, tokenizer_files: Path | None = None) -> Path:
    """A copy of the export in `folder`, with the ArchSpec `modelkit convert FOLDER x.onnx` records (the KV-cache
    fixture is written without one) and, given `tokenizer_files`, the tokenizer files next to it."""
    folder.mkdir()
    graph = onnx.load(str(onnx_path))
    graph.metadata_props.append(onnx.StringStringEntryProto(key=ARCH_KEY, value=arch_spec(model).to_json()))
    onnx.save(graph, str(folder / onnx_path.name))
    for f in ("tokenizer.json", "tokenizer_config.json") if tokenizer_files else ():
        shutil.copy(tokenizer_files / f, folder / f)
    return folder / onnx_path.name


@pytest.mark.parametrize("which", ["plain", "kv"])
def test_eval_of_an_export_in_onnxruntime_equals_eval_of_the_folder(exported, exported_kv, tokenizer_files, tmp_path,
                                                                     which):
    model, path, _ = exported("llama") if which == "plain" else exported_kv
    folder = tmp_path / "folder"
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_files / f, folder / f)
    data = tmp_path / "text.txt"
    data.write_text(EVAL_TEXT, encoding="utf-8")
    kwargs = dict(data=data, context=128, max_tokens=300)
    want = modelkit.evaluate(folder, **kwargs)
    beside, lone = _copy(path, model, tmp_path / "beside", tokenizer_files), _copy(path, model, tmp_path / "lone")
    for got in (modelkit.evaluate(beside, runtime="onnxruntime", **kwargs),           # the files next to it
                modelkit.evaluate(lone, runtime="onnxruntime", tokenizer=folder, **kwargs)):   # --tokenizer
        assert (got["model"], got["tokens"], got["bytes"], got["windows"]) == ("llama", 300, want["bytes"], 3)
        assert got["bits_per_byte"] == pytest.approx(want["bits_per_byte"], rel=EVAL_RTOL)
    if which == "plain":        # the torch runtime, rebuilt from the export's weights, finds the files too
        assert modelkit.evaluate(beside, **kwargs)["bits_per_byte"] == pytest.approx(want["bits_per_byte"], rel=EVAL_RTOL)


def test_eval_of_an_export_without_its_tokenizer_says_where_it_looked(exported, tmp_path):
    model, path, _ = exported("llama")
    lone = _copy(path, model, tmp_path / "lone")
    for runtime in ("onnxruntime", "torch"):
        with pytest.raises(ConfigError, match="no tokenizer.json or tokenizer.model") as e:
            modelkit.evaluate(lone, runtime=runtime, max_tokens=10)
        assert "\n" not in str(e.value) and "--tokenizer FOLDER" in str(e.value)
    with pytest.raises(ConfigError, match=f"--tokenizer {tmp_path} has no tokenizer.json"):
        modelkit.evaluate(lone, runtime="onnxruntime", tokenizer=tmp_path, max_tokens=10)
    result = CliRunner().invoke(main, ["eval", str(lone), "--runtime", "onnxruntime", "--max-tokens", "10"])
    assert result.exit_code == EXIT_ERROR and len(result.stderr.strip().splitlines()) == 1
    assert "next to it" in result.stderr and "--tokenizer FOLDER" in result.stderr
    with pytest.raises(UnsupportedConversionError, match="runs in onnxruntime .* or in torch; not in OpenVINO"):
        session_module(tmp_path / "lm.xml", arch_spec(model), fmt="openvino")
