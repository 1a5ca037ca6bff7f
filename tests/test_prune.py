"""Pruning: masks folded, sparsity as asked, structured pruning shrinks consistently and rebuilds."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import modelkit
from modelkit.checkpoint import Checkpoint
from modelkit.cli import EXIT_OK, main
from modelkit.errors import ConfigError
from modelkit.formats import FORMATS, WRITABLE
from modelkit.metadata import PRUNE_KEY
from modelkit.models import arch_spec, build, build_from_spec, load_model_module
from modelkit.pipeline.compress import finetune, prune_file
from modelkit.quantizers.prune import PruneConfig, apply, keep_masks, sparsity_report

TINY_LM = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8}


def _inputs(name):
    return load_model_module(name).example_inputs(3)


def test_magnitude_per_layer_reaches_the_sparsity_and_folds_the_mask():
    model = build("cnn", seed=0)
    pruned = apply(model, PruneConfig(method="magnitude", sparsity=0.6))
    for row in sparsity_report(pruned):
        assert row["zeros"] == int(0.6 * row["total"])
    assert not any("orig" in k or "mask" in k for k in pruned.state_dict())
    assert all(not p._backward_hooks for p in pruned.parameters())
    assert (model.conv2.weight != 0).all()                              # the input model is unchanged


def test_magnitude_global_ranks_all_layers_together():
    pruned = apply(build("cnn", seed=0), PruneConfig(method="magnitude", sparsity=0.7, scope="global"))
    rows = sparsity_report(pruned)
    total = sum(r["zeros"] for r in rows) / sum(r["total"] for r in rows)
    assert total == pytest.approx(0.7, abs=1e-4)
    assert len({round(r["sparsity"], 2) for r in rows}) > 1             # layers differ


def test_two_four_zeroes_two_of_every_four_inputs():
    pruned = apply(build("tinylm", TINY_LM, seed=0), PruneConfig(method="2:4"))
    weight = pruned.model.layers[0].mlp.down_proj.weight                  # (out, in)
    groups = (weight == 0).reshape(weight.shape[0], -1, 4).sum(-1)
    assert (groups == 2).all()


def test_two_four_leaves_layers_it_cannot_pattern_dense():
    pruned = apply(build("mlp", seed=0), PruneConfig(method="2:4"))
    by_layer = {r["layer"]: r["sparsity"] for r in sparsity_report(pruned)}
    assert by_layer["net.0"] == 0.0 and by_layer["net.2"] == 0.0        # 2 and 30 inputs: not groups of four
    assert by_layer["net.4"] == 0.5                                      # 20 inputs


def _silence(model, name):
    """Zero the weights of the units structured pruning should remove, so outputs must not change."""
    with torch.no_grad():
        if name == "mlp":
            model.net[0].weight[:15] = 0
            model.net[0].bias[:15] = 0
            model.net[2].weight[:10] = 0
            model.net[2].bias[:10] = 0
        elif name == "cnn":
            for layer, count in ((model.conv1, 16), (model.conv2, 32), (model.fc1, 64)):
                layer.weight[:count] = 0
                layer.bias[:count] = 0
        else:
            for block in model.model.layers:
                hd = model.config.head_dim
                block.self_attn.o_proj.weight[:, :hd] = 0                  # query head 0 (group 0)
                block.self_attn.o_proj.weight[:, 3 * hd:4 * hd] = 0        # query head 3 (group 1)
                block.mlp.down_proj.weight[:, :32] = 0
    return model


@pytest.mark.parametrize("name, config, changes", [
    ("mlp", {}, {"hidden": [15, 10]}),
    ("cnn", {}, {"channels": [16, 32], "hidden": 64}),
    ("tinylm", TINY_LM, {"num_attention_heads": 4, "head_dim": 8, "intermediate_size": 43}),
])
def test_structured_pruning_removes_whole_units_of_each_layer_kind(name, config, changes):
    model = _silence(build(name, config, seed=0).eval(), name)
    sparsity = 1 / 3 if name == "tinylm" else 0.5
    pruned = apply(model, PruneConfig(method="structured", sparsity=sparsity)).eval()
    for key, value in changes.items():
        assert getattr(pruned.config, key) == (tuple(value) if isinstance(value, list) else value)
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in model.parameters())
    with torch.no_grad():                                   # only silent units went: same function
        assert torch.allclose(model(_inputs(name)), pruned(_inputs(name)), atol=1e-5)
    rebuilt = build_from_spec(arch_spec(pruned))            # the new widths are in the ArchSpec
    rebuilt.load_state_dict(pruned.state_dict())


@pytest.mark.parametrize("fmt", sorted(f for f in WRITABLE if not FORMATS[f].folder))
def test_structurally_pruned_model_round_trips_through_every_format(fmt, tmp_path):
    pruned = apply(build("cnn", {"channels": [8, 16], "hidden": 32}, seed=0), PruneConfig(method="structured", sparsity=0.5))
    source = modelkit.save(Checkpoint.from_module(pruned.eval()), tmp_path / "p.safetensors")
    target = tmp_path / f"p{FORMATS[fmt].suffixes[0]}"
    if fmt != "safetensors":
        assert modelkit.convert(source, target, to=fmt).verify["passed"]
    else:
        target = source
    modelkit.assert_same_outputs(pruned.eval(), modelkit.load_module(target, trust=True), _inputs("cnn"), atol=0)


def test_keep_masks_holds_zeros_through_fine_tuning_and_leaves_no_hooks():
    pruned = apply(build("mlp", seed=0), PruneConfig(method="magnitude", sparsity=0.5))
    zeros = {n: (p == 0) for n, p in pruned.named_parameters() if p.dim() > 1}
    finetune(pruned, epochs=1, device="cpu")
    for name, p in pruned.named_parameters():
        if name in zeros:
            assert (p[zeros[name]] == 0).all(), name
            assert (p[~zeros[name]] != 0).any()
        assert not p._backward_hooks
    handles = keep_masks(pruned)
    assert handles and all(h.remove() is None for h in handles)


def test_bad_configs():
    with pytest.raises(ConfigError, match="unknown pruning method"):
        PruneConfig(method="random")
    with pytest.raises(ConfigError, match="sparsity"):
        PruneConfig(sparsity=1.0)
    with pytest.raises(ConfigError, match="--skip applies"):
        apply(build("mlp"), PruneConfig(method="structured", skip=("net.0",)))


def test_prune_file_reports_and_records_what_it_did(trained_mlp, tmp_path):
    report = prune_file(trained_mlp, tmp_path / "p.safetensors", PruneConfig(method="structured", sparsity=0.5),
                        finetune_epochs=1, device="cpu")
    assert report.parameters["after"] < report.parameters["before"] == 752
    assert report.bytes["after"] < report.bytes["before"]
    assert report.values["finetuned"] is not None and report.metric == "test accuracy"
    ckpt = modelkit.load(tmp_path / "p.safetensors")
    assert json.loads(ckpt.metadata[PRUNE_KEY])["method"] == "structured"
    assert ckpt.arch.config["hidden"] == [15, 10]


def test_cli_prune_json(trained_mlp, tmp_path):
    result = CliRunner().invoke(main, ["prune", str(trained_mlp), str(tmp_path / "p.safetensors"),
                                       "--method", "magnitude", "--sparsity", "0.8", "--json"])
    assert result.exit_code == EXIT_OK, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "modelkit.prune/1" and doc["values"]["finetuned"] is None
    assert sum(r["zeros"] for r in doc["layers"]) == sum(int(0.8 * r["total"]) for r in doc["layers"])
