"""Shared fixtures: the fixtures folder, seeded reference models, trained checkpoints."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from modelkit.formats import FORMATS
from modelkit.models import MODELS, build

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one thread each, or they oversubscribe the CPU and both crawl.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Start the long tests first, so under xdist they overlap the many short ones."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def all_threads():
    """Let one long test use both cores (the other worker is mostly done by then)."""
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(params=sorted(FORMATS))
def fmt(request) -> str:
    return request.param


@pytest.fixture(params=sorted(MODELS))
def model_name(request) -> str:
    return request.param


# Small configs keep the per-model tests fast; the defaults are covered by the training tests.
SMALL_CONFIGS = {
    "mlp": {},
    "cnn": {"channels": [4, 8], "hidden": 16},
    "tinylm": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
}


@pytest.fixture
def small_model(model_name: str) -> torch.nn.Module:
    return build(model_name, SMALL_CONFIGS[model_name], seed=0).eval()


@pytest.fixture(scope="session")
def trained_mlp(tmp_path_factory) -> Path:
    """A quickly trained mlp checkpoint (a few epochs): for CLI and API tests, not for bars."""
    from modelkit.pipeline.train import TrainConfig, train

    out = tmp_path_factory.mktemp("mlp")
    return train("mlp", out, config=TrainConfig(epochs=3, seed=0, device="cpu")).path


@pytest.fixture(scope="session")
def trained_tinylm(tmp_path_factory) -> Path:
    """A tiny tinylm trained for a handful of steps: enough to exercise eval and generate."""
    from modelkit.pipeline.train import TrainConfig, train

    out = tmp_path_factory.mktemp("tinylm")
    return train("tinylm", out, config=TrainConfig(epochs=1, steps_per_epoch=5, seed=0, device="cpu"),
                 model_config=SMALL_CONFIGS["tinylm"]).path
