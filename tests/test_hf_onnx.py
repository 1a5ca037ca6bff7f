"""Hugging Face causal LMs to ONNX: dynamic batch and sequence axes, logits (and a KV-cache variant)
checked in onnxruntime against transformers' own forward (docs/formats/onnx.md, "Hugging Face causal LMs")."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import transformers
from torch import nn

import modelkit
from modelkit.checkpoint import Checkpoint
from modelkit.errors import ConfigError, UnsupportedConversionError, VerificationError
from modelkit.formats import WriteOptions, load_format
from modelkit.models import build
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
