"""Commands that train (prune --finetune-epochs, quantize --qat, distill) under torchrun with two
CPU processes: every rank trains, rank 0 alone writes the output and prints one JSON document."""
from __future__ import annotations

import json

import pytest

from modelkit.api import load_module


@pytest.mark.slow
@pytest.mark.xdist_group("torchrun")        # one torchrun job at a time: ports and cores
@pytest.mark.parametrize("command", ["prune", "quantize"])
def test_training_commands_under_torchrun_write_and_print_once(trained_mlp, tmp_path, command, torchrun):
    dst = tmp_path / "out.safetensors"
    if command == "prune":
        result = torchrun("prune", str(trained_mlp), str(dst), "--method", "magnitude", "--sparsity", "0.5",
                          "--finetune-epochs", "1", "--device", "cpu", "--json", "--force", timeout=300)
    else:
        result = torchrun("quantize", str(trained_mlp), str(dst), "--scheme", "int8", "--qat", "--epochs", "1",
                          "--json", "--force", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(result.stdout)                      # exactly one document: only rank 0 prints
    assert doc["ok"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"]     # no leftovers from rank 1
    assert load_module(dst) is not None
