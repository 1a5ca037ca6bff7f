"""torch.export programs (.pt2): written from the zoo, users' modules and Hugging Face causal LMs with dynamic
shapes; read without torch; run by torch.export.load behind the scanner's gate (docs/formats/pt2.md)."""
from __future__ import annotations

import json
import zipfile

import pytest
import torch
import transformers
from click.testing import CliRunner

import modelkit
from modelkit.checkpoint import Checkpoint
from modelkit.cli import main
from modelkit.errors import UnsafeFileError, UnsupportedConversionError
from modelkit.formats import ReadOptions, WriteOptions, detect_format, load_format
from modelkit.models import load_model_module
from modelkit.scan import scan
from modelkit.testing import causal_lm, payloads

pt2 = load_format("pt2")
# Largest |eager - torch.export.load(...).module()| on the zoo models and the user module below, float32 CPU,
# measured 2026-11-25 (torch 2.13.0+cpu), batch 1/3/5 and seeds 0-2: 0.0 (the program runs eager's ATen
# kernels in eager's order).
ATOL = 0.0
SMALL = ("mlp", "cnn", "tinylm")


class TwoInputs(torch.nn.Module):
    """A user's module: two inputs, BatchNorm, a buffer and a plain tensor attribute (a lifted constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(3, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))
        self.offset = torch.tensor([0.25])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x)).mean(-1) * self.scale + y + self.offset


@pytest.fixture(scope="session")
def user_pt2(tmp_path_factory):
    torch.manual_seed(0)
    model = TwoInputs().eval()
    model.norm.running_mean.uniform_(-1, 1)
    path = tmp_path_factory.mktemp("user") / "user.pt2"
    report = modelkit.export(model, path, example_inputs={"x": torch.randn(2, 3, 5), "y": torch.randn(2, 4)},
                             dynamic={"x": [0, 2], "y": [0]})
    return model, path, report


@pytest.fixture(scope="session")
def llama_pt2(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("llama") / "llama.pt2"
    report = modelkit.export(model, path)
    return model, path, report


@pytest.mark.parametrize("name", sorted(SMALL))
def test_zoo_round_trip_runs_in_torch_export_load(zoo_pt2, name):
    model, path = zoo_pt2[name]
    assert detect_format(path) == "pt2"
    back = modelkit.load(path)
    assert back.arch.name == name and back.metadata["note"] == name
    state = back.materialize()
    assert list(state) == list(model.state_dict())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    program = torch.export.load(str(path)).module()               # torch's own loader, not ours
    make = load_model_module(name).example_inputs
    for seed, batch in ((0, 1), (1, 3), (2, 5)):                  # batch is dynamic
        assert modelkit.assert_same_outputs(model, program, make(batch, seed=seed), atol=ATOL) <= ATOL


def test_user_module_round_trip_with_dynamic_axes(user_pt2):
    model, path, report = user_pt2
    assert report.verify["method"] == "outputs" and report.verify["max_abs_err"] <= ATOL
    program = torch.export.load(str(path)).module()
    for batch, length in ((1, 5), (4, 9)):
        inputs = (torch.randn(batch, 3, length), torch.randn(batch, 4))
        modelkit.assert_same_outputs(model, program, inputs, atol=ATOL)
    state = modelkit.load(path).materialize()
    assert sorted(state) == sorted(model.state_dict())            # the lifted constant is not in the state_dict
    info = pt2.program(path)
    assert [i["name"] for i in info["inputs"]] == ["x", "y"] and info["constants"] == 1
    assert info["inputs"][0]["shape"] == ["x_0", 3, "x_2"]           # unnamed free axes named as ONNX names them
    assert not scan(path).findings


def test_hf_causal_lm_exports_with_dynamic_batch_and_sequence(llama_pt2):
    model, path, report = llama_pt2
    assert report.verify["passed"] and report.verify["max_abs_err"] <= 1e-5
    info = pt2.program(path)
    assert [i["name"] for i in info["inputs"]] == list(causal_lm.INPUT_NAMES)
    assert all(i["shape"] == ["batch", "sequence"] for i in info["inputs"]), info["inputs"]
    assert {"batch", "sequence"} <= set(info["dynamic"])
    program = torch.export.load(str(path)).module()
    for batch, length in ((1, 5), (3, 12)):
        ids, mask, positions = causal_lm.token_batch(320, batch, length, seed=batch)
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = program(ids, mask, positions)
        keep = mask.bool()
        assert torch.allclose(got[keep], want[keep], atol=1e-5, rtol=0)
    assert not scan(path).findings
    back = modelkit.load(path)
    assert json.loads(back.metadata["modelkit.aliases"]) == {"lm_head.weight": "model.embed_tokens.weight"}


def test_weights_read_without_torch_export_or_unpickling(zoo_pt2, monkeypatch):
    model, path = zoo_pt2["mlp"]

    def refuse(*args, **kwargs):
        raise AssertionError("reading weights must not load the program or unpickle")

    monkeypatch.setattr(torch.export, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    state = modelkit.load(path).materialize()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    rebuilt = modelkit.load_module(path)
    modelkit.assert_same_outputs(model, rebuilt, load_model_module("mlp").example_inputs(2))


def test_foreign_archive_reads_weights_and_constants(user_pt2, tmp_path):
    model, _, _ = user_pt2
    program = torch.export.export(model, (torch.randn(2, 3, 5), torch.randn(2, 4)))
    torch.export.save(program, tmp_path / "plain.pt2")
    back = modelkit.load(tmp_path / "plain.pt2")
    assert back.arch is None
    assert set(back.tensors) == set(model.state_dict()) | {"offset"}
    assert torch.equal(back.tensors["offset"].load(), model.offset)


def test_inspect_shows_the_program(zoo_pt2):
    _, path = zoo_pt2["tinylm"]
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    assert "input_ids" in result.output and "[batch, sequence]" in result.output
    assert "dynamic sequence: " in result.output and ".. 64" in result.output
    data = json.loads(CliRunner().invoke(main, ["inspect", str(path), "--json"]).output)
    assert data["program"]["inputs"][0]["shape"] == ["batch", "sequence"]


def test_runnable_is_behind_the_gate(tmp_path):
    path = tmp_path / "evil.pt2"
    path.write_bytes(payloads.pt2_zip(nodes=["torch.os.system"]))
    with pytest.raises(UnsafeFileError, match="pt2.target.dangerous"):
        pt2.runnable(path, ReadOptions(trust=True))
    with pytest.raises(UnsafeFileError):
        modelkit.load(path)


def test_kv_cache_is_an_onnx_option(zoo_pt2, tmp_path):
    model, _ = zoo_pt2["tinylm"]
    with pytest.raises(UnsupportedConversionError, match="ONNX option"):
        pt2.write(Checkpoint.from_module(model), tmp_path / "kv.pt2", WriteOptions(module=model, kv_cache=True))


def test_archive_layout_is_torchs(zoo_pt2, tmp_path):
    _, path = zoo_pt2["cnn"]
    renamed = tmp_path / "model.pt"                                  # .pt is claimed by pth and torchscript too
    renamed.write_bytes(path.read_bytes())
    assert detect_format(renamed) == "pt2"
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        root = names[0].split("/")[0]
        assert z.read(f"{root}/archive_format") == b"pt2"
        info = json.loads(z.read(f"{root}/extra/modelkit.json"))
    assert info["format"] == "modelkit.pt2/1" and info["state_dict"] == list(zoo_pt2["cnn"][0].state_dict())


def test_weights_and_program_without_torch(zoo_pt2, tmp_path):
    """Reading a .pt2 needs no torch: convert to safetensors and inspect with torch unimportable."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    model, path = zoo_pt2["cnn"]
    code = ("import sys\nsys.modules['torch'] = None\nfrom modelkit.cli import run\n"
            f"run(['convert', {str(path)!r}, 'out.safetensors'])\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    got = load_file(str(tmp_path / "out.safetensors"))
    assert got.keys() == model.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
