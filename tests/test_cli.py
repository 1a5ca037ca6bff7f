"""The command line: --help everywhere, exit codes, one JSON document per --json run, clear errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from modelkit.cli import COMMANDS, EXIT_ERROR, EXIT_OK, main


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help_with_examples(runner, command):
    result = runner.invoke(main, [command, "--help"])
    assert result.exit_code == EXIT_OK, result.output
    assert "Example" in result.stdout and f"modelkit {command}" in result.stdout


def test_group_help_lists_every_command(runner):
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == EXIT_OK
    for command in COMMANDS:
        assert command in result.stdout


def test_inspect_human_and_json(runner, trained_mlp):
    human = runner.invoke(main, ["inspect", str(trained_mlp)])
    assert human.exit_code == EXIT_OK, human.output
    assert "safetensors" in human.stdout and "net.0.weight" in human.stdout and "752 parameters" in human.stdout
    assert "arch: mlp" in human.stdout and "metrics test: accuracy" in human.stdout
    result = runner.invoke(main, ["inspect", str(trained_mlp), "--json"])
    assert result.exit_code == EXIT_OK
    doc = json.loads(result.stdout)
    assert doc["schema"] == "modelkit.inspect/1" and doc["ok"] is True
    assert doc["format"] == "safetensors" and doc["parameters"] == 752
    assert doc["arch"]["name"] == "mlp"
    shapes = {t["name"]: t["shape"] for t in doc["tensors"]}
    assert shapes["net.0.weight"] == [30, 2] and shapes["net.4.bias"] == [2]
    assert sum(t["nbytes"] for t in doc["tensors"]) == doc["tensor_bytes"] == 752 * 4


def test_inspect_does_not_read_tensor_data(runner, tmp_path, monkeypatch, trained_mlp):
    from modelkit.storage import safetensors_files

    def refuse(*args, **kwargs):
        raise AssertionError("inspect read tensor data")

    monkeypatch.setattr(safetensors_files._File, "get", refuse)
    result = runner.invoke(main, ["inspect", str(trained_mlp), "--json"])
    assert result.exit_code == EXIT_OK, result.output


def test_eval_json(runner, trained_mlp):
    result = runner.invoke(main, ["eval", str(trained_mlp), "--json"])
    assert result.exit_code == EXIT_OK, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "modelkit.eval/1" and doc["split"] == "test" and 0 <= doc["accuracy"] <= 1


def test_eval_runs_an_onnx_file_in_onnxruntime(runner, trained_mlp, tmp_path):
    onnx_path = tmp_path / "mlp.onnx"
    assert runner.invoke(main, ["convert", str(trained_mlp), str(onnx_path)]).exit_code == EXIT_OK
    torch_run = json.loads(runner.invoke(main, ["eval", str(trained_mlp), "--json"]).stdout)
    result = runner.invoke(main, ["eval", str(onnx_path), "--runtime", "onnxruntime", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    assert json.loads(result.stdout)["accuracy"] == pytest.approx(torch_run["accuracy"], abs=1e-9)
    refused = runner.invoke(main, ["eval", str(trained_mlp), "--runtime", "onnxruntime"])
    assert refused.exit_code == EXIT_ERROR and "needs an ONNX file" in refused.output


def test_eval_tinylm_reports_bits_per_byte_and_the_baseline(runner, trained_tinylm):
    result = runner.invoke(main, ["eval", str(trained_tinylm)])
    assert result.exit_code == EXIT_OK, result.output
    assert "tinylm on val: bits/byte" in result.stdout and "unigram" in result.stdout and "perplexity" in result.stdout


def test_generate_prints_prompt_and_continuation(runner, trained_tinylm):
    result = runner.invoke(main, ["generate", str(trained_tinylm), "--prompt", "def ", "--max-bytes", "30", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    doc = json.loads(result.stdout)
    assert doc["prompt"] == "def " and len(doc["completion"].encode("utf-8", "surrogateescape")) >= 1


def test_generate_refuses_a_classifier(runner, trained_mlp):
    result = runner.invoke(main, ["generate", str(trained_mlp)])
    assert result.exit_code == EXIT_ERROR
    assert "needs a tinylm checkpoint" in result.stderr


def test_train_json_is_one_document(runner, tmp_path):
    result = runner.invoke(main, ["train", "mlp", "--out", str(tmp_path / "run"), "--epochs", "2", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "modelkit.train/1" and doc["model"] == "mlp" and len(doc["history"]) == 2


def test_train_prints_progress_lines_on_stderr(runner, tmp_path):
    result = runner.invoke(main, ["train", "mlp", "--out", str(tmp_path / "run"), "--epochs", "2"])
    assert result.exit_code == EXIT_OK
    assert "train mlp:" in result.stderr and "loss" in result.stderr and "epoch 2:" in result.stderr
    assert "saved" in result.stdout and "test: accuracy" in result.stdout


def test_train_model_config_via_set(runner, tmp_path):
    result = runner.invoke(main, ["-q", "train", "mlp", "--out", str(tmp_path / "run"), "--epochs", "1",
                                  "--set", "hidden=[8,4]", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    inspected = json.loads(runner.invoke(main, ["inspect", json.loads(result.stdout)["path"], "--json"]).stdout)
    assert inspected["arch"]["config"]["hidden"] == [8, 4]


@pytest.mark.parametrize("args, message", [
    (["inspect", "{missing}"], "no such file"),
    (["inspect", "{text}"], "it looks like text; known formats:"),
    (["eval", "{text}", "--arch", "mlp"], "looks like text"),
    (["train", "mlp", "--out", "{tmp}/r", "--set", "hidn=[3]"], "did you mean 'hidden'"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_2(runner, tmp_path, args, message):
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    args = [a.format(missing=tmp_path / "nope.safetensors", text=text, tmp=tmp_path) for a in args]
    result = runner.invoke(main, args)
    assert result.exit_code == EXIT_ERROR
    assert result.stdout == ""
    assert result.stderr.startswith("Error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_errors_are_json_documents_with_json(runner, tmp_path):
    result = runner.invoke(main, ["inspect", str(tmp_path / "nope.safetensors"), "--json"])
    assert result.exit_code == EXIT_ERROR
    doc = json.loads(result.stdout)
    assert doc == {"schema": "modelkit.error/1", "ok": False,
                   "error": {"type": "FormatError", "message": f"{tmp_path / 'nope.safetensors'}: no such file or folder"}}


def test_existing_run_without_force_is_an_error(runner, trained_mlp):
    result = runner.invoke(main, ["train", "mlp", "--out", str(trained_mlp.parent)])
    assert result.exit_code == EXIT_ERROR and "--force" in result.stderr


def test_a_misspelled_choice_is_a_usage_error_with_did_you_mean(runner, tmp_path):
    # Choices come from the tables (FORMATS here), so click checks them; the message still suggests.
    result = runner.invoke(main, ["inspect", str(tmp_path), "--format", "safetensor"])
    assert result.exit_code == EXIT_ERROR and result.stdout == ""
    assert "did you mean 'safetensors'" in result.stderr and "Traceback" not in result.stderr


def test_usage_errors_exit_2(runner):
    assert runner.invoke(main, ["train", "resnet", "--out", "x"]).exit_code == EXIT_ERROR
    assert runner.invoke(main, ["frobnicate"]).exit_code == EXIT_ERROR


def test_debug_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "nope.safetensors")
    plain = subprocess.run([sys.executable, "-m", "modelkit", "inspect", missing], capture_output=True, text=True)
    debug = subprocess.run([sys.executable, "-m", "modelkit", "inspect", missing], capture_output=True, text=True,
                           env={**__import__("os").environ, "MODELKIT_DEBUG": "1"})
    assert plain.returncode == debug.returncode == EXIT_ERROR
    assert "Traceback" not in plain.stderr and "Traceback" in debug.stderr
    flag = subprocess.run([sys.executable, "-m", "modelkit", "--debug", "inspect", missing], capture_output=True, text=True)
    assert "Traceback" in flag.stderr


def test_models_lists_the_zoo(runner):
    doc = json.loads(runner.invoke(main, ["models", "--json"]).stdout)
    assert [m["name"] for m in doc["models"] if m["kind"] == "zoo"] == ["cnn", "mlp", "tinylm"]
    families = {m["name"]: m for m in doc["models"] if m["kind"] == "hf"}
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2"} <= set(families)
    assert families["gemma3"]["model_types"] == ["gemma3_text", "gemma3"] and families["mistral"]["gguf_architecture"] == "llama"
