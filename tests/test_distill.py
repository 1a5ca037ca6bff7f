"""Distillation: the loss math on tiny cases, and the file-level run with its baseline."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

import modelkit
from modelkit.cli import EXIT_OK, main
from modelkit.errors import ConfigError
from modelkit.metadata import DISTILL_KEY
from modelkit.pipeline.compress import distill_file, parse_student
from modelkit.quantizers.distill import DistillationLoss, DistillConfig, distillation_loss


def test_loss_is_hard_label_cross_entropy_when_alpha_is_zero():
    student, teacher = torch.randn(4, 3), torch.randn(4, 3)
    labels = torch.tensor([0, 2, 1, 1])
    got = distillation_loss(student, teacher, labels, DistillConfig(alpha=0.0))
    assert torch.allclose(got, F.cross_entropy(student, labels))


def test_soft_term_is_kl_times_t_squared_on_a_hand_computed_case():
    student = torch.tensor([[0.0, math.log(3.0)]])          # softmax at T=1: [0.25, 0.75]
    teacher = torch.tensor([[0.0, 0.0]])                    # [0.5, 0.5]
    expected_kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    got = distillation_loss(student, teacher, torch.tensor([0]), DistillConfig(temperature=1.0, alpha=1.0))
    assert got.item() == pytest.approx(expected_kl, rel=1e-5)
    # At T=2 the distributions soften to sqrt ratios, and the term is scaled by T^2 = 4.
    p_s = torch.softmax(student / 2, -1)[0]
    kl_t2 = sum(0.5 * math.log(0.5 / float(p)) for p in p_s)
    got_t2 = distillation_loss(student, teacher, torch.tensor([0]), DistillConfig(temperature=2.0, alpha=1.0))
    assert got_t2.item() == pytest.approx(4 * kl_t2, rel=1e-5)


def test_soft_term_vanishes_when_student_matches_teacher():
    logits = torch.randn(2, 5, 7)                           # (B, T, vocab): a language model's shape
    loss = distillation_loss(logits, logits, torch.zeros(2, 5, dtype=torch.long), DistillConfig(alpha=1.0))
    assert loss.abs().item() < 1e-6


def test_teacher_gets_no_gradient():
    teacher, student = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)
    loss = DistillationLoss(teacher, DistillConfig())(student, (torch.randn(5, 3), torch.randint(0, 4, (5,))))
    loss.backward()
    assert student.weight.grad is not None and teacher.weight.grad is None


@pytest.mark.parametrize("bad", [{"temperature": 0.0}, {"alpha": 1.5}])
def test_bad_config(bad):
    with pytest.raises(ConfigError):
        DistillConfig(**bad)


def test_parse_student():
    assert parse_student("cnn", "cnn") == ("cnn", {"channels": [8, 16], "hidden": 32})
    assert parse_student("cnn:channels=[4,8],hidden=16", "cnn") == ("cnn", {"channels": [4, 8], "hidden": 16})
    assert parse_student('tinylm:{"num_hidden_layers": 1}', "tinylm") == ("tinylm", {"num_hidden_layers": 1})
    with pytest.raises(ConfigError, match="teacher's kind"):
        parse_student("mlp", "cnn")


def test_distill_file_trains_student_and_baseline(trained_mlp, tmp_path):
    report = distill_file(trained_mlp, "mlp:hidden=[4,4]", tmp_path / "d", DistillConfig(), epochs=1, device="cpu")
    assert report.student["parameters"] == report.scratch["parameters"] < report.teacher["parameters"] / 4
    assert report.metric == "test accuracy" and report.higher_is_better and report.epochs == 1
    ckpt = modelkit.load(tmp_path / "d" / "student" / "model.safetensors")
    assert json.loads(ckpt.metadata[DISTILL_KEY])["temperature"] == 4.0
    assert ckpt.arch.config["hidden"] == [4, 4]


def test_cli_distill_json(trained_mlp, tmp_path):
    result = CliRunner().invoke(main, ["distill", "--teacher", str(trained_mlp), "--student", "mlp", "--out",
                                       str(tmp_path / "d"), "--epochs", "1", "--no-baseline", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "modelkit.distill/1" and doc["scratch"] is None
