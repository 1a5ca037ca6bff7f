"""`modelkit scan`: exit codes, one JSON document, SARIF 2.1.0 structure, fail-closed behaviour."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
from click.testing import CliRunner

from modelkit.cli import EXIT_ERROR, EXIT_OK, EXIT_UNSAFE, main
from modelkit.testing.payloads import Reduce


@pytest.fixture
def files(tmp_path):
    (tmp_path / "clean.pkl").write_bytes(pickle.dumps({"w": [1.0]}, protocol=2))
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(Reduce(os.system, "true"), protocol=2))
    (tmp_path / "module.pt").write_bytes(b"\x80\x02ctorch.nn.modules.linear\nLinear\n)\x81}b.")
    return tmp_path


def _run(*args):
    return CliRunner().invoke(main, ["scan", *map(str, args)])


def test_exit_codes(files):
    assert _run(files / "clean.pkl").exit_code == EXIT_OK
    assert _run(files / "evil.pkl").exit_code == EXIT_UNSAFE
    assert _run(files / "module.pt").exit_code == EXIT_OK
    assert _run(files / "module.pt", "--fail-on", "suspicious").exit_code == EXIT_UNSAFE
    assert _run(files / "module.pt", "--strict").exit_code == EXIT_UNSAFE
    assert _run(files / "missing.pt").exit_code == EXIT_ERROR
    (files / "empty").mkdir()
    assert _run(files / "empty").exit_code == EXIT_ERROR          # nothing matched: fail closed
    (files / "blob.bin").write_bytes(bytes(range(256)))
    assert _run(files / "blob.bin").exit_code == EXIT_ERROR       # unrecognised is never clean


def test_human_output_names_format_rule_location_and_callable(files):
    result = _run(files / "evil.pkl")
    assert "pickle" in result.stdout and "DANGEROUS" in result.stdout and "pickle.global.denied" in result.stdout
    assert "system" in result.stdout and "@ byte" in result.stdout and "examined" in result.stdout


def test_json_is_one_document(files):
    result = _run(files, "--json")
    assert result.exit_code == EXIT_UNSAFE
    doc = json.loads(result.stdout)
    assert doc["schema"] == "modelkit.scan/1" and doc["ok"] is False and doc["worst"] == "dangerous"
    assert doc["scanned"] == 3 and doc["errors"] == []
    finding = next(f for f in doc["findings"] if f["rule"] == "pickle.global.denied")
    assert finding["path"].endswith("evil.pkl") and finding["severity"] == "dangerous" and finding["name"] == "system"
    assert {f["format"] for f in doc["files"]} == {"pickle"}
    missing = _run(files / "nope", "--json")
    assert missing.exit_code == EXIT_ERROR
    assert json.loads(missing.stdout)["errors"][0]["path"].endswith("nope")


def test_sarif_structure(files, tmp_path):
    out = tmp_path / "scan.sarif"
    result = _run(files, "--sarif", out)
    assert result.exit_code == EXIT_UNSAFE
    sarif = json.loads(out.read_text())
    assert sarif["version"] == "2.1.0" and "$schema" in sarif
    run = sarif["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert run["tool"]["driver"]["name"] == "modelkit" and rules
    ids = [r["id"] for r in rules]
    assert "pickle.global.denied" in ids
    for result_ in run["results"]:
        assert result_["ruleId"] in ids and ids[result_["ruleIndex"]] == result_["ruleId"]
        assert result_["level"] in ("error", "warning", "note")
        location = result_["locations"][0]["physicalLocation"]
        assert location["artifactLocation"]["uri"]
    assert any(r["level"] == "error" for r in run["results"])


def test_recursive(files):
    sub = files / "sub"
    sub.mkdir()
    (sub / "deep.pkl").write_bytes(pickle.dumps(Reduce(os.system, "true"), protocol=2))
    flat = json.loads(_run(files, "--json").stdout)
    deep = json.loads(_run(files, "--recursive", "--json").stdout)
    assert deep["scanned"] == flat["scanned"] + 1


def test_scan_command_does_not_import_torch(files):
    code = ("import sys\nfrom click.testing import CliRunner\nfrom modelkit.cli import main\n"
            f"r = CliRunner().invoke(main, ['scan', {str(files)!r}, '--json'])\n"
            "assert r.exit_code == 1, r.output\nprint('torch' in sys.modules, 'numpy' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False False"


def test_help(files):
    result = CliRunner().invoke(main, ["scan", "--help"])
    assert result.exit_code == EXIT_OK and "modelkit scan" in result.stdout and "--sarif" in result.stdout


def test_console_script(files):
    # The installed `modelkit` script: same results and exit codes as through CliRunner.
    from pathlib import Path
    exe = Path(sys.executable).with_name("modelkit")
    evil = subprocess.run([str(exe), "scan", str(files / "evil.pkl")], capture_output=True, text=True)
    assert evil.returncode == EXIT_UNSAFE and "pickle.global.denied" in evil.stdout
    clean = subprocess.run([str(exe), "scan", str(files / "clean.pkl"), "--json"], capture_output=True, text=True)
    assert clean.returncode == EXIT_OK and json.loads(clean.stdout)["ok"] is True
    usage = subprocess.run([str(exe), "scan", "--fail-on", "never", str(files)], capture_output=True, text=True)
    assert usage.returncode == EXIT_ERROR and "--fail-on" in usage.stderr
    usage_json = subprocess.run([str(exe), "scan", "--fail-on", "never", str(files), "--json"],
                                capture_output=True, text=True)
    assert usage_json.returncode == EXIT_ERROR and json.loads(usage_json.stdout)["error"]["type"] == "UsageError"
    helped = subprocess.run([str(exe), "scan", "--help"], capture_output=True, text=True)
    assert helped.returncode == EXIT_OK and "Examples" in helped.stdout


# Imports the scan command must not add to click's own (issue 13 made scan a click command like the
# others; click brings typing, dataclasses, inspect and shutil): torch and numpy (seconds), the
# format libraries, and what the scanner replaced with its own readers (zipfile, pickletools).
_HEAVY = ("torch", "numpy", "onnx", "h5py", "safetensors", "gguf", "zipfile", "pickletools", "tarfile", "logging")


def test_scan_command_starts_light(files):
    code = ("import sys\nbefore = set(sys.modules)\nfrom modelkit.cli import run\n"
            f"try:\n    run(['scan', {str(files)!r}, '--json'])\nexcept SystemExit as e:\n    assert e.code == 1, e.code\n"
            f"print(' '.join(sorted(m for m in {_HEAVY!r} if m in sys.modules and m not in before)), file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ""
