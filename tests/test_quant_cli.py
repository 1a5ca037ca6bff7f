"""`modelkit quantize`: one JSON document, the report table, comparison runs, --plot, ONNX input, errors."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from modelkit.cli import EXIT_ERROR, EXIT_OK, main


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="module")
def small_cnn(tmp_path_factory):
    """A small cnn trained for a few steps, saved as safetensors."""
    from modelkit.pipeline.train import TrainConfig, train

    out = tmp_path_factory.mktemp("cnn")
    return train("cnn", out, config=TrainConfig(epochs=1, steps_per_epoch=10, seed=0, device="cpu"),
                 model_config={"channels": [4, 8], "hidden": 32}).path


def test_one_scheme_json(runner, small_cnn, tmp_path):
    out = tmp_path / "q.safetensors"
    result = runner.invoke(main, ["quantize", str(small_cnn), str(out), "--scheme", "int8", "--eval", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "modelkit.quantize/1" and doc["ok"] is True
    (report,) = doc["reports"]
    assert report["scheme"] == "int8" and report["target"]["bytes"] == out.stat().st_size
    assert report["size_ratio"] < 0.45 and report["stats"]["bits_per_weight"] < 10      # tiny model: header weighs in
    assert report["metric"]["name"] == "accuracy" and abs(report["metric"]["delta"]) <= 0.02
    assert set(report["latency_ms"]["quantized"]) == {"batch_1", "batch_64"}
    assert report["verify"]["rebuilt_outputs"] == "identical"
    evaluated = runner.invoke(main, ["eval", str(out), "--json"])
    assert evaluated.exit_code == EXIT_OK, evaluated.output
    assert json.loads(evaluated.stdout)["accuracy"] == pytest.approx(report["metric"]["quantized"])


def test_comparison_table_and_plot(runner, small_cnn, tmp_path):
    plot = tmp_path / "q.png"
    result = runner.invoke(main, ["quantize", str(small_cnn), str(tmp_path / "out"), "--scheme", "int8,q4_0",
                                  "--scheme", "fp16", "--eval", "--plot", str(plot)])
    assert result.exit_code == EXIT_OK, result.output
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("scheme"))
    for column in ("bits/w", "file", "ratio", "accuracy float", "quantized", "delta", "ms b1", "ms b64", "quantize s"):
        assert column in header
    assert [line.split()[0] for line in lines if line.split() and line.split()[0] in ("int8", "q4_0", "fp16")] \
        == ["int8", "q4_0", "fp16"]
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"int8.safetensors", "q4_0.safetensors", "fp16.safetensors"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_comparison_runs_show_progress_per_scheme(runner, small_cnn, tmp_path):
    result = runner.invoke(main, ["quantize", str(small_cnn), str(tmp_path / "out"), "--scheme", "int8,fp16"])
    assert result.exit_code == EXIT_OK, result.output
    assert [line for line in result.stderr.splitlines() if line.startswith("schemes")] == ["schemes: 1/2", "schemes: 2/2"]
    quiet = runner.invoke(main, ["quantize", str(small_cnn), str(tmp_path / "out"), "--scheme", "int8,fp16",
                                 "--force", "--json"])
    assert quiet.exit_code == EXIT_OK and "schemes" not in quiet.stderr


def test_gguf_output(runner, small_cnn, tmp_path):
    out = tmp_path / "q.gguf"
    result = runner.invoke(main, ["quantize", str(small_cnn), str(out), "--scheme", "q8_0", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    assert json.loads(result.stdout)["reports"][0]["target"]["format"] == "gguf"
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert types["fc1.weight"] == "Q8_0" and types["fc1.bias"] == "F32"


def test_qat_from_the_command_line(runner, small_cnn, tmp_path):
    result = runner.invoke(main, ["quantize", str(small_cnn), str(tmp_path / "q.safetensors"), "--scheme", "int4",
                                  "--qat", "--epochs", "1", "--steps", "2", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    report = json.loads(result.stdout)["reports"][0]
    assert report["scheme"] == "int4" and report["notes"][0].startswith("QAT: 1 epoch")


@pytest.mark.parametrize("args,message", [
    (["--scheme", "int3"], "unknown quantization scheme 'int3'"),
    (["--scheme", "int8", "--group-size", "64"], "unknown option 'group_size'"),
    (["--scheme", "int4", "--group-size", "48"], "group_size must be one of"),
    (["--scheme", "gptq", "--qat"], "QAT trains int8, int4 or int8-dynamic"),
])
def test_errors_exit_2_with_one_json_document(runner, small_cnn, tmp_path, args, message):
    out = tmp_path / "q.safetensors"
    result = runner.invoke(main, ["quantize", str(small_cnn), str(out), *args, "--json"])
    assert result.exit_code == EXIT_ERROR
    doc = json.loads(result.stdout)
    assert doc["schema"] == "modelkit.error/1" and message in doc["error"]["message"]
    assert not out.exists()


def test_existing_output_needs_force(runner, small_cnn, tmp_path):
    out = tmp_path / "q.safetensors"
    out.write_bytes(b"keep")
    result = runner.invoke(main, ["quantize", str(small_cnn), str(out), "--scheme", "int8"])
    assert result.exit_code == EXIT_ERROR and "--force" in result.stderr
    assert out.read_bytes() == b"keep"


@pytest.mark.slow
def test_onnx_input_through_onnxruntime(runner, small_cnn, tmp_path):
    """Export, then each ORT scheme: both sessions are run and agree within the pinned bound."""
    from modelkit.pipeline.convert import convert

    model = tmp_path / "cnn.onnx"
    convert(small_cnn, model)
    result = runner.invoke(main, ["quantize", str(model), str(tmp_path / "q"), "--scheme",
                                  "int8-dynamic,int8-static,int4", "--eval", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    reports = json.loads(result.stdout)["reports"]
    assert [r["scheme"] for r in reports] == ["int8-dynamic", "int8-static", "int4"]
    for r in reports:
        assert r["verify"]["passed"] and r["verify"]["max_relative_err"] <= r["verify"]["bound"]
        assert r["target"]["bytes"] < r["source"]["bytes"] and abs(r["metric"]["delta"]) <= 0.05
    import onnx

    ops = {n.op_type for n in onnx.load(str(tmp_path / "q" / "int4.onnx")).graph.node}
    assert "MatMulNBits" in ops
    ops = {n.op_type for n in onnx.load(str(tmp_path / "q" / "int8-static.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    refused = runner.invoke(main, ["quantize", str(model), str(tmp_path / "qat.onnx"), "--scheme", "int4", "--qat"])
    assert refused.exit_code == EXIT_ERROR and "--qat do not apply to ONNX input" in refused.stderr
    assert not (tmp_path / "qat.onnx").exists()
