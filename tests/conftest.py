"""Shared fixtures: the fixtures folder, seeded reference models, trained checkpoints."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from modelkit.formats import FORMATS, WRITABLE
from modelkit.models import build, zoo_models

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one thread each, or they oversubscribe the CPU and both crawl.
    torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)        # after xdist's own hook, which adds group suffixes on pytest < 9
def pytest_collection_modifyitems(config, items):
    """Start the long tests first, the longest of all (the shared tinylm training, most of the suite's
    wall time) before every other, so under xdist one worker trains while the other runs the rest; keep
    xdist groups."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, not _in_group(item, LONGEST_GROUP)))
    if getattr(config.option, "loadgroup", False):      # set on xdist workers under --dist loadgroup
        _tag_xdist_groups(items)


# gloo's teardown can abort one rank at exit ("terminate called without an active exception", SIGABRT)
# on a busy machine: torch's own race (pytorch/pytorch#190489; the atexit fix in #179291 was abandoned),
# seen once in CI-like runs here, after training had finished. A run that dies of exactly that is
# run once more; any other failure is returned as it is.
_GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def torchrun():
    """run(*modelkit_args, timeout=600): `python -m torch.distributed.run --nproc-per-node 2 -m modelkit ARGS`."""
    def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
        for attempt in range(2):
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "modelkit", *args]
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
            if result.returncode == 0 or _GLOO_TEARDOWN_ABORT not in result.stderr or attempt:
                return result
        return result
    return run


LONGEST_GROUP = "tinylm-recipe"


def _in_group(item, group: str) -> bool:
    return any((m.args[0] if m.args else m.kwargs.get("name")) == group for m in item.iter_markers("xdist_group"))


def _tag_xdist_groups(items) -> None:
    """--dist loadgroup sends tests whose node id ends in @group to one worker. pytest-xdist 3.8 sets the
    suffix through Node._nodeid, which pytest 9 no longer reads (node ids live in Node._id), so with
    pytest 9 groups silently split: two workers each trained the shared tinylm, and the torchrun tests
    ran side by side. This sets the suffix where pytest 9 keeps it; with older pytest xdist's own works."""
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            from _pytest.nodeid import coerce_node_id

            item._id = coerce_node_id(item.nodeid + suffix)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(params=sorted(f for f in WRITABLE if not FORMATS[f].folder))  # hf folders: tests/test_hf.py
def fmt(request) -> str:
    return request.param


@pytest.fixture(params=zoo_models())
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
def zoo_pt2(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Each zoo model (SMALL_CONFIGS) saved once as .pt2 by modelkit (torch.export.save inside; the write path
    verifies it by running the program): name -> (model, path). For tests/test_pt2.py and the scanner's."""
    import modelkit
    from modelkit.checkpoint import Checkpoint

    folder = tmp_path_factory.mktemp("pt2")
    out = {}
    for name, config in SMALL_CONFIGS.items():
        if name == "tinylm":          # torch.export's tracing time grows with the layers: one is the same program
            config = {**config, "num_hidden_layers": 1}
        model = build(name, config, seed=0).eval()
        out[name] = model, modelkit.save(Checkpoint.from_module(model, metadata={"note": name}), folder / f"{name}.pt2")
    return out


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


# ------------------------------------------------ llama.cpp verdicts (fixtures/llama_cpp/make_golden.py)


@dataclass(frozen=True)
class LlamaCppGolden:
    """What llama.cpp computed on one GGUF file, recorded by fixtures/llama_cpp/make_golden.py."""

    name: str
    sha256: str
    prompt: list[int]
    logits: np.ndarray              # (len(prompt), 256) float32
    options: dict
    tokenize_text: bytes
    tokenize_tokens: list[int]
    detokenized: bytes              # llama.cpp's detokenize(range(256))
    version: str                    # llama-cpp-python's

    def check_bytes(self, path: Path) -> None:
        """The file is exactly the one llama.cpp ran, so its verdict applies to it."""
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        assert digest == self.sha256, (
            f"{self.name}: modelkit now writes other GGUF bytes than llama.cpp {self.version} was run on; if the "
            f"change is meant, rerun fixtures/llama_cpp/make_golden.py (it needs llama-cpp-python=={self.version})")

    def run_live(self, path: Path) -> np.ndarray | None:
        """llama.cpp's logits for the prompt, run now, where llama-cpp-python is installed; None otherwise."""
        if importlib.util.find_spec("llama_cpp") is None:
            return None
        import llama_cpp

        kv = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if self.options.get("kv_f32") else {}
        llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=self.options["n_ctx"], n_threads=1, seed=0,
                              verbose=False, **kv)
        llm.eval(self.prompt)
        assert llm.tokenize(self.tokenize_text, add_bos=False) == self.tokenize_tokens
        assert llm.detokenize(list(range(256))) == self.detokenized
        return np.array(llm.scores[: len(self.prompt)], dtype=np.float32)


@pytest.fixture(scope="session")
def llama_cpp_golden(fixtures_dir) -> dict[str, LlamaCppGolden]:
    folder = fixtures_dir / "llama_cpp"
    doc = json.loads((folder / "golden.json").read_text())
    with np.load(folder / "logits.npz") as logits:
        return {name: LlamaCppGolden(name=name, sha256=entry["sha256"], prompt=entry["prompt"], logits=logits[name],
                                     options=entry["llama_options"],
                                     tokenize_text=bytes.fromhex(entry["tokenize"]["text_hex"]),
                                     tokenize_tokens=entry["tokenize"]["tokens"],
                                     detokenized=bytes.fromhex(entry["detokenize_0_255_hex"]),
                                     version=doc["llama_cpp_python"])
                for name, entry in doc["files"].items()}


@pytest.fixture(scope="session")
def keras(tmp_path_factory):
    """Keras 3 on the torch backend. The variables are set here, before keras is imported, and
    restored afterwards, so other tests in this process see the environment unchanged. KERAS_HOME
    points at an empty folder: a user's ~/.keras/keras.json (channels_first, another backend)
    cannot change the test, and Keras writes its default config there, not into $HOME."""
    settings = {"KERAS_BACKEND": "torch", "KERAS_HOME": str(tmp_path_factory.mktemp("keras-home"))}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        keras = pytest.importorskip("keras")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if keras.backend.backend() != "torch" or keras.config.image_data_format() != "channels_last":
        pytest.skip("keras was already imported with another backend or data format")
    return keras


@pytest.fixture(scope="session")
def tfjs_modules() -> Path:
    """The node_modules of an install of @tensorflow/tfjs 4.22 (TFJS_MODULES; .ci/run installs the pinned one
    into a cache), for the live TF.js judges; they skip, saying why, without it or without node. No npm
    install in the tests: the recorded verdicts are checked without node."""
    import shutil

    modules = os.environ.get("TFJS_MODULES")
    if shutil.which("node") is None or not modules or not (Path(modules) / "@tensorflow" / "tfjs").is_dir():
        pytest.skip("TensorFlow.js not installed: set TFJS_MODULES to the node_modules of "
                    "`npm install @tensorflow/tfjs@4.22.0` (.ci/run does) to run it; the recorded verdicts are checked")
    return Path(modules)


@pytest.fixture
def from_pretrained(caplog):
    """load(folder, dequantize=False) -> (model in eval mode, loading info, transformers' warnings about missing,
    unexpected, mismatched or newly initialized weights): transformers' own reading of a (compressed-tensors) folder."""
    import logging

    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    from transformers.utils import logging as hf_logging

    def load(folder: Path, *, dequantize: bool = False) -> tuple[torch.nn.Module, dict, list[str]]:
        kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
        caplog.clear()
        hf_logging.enable_propagation()
        try:
            with caplog.at_level(logging.WARNING):
                model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, **kwargs)
        finally:
            hf_logging.disable_propagation()
        noisy = [r.getMessage() for r in caplog.records if any(
            w in r.getMessage().lower() for w in ("missing", "unexpected", "mismatch", "newly initialized"))]
        return model.eval(), info, noisy
    return load


@pytest.fixture(scope="session")
def save_hf_folder(fixtures_dir):
    """save(folder, config, style) -> folder: a tiny random-weight model of transformers' own class for `config`,
    saved with save_pretrained, its bos/eos ids and tokenizer files those of fixtures/llama_cpp/hf/<style>/. Norms
    and biases are drawn away from 1 / 0, so a slip in them shows in the logits."""
    import shutil

    import transformers

    def save(folder: Path, config, style: str) -> Path:
        tokenizers = fixtures_dir / "llama_cpp" / "hf" / style
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizers)
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.normal_(0.0, 0.2)
        model.save_pretrained(folder)
        for f in tokenizers.iterdir():
            shutil.copy(f, folder / f.name)
        return folder
    return save
