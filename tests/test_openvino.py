"""The openvino converter: IRs written through OpenVINO's converter, judged by OpenVINO's runtime against torch
within the ONNX tolerance, read back bit for bit without OpenVINO, scanned; hostile IRs refused."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import modelkit
from modelkit.checkpoint import Checkpoint
from modelkit.errors import FormatError, UnsafeFileError
from modelkit.formats import detect_format
from modelkit.models import build, load_model_module
from modelkit.pipeline.verify import GRAPH_ATOL
from modelkit.scan import Severity

pytest.importorskip("openvino", reason="the openvino extra: pip install 'modelkit[openvino]'")
from modelkit.converters import openvino as ov_converter  # noqa: E402

ATOL = GRAPH_ATOL[("onnx", "float32")]      # the bar: the ONNX tolerance (measured: 1.3e-7, mlp, cnn and a Sequential)


def _with_batchnorm() -> torch.nn.Module:
    """A Sequential whose BatchNorm OpenVINO folds into the convolution: its tensors are kept in the .bin's tail."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(144, 3)).eval()
    with torch.no_grad():
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
    return net


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """name -> (torch module, inputs, the IR modelkit wrote, its report)."""
    folder = tmp_path_factory.mktemp("openvino")
    out = {}
    for name, config in (("mlp", {}), ("cnn", {"channels": [4, 8], "hidden": 16})):
        module = build(name, config, seed=0).eval()
        report = modelkit.export(module, folder / f"{name}.xml", metadata={"note": "x"})
        out[name] = (module, load_model_module(name).example_inputs(5, seed=1), folder / f"{name}.xml", report)
    user = _with_batchnorm()
    x = torch.randn(2, 3, 8, 8)
    out["user"] = (user, torch.randn(5, 3, 8, 8), folder / "user.xml",
                   modelkit.export(user, folder / "user.xml", example_inputs=x))
    return out


@pytest.mark.parametrize("name", ["mlp", "cnn", "user"])
def test_openvinos_runtime_gives_torchs_outputs(written, name):
    """The judge: OpenVINO's own Core reads the IR and the .bin and runs them (CPU, f32), on inputs of
    another batch size than the export's."""
    module, x, path, report = written[name]
    assert report.verify["passed"] and report.verify["weights"] == "bit-exact"
    ov = ov_converter.openvino()
    core = ov.Core()
    compiled = core.compile_model(core.read_model(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    got = compiled([x.numpy()])[compiled.output(0)]
    with torch.no_grad():
        want = module(x).numpy()
    assert got.shape == want.shape and np.abs(got - want).max() <= ATOL


@pytest.mark.parametrize("name", ["mlp", "cnn", "user"])
def test_weights_read_back_bit_exact_without_running_anything(written, name):
    module, _, path, _ = written[name]
    assert detect_format(path) == "openvino"
    ckpt = modelkit.load(path)
    assert list(ckpt.tensors) == list(module.state_dict())
    for key, tensor in module.state_dict().items():
        assert torch.equal(ckpt.tensors[key].load(), tensor), key
    if name != "user":
        assert ckpt.arch == Checkpoint.from_module(module).arch and ckpt.metadata["note"] == "x"


def test_folded_tensors_live_in_the_tail_of_the_bin(written):
    _, _, path, _ = written["user"]
    from modelkit.parse import openvino as ir_xml

    ir = ir_xml.read_ir(path.read_bytes())
    names = json.loads(ir.rt_info["modelkit/names"])
    assert "from_end" in names["1.running_var"] and "const" in names["4.weight"]
    assert {c.layer.name for c in ir.consts} >= {names["4.weight"]["const"]}


def test_our_irs_scan_clean_and_name_their_bin(written):
    _, _, path, _ = written["cnn"]
    report = modelkit.scan(path.parent)
    assert report.errors == [] and report.worst == Severity.SAFE
    assert {f.format for f in report.files} == {"openvino", "tensor data"}


def test_modelkit_imports_openvino_without_its_telemetry():
    code = ("import sys; from modelkit.converters import openvino as c; c.openvino(); "
            "assert sys.modules.get('openvino_telemetry') is None, 'telemetry imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_an_ir_from_elsewhere_reads_its_constants_by_name(tmp_path):
    ov = ov_converter.openvino()
    net = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    ov.save_model(ov_converter._convert(ov, net, (torch.randn(1, 4),)), str(tmp_path / "plain.xml"),
                  compress_to_fp16=False)
    ckpt = modelkit.load(tmp_path / "plain.xml")
    weights = [t.load() for t in ckpt.tensors.values() if tuple(t.shape) == (3, 4)]
    assert len(weights) == 1 and torch.equal(weights[0], net[0].weight.detach())


_HEAD = '<?xml version="1.0"?>\n'
_CONST = ('<layer id="1" name="w" type="Const" version="opset1"><data element_type="f32" shape="2" offset="{offset}" '
          'size="8"/><output><port id="0" names="w"/></output></layer>')


def _ir(tmp_path, layers: str, *, bin_bytes: bytes | None = b"\0" * 8, prolog: str = _HEAD):
    path = tmp_path / "m.xml"
    path.write_text(f'{prolog}<net name="m" version="11"><layers>{layers}</layers><edges/></net>\n')
    if bin_bytes is not None:
        (tmp_path / "m.bin").write_bytes(bin_bytes)
    return path


@pytest.mark.parametrize("case, severity, rule", [
    ("entities", Severity.DANGEROUS, "openvino.xml.entities"),
    ("custom_op", Severity.SUSPICIOUS, "openvino.custom_op"),
    ("bounds", Severity.SUSPICIOUS, "openvino.const.bounds"),
    ("no_bin", Severity.SUSPICIOUS, "openvino.bin.missing"),
])
def test_hostile_irs_are_flagged_and_refused(tmp_path, case, severity, rule):
    if case == "entities":
        path = _ir(tmp_path, "", prolog=_HEAD + '<!DOCTYPE net [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;&a;">]>\n')
    elif case == "custom_op":
        path = _ir(tmp_path, '<layer id="0" name="evil" type="MyOp" version="my_extension"/>' + _CONST.format(offset=0))
    else:
        path = _ir(tmp_path, _CONST.format(offset=4 if case == "bounds" else 0),
                   bin_bytes=None if case == "no_bin" else b"\0" * 8)
    report = modelkit.scan(path)
    assert any(f.rule == rule and f.severity == severity for f in report.findings), report.findings
    if case == "custom_op":          # as an ONNX custom domain: flagged; the weights read, nothing runs
        assert list(modelkit.load(path).tensors) == ["w"]
        return
    with pytest.raises((UnsafeFileError, FormatError)) as e:
        modelkit.load(path)
    assert "\n" not in str(e.value)


def test_int8_weight_compression_through_nncf_is_measured_like_the_other_schemes(written, tmp_path):
    pytest.importorskip("nncf", reason="the nncf extra: pip install 'modelkit[nncf]'")
    from click.testing import CliRunner

    from modelkit.cli import main
    from modelkit.parse import openvino as ir_xml

    _, _, path, _ = written["cnn"]
    target = tmp_path / "cnn-int8.xml"
    result = CliRunner().invoke(main, ["quantize", str(path), str(target), "--scheme", "int8", "--eval", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["reports"][0]
    assert row["config"]["tool"] == "nncf" and row["verify"]["passed"]
    assert row["metric"]["name"] == "accuracy" and abs(row["metric"]["delta"]) <= 0.02
    ir = ir_xml.read_ir(target.read_bytes())
    assert {"uint8"} <= {c.dtype for c in ir.consts}               # the weights are uint8 now
    assert json.loads(ir.rt_info["modelkit/quantization"])["mode"] == "int8_asym"
    assert modelkit.scan(target).worst == Severity.SAFE


def test_eval_runs_the_ir_in_openvinos_runtime(written):
    _, _, path, _ = written["cnn"]
    ran = modelkit.evaluate(path, runtime="openvino")
    assert ran["accuracy"] == pytest.approx(modelkit.evaluate(path)["accuracy"])       # torch rebuilt from its weights


def test_without_openvino_reading_works_and_writing_names_the_extra(written):
    code = ("import sys, modelkit; sys.modules['openvino'] = None\n"
            "from modelkit.errors import MissingDependencyError\n"
            "from modelkit.formats import load_format\n"
            f"assert len(modelkit.load({str(written['mlp'][2])!r}).tensors) == 6\n"
            "try:\n"
            "    load_format('openvino').openvino()\n"
            "except MissingDependencyError as e:\n"
            "    assert \"modelkit[openvino]\" in str(e), e\n"
            "else:\n"
            "    raise AssertionError('no MissingDependencyError')\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
