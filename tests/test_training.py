"""Training: each model reaches its bar, runs are reproducible and resumable, DDP works."""
from __future__ import annotations

import json
import os

import pytest
import torch

import modelkit
from modelkit.errors import ConfigError, OutputExistsError
from modelkit.pipeline.train import MODEL_FILE, STATE_FILE, TrainConfig, train


def test_mlp_reaches_its_bar(tmp_path):
    result = train("mlp", tmp_path, config=TrainConfig(device="cpu"))
    assert result.metrics["test"]["accuracy"] >= 0.95
    assert result.metrics["test"]["examples"] == 1000


def test_cnn_reaches_its_bar(tmp_path):
    result = train("cnn", tmp_path, config=TrainConfig(device="cpu"))
    assert result.metrics["test"]["accuracy"] >= 0.96
    assert result.metrics["test"]["examples"] == 270


@pytest.fixture(scope="module")
def tinylm_recipe_run(tmp_path_factory):
    """tinylm trained once with the recipe `make demo` runs (its defaults): the one long training of the
    suite, shared by the tests that need a trained tinylm's figures. Under xdist on one thread, while the
    other worker runs the rest of the suite on the other core: 192 s on one thread in the full suite with
    the 1.2 MB recipe (2026-11-25, 2 cores); today's 1.0 MB batch-8 recipe took 0.88x of that one's time in
    back-to-back one-thread trials (bench/tinylm_recipe.py: 172 s against 194 s; 0.80x on a busier machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else os.cpu_count() or 1)
    try:
        return train("tinylm", tmp_path_factory.mktemp("tinylm-recipe"), config=TrainConfig(device="cpu"))
    finally:
        torch.set_num_threads(before)


# Both tests read the one run above: same group, so under xdist one worker trains it once.
@pytest.mark.slow
@pytest.mark.xdist_group("tinylm-recipe")
def test_tinylm_run_beats_the_unigram_baseline(tinylm_recipe_run):
    val = tinylm_recipe_run.metrics["val"]
    assert val["unigram_bits_per_byte"] > 4.0                     # source code: about 4.7-4.9 bits per byte
    assert val["ratio_to_unigram"] < 0.8
    assert val["perplexity"] == pytest.approx(2 ** val["bits_per_byte"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.xdist_group("tinylm-recipe")
def test_tinylm_default_recipe_reaches_the_demo_bar(tinylm_recipe_run):
    """The recipe `make demo` runs: at most 0.55x the unigram bits per byte on validation."""
    assert tinylm_recipe_run.metrics["val"]["ratio_to_unigram"] <= 0.55
    assert tinylm_recipe_run.metrics["test"]["ratio_to_unigram"] <= 0.55


def test_saved_checkpoint_carries_arch_metrics_and_recipe(tmp_path):
    result = train("mlp", tmp_path, config=TrainConfig(epochs=2, device="cpu"))
    ckpt = modelkit.load(result.path)
    assert ckpt.arch.name == "mlp" and ckpt.arch.config["hidden"] == [30, 20]
    assert ckpt.metrics["test"]["accuracy"] == result.metrics["test"]["accuracy"]
    assert json.loads(ckpt.metadata["modelkit.train"])["epochs"] == 2
    assert (tmp_path / STATE_FILE).is_file()
    assert [r["epoch"] for r in result.history] == [1, 2]


def test_same_seed_same_weights(tmp_path):
    a = train("cnn", tmp_path / "a", config=TrainConfig(epochs=2, seed=3, device="cpu"))
    b = train("cnn", tmp_path / "b", config=TrainConfig(epochs=2, seed=3, device="cpu"))
    c = train("cnn", tmp_path / "c", config=TrainConfig(epochs=2, seed=4, device="cpu"))
    assert a.path.read_bytes() == b.path.read_bytes()
    assert a.path.read_bytes() != c.path.read_bytes()


class _Interrupt(Exception):
    pass


def test_resume_continues_exactly_where_it_stopped(tmp_path):
    config = TrainConfig(epochs=4, seed=1, device="cpu")
    straight = train("cnn", tmp_path / "straight", config=config)

    def stop_after_two(record):
        if record["epoch"] == 2:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        train("cnn", tmp_path / "resumed", config=config, on_epoch=stop_after_two)
    resumed = train("cnn", tmp_path / "resumed", config=config, resume=True)
    assert [r["epoch"] for r in resumed.history] == [1, 2, 3, 4]
    a, b = modelkit.load(straight.path).materialize(), modelkit.load(resumed.path).materialize()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_existing_run_needs_force_or_resume(tmp_path):
    train("mlp", tmp_path, config=TrainConfig(epochs=1, device="cpu"))
    with pytest.raises(OutputExistsError, match="--force"):
        train("mlp", tmp_path, config=TrainConfig(epochs=1, device="cpu"))
    train("mlp", tmp_path, config=TrainConfig(epochs=1, device="cpu"), force=True)


def test_resume_with_another_architecture_is_refused(tmp_path):
    train("mlp", tmp_path, config=TrainConfig(epochs=1, device="cpu"))
    with pytest.raises(ConfigError, match="different architecture"):
        train("mlp", tmp_path, config=TrainConfig(epochs=2, device="cpu"), model_config={"hidden": [8]}, resume=True)


def test_progress_callback_sees_every_step(tmp_path):
    seen = []
    train("mlp", tmp_path, config=TrainConfig(epochs=2, steps_per_epoch=5, device="cpu"),
          progress=lambda done, total, stats: seen.append((done, total, stats["loss"])))
    assert [s[0] for s in seen] == list(range(1, 11)) and all(s[1] == 10 for s in seen)


@pytest.mark.parametrize("field, value", [("epochs", 0), ("batch_size", -1), ("lr", 0.0), ("device", "tpu")])
def test_bad_train_config_is_a_config_error(field, value):
    with pytest.raises(ConfigError):
        TrainConfig(**{field: value})



@pytest.mark.slow
@pytest.mark.xdist_group("torchrun")        # one torchrun job at a time: ports and cores
def test_ddp_with_two_cpu_processes_reaches_the_cnn_bar(tmp_path, torchrun):
    """15 of the recipe's 40 epochs: the bar (0.96) is met under DDP with room (test accuracy 0.978 at 15 epochs in
    16 s of CPU, 2026-11-28; 0.981 at 25 in ~26 s, 0.985 at 40; two CPU processes)."""
    out = tmp_path / "ddp"
    result = torchrun("train", "cnn", "--out", str(out), "--device", "cpu", "--json", "--force", "--epochs", "15")
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(result.stdout)                    # one document: only rank 0 prints
    assert doc["ok"] and doc["model"] == "cnn"
    assert doc["metrics"]["test"]["accuracy"] >= 0.96
    assert doc["metrics"]["test"]["examples"] == 270   # the ranks' shards add up to the whole split
    assert sorted(p.name for p in out.iterdir()) == [MODEL_FILE, STATE_FILE]
