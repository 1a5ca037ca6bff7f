"""`modelkit serve` (issue 18): the v2 and OpenAI routes in-process, batching, errors, and one live server.

The judges: tritonclient.http and the KServe client for the v2 routes, the openai client for the OpenAI routes,
against a live `modelkit serve` (uvicorn in a subprocess); results must equal `load_module`'s outputs and greedy
`modelkit generate` text. The models are tiny, seeded and untrained (text equality holds for any weights).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import modelkit
from modelkit.errors import RequestError
from modelkit.models import build

starlette_testclient = pytest.importorskip("starlette.testclient")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

TINY = {"cnn": {"channels": [4, 8], "hidden": 16}, "mlp": {},
        "tinylm": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "max_position_embeddings": 64}}
TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "llama_cpp" / "hf" / "llama3"
PROMPTS = ["def ", "import os\n", "", "class A:\n    pass\n" * 4]          # the last outgrows tinylm's 64-byte window


# A served model against load_module in this process: bit-equal with the same thread count; the live server
# runs torch with its own threads, which sums in another order: measured 2026-11-25, 1.5e-8 absolute at most.
ATOL = 1e-6


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve")
    paths = {name: root / f"{name}.safetensors" for name in TINY}
    for name, path in paths.items():
        modelkit.export(build(name, TINY[name], seed=0).eval(), path)
    folder = root / "llama"
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    config = transformers.LlamaConfig(vocab_size=640, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, folder / f.name)
    paths["llama"] = folder
    return paths


@pytest.fixture(scope="module")
def server(files):
    """`modelkit serve` of the cnn, mlp and tinylm in a subprocess on a free port, started as soon as the files
    exist, so that its start-up overlaps the in-process tests: (base url, process)."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "modelkit", "serve", str(files["cnn"]), str(files["mlp"]),
                                str(files["tinylm"]), "--port", str(port), "--max-batch", "8"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield f"http://127.0.0.1:{port}", process
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def live(server):
    """The server, once it answers ready."""
    base, process = server
    for _ in range(1200):
        try:
            if httpx.get(f"{base}/v2/health/ready", timeout=1).status_code == 200:
                return base, process
        except httpx.HTTPError:
            time.sleep(0.1)
        assert process.poll() is None, process.communicate()[1]
    raise AssertionError("modelkit serve did not become ready in 2 minutes")


@pytest.fixture(scope="module")
def app(files, request):
    # One process runs the live tests too: start their server first, so it starts while this app loads. (Under
    # xdist a worker may not run them, and the server starts when a live test asks.)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        request.getfixturevalue("server")
    return modelkit.serve(files, max_batch=8, max_body_bytes=1 << 20)


@pytest.fixture(scope="module")
def client(app):
    with starlette_testclient.TestClient(app) as c:
        yield c


def _image(rows: int, model: str = "cnn") -> np.ndarray:
    shape = (rows, 1, 8, 8) if model == "cnn" else (rows, 2)
    return np.random.default_rng(rows).random(shape, dtype=np.float32)


def _reference(files, model: str, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return modelkit.load_module(files[model])(torch.from_numpy(x)).numpy()


@pytest.fixture(scope="module")
def loaded(files) -> dict:
    """The language models as `modelkit generate` loads them, once."""
    from modelkit.pipeline.load import load_language_model

    return {name: load_language_model(files[name]) for name in ("tinylm", "llama")}


def _generated(loaded, model: str, prompt: str, tokens: int, chat: bool = False) -> str:
    """Greedy `modelkit generate` text (modelkit.complete's two paths, on the model loaded once)."""
    from modelkit.pipeline.generate import generate_bytes, generate_tokens

    lm = loaded[model]
    if lm.tokenizer is None:
        return generate_bytes(lm.model, prompt, max_new_tokens=tokens).text
    return generate_tokens(lm.model, lm.tokenizer, prompt, max_new_tokens=tokens, chat=chat, assets=dict(lm.assets)).text


# ------------------------------------------------------------------------------------------ v2, in-process
@pytest.mark.parametrize("path, expected", [
    ("/v2/health/live", {"live": True}), ("/v2/health/ready", {"ready": True}),
    ("/v2/models/cnn/ready", {"name": "cnn", "ready": True}),
    ("/v2/models/mlp", {"name": "mlp", "versions": ["1"], "platform": "pytorch",
                        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
                        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 2]}]}),
])
def test_health_and_metadata(client, path, expected):
    r = client.get(path)
    assert r.status_code == 200 and r.json() == expected


@pytest.mark.parametrize("model", ["cnn", "mlp"])
@pytest.mark.parametrize("binary", [False, True])
def test_infer_equals_load_module(client, files, model, binary):
    x = _image(3, model)
    item = {"name": "x", "datatype": "FP32", "shape": list(x.shape)}
    if binary:           # the binary-data extension, as tritonclient sends it by default
        header = json.dumps({"inputs": [{**item, "parameters": {"binary_data_size": x.nbytes}}],
                             "parameters": {"binary_data_output": True}}).encode()
        r = client.post(f"/v2/models/{model}/versions/1/infer", content=header + x.tobytes(),
                        headers={"Inference-Header-Content-Length": str(len(header))})
        length = int(r.headers["Inference-Header-Content-Length"])
        out = json.loads(r.content[:length])["outputs"][0]
        got = np.frombuffer(r.content[length:], dtype="<f4").reshape(out["shape"])
    else:
        r = client.post(f"/v2/models/{model}/infer", json={"id": "7", "inputs": [{**item, "data": x.tolist()}]})
        out = r.json()["outputs"][0]
        assert r.json()["id"] == "7" and r.json()["model_name"] == model
        got = np.array(out["data"], dtype=np.float32).reshape(out["shape"])
    assert r.status_code == 200 and out["datatype"] == "FP32"
    np.testing.assert_array_equal(got, _reference(files, model, x))


def _infer(item: dict) -> dict:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [0.5, 1.0], **item}]}


BAD = {
    "bad JSON": ("/v2/models/mlp/infer", b'{"inputs": [', 400, "not valid JSON"),
    "wrong shape": ("/v2/models/mlp/infer", _infer({"shape": [1, 3], "data": [1, 2, 3]}), 400, "must have shape [-1, 2]"),
    "wrong dtype": ("/v2/models/mlp/infer", _infer({"datatype": "INT64", "data": [1, 2]}), 400, "must be FP32, got INT64"),
    "strings as floats": ("/v2/models/mlp/infer", _infer({"data": ["a", "b"]}), 400, "string values, not FP32"),
    "too few values": ("/v2/models/mlp/infer", _infer({"data": [1.0]}), 400, "needs 2 values, data has 1"),
    "unknown datatype": ("/v2/models/mlp/infer", _infer({"datatype": "FP8"}), 400, "datatype 'FP8' is not supported"),
    "unknown input": ("/v2/models/mlp/infer", _infer({"name": "y"}), 400, "has no input 'y'"),
    "no inputs": ("/v2/models/mlp/infer", {"inputs": []}, 400, '"inputs"'),
    "short binary": ("/v2/models/mlp/infer", _infer({"parameters": {"binary_data_size": 8}}), 400, "body ends before"),
    "unknown model": ("/v2/models/resnet/infer", _infer({}), 404, "no model 'resnet'"),
    "unknown version": ("/v2/models/mlp/versions/2/infer", _infer({}), 404, "one version"),
    "LM on v2": ("/v2/models/tinylm/infer", _infer({}), 404, "language model"),
    "too large": ("/v2/models/mlp/infer", b" " * (2 << 20), 413, "limit"),
    "no route": ("/v3/models", {}, 404, "no route"),
    "unknown LM": ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "no language model 'gpt-4'"),
    "tensor model on v1": ("/v1/completions", {"model": "cnn", "prompt": "x"}, 404, "not a language model"),
    "bad max_tokens": ("/v1/completions", {"model": "tinylm", "prompt": "x", "max_tokens": "9"}, 400, "integer"),
    "bad temperature": ("/v1/completions", {"model": "tinylm", "prompt": "x", "temperature": -1}, 400, "temperature"),
    "n > 1": ("/v1/completions", {"model": "tinylm", "prompt": "x", "n": 2}, 400, '"n" must be 1'),
    "chat without template": ("/v1/chat/completions", {"model": "tinylm", "messages": [{"role": "user", "content": "x"}]},
                              400, "no chat template"),
    "bad messages": ("/v1/chat/completions", {"model": "llama", "messages": "hi"}, 400, '"messages"'),
    "prompt too long": ("/v1/completions", {"model": "llama", "prompt": "a " * 300}, 400, "at most 128"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_requests_get_a_4xx_reason_and_the_server_stays_up(client, case):
    path, body, status, reason = BAD[case]
    r = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error        # OpenAI's shape on /v1
    assert reason in message and "\n" not in message
    assert client.get("/v2/health/live").status_code == 200


def test_full_queue_is_503_and_a_gzip_body_is_read(files, client):
    from modelkit.pipeline.serve_tensors import Batcher

    model = client.app.state.modelkit.tensors["mlp"]

    async def fill() -> str:
        batcher = Batcher(model, max_batch=4, timeout_ms=0, max_queue=1)      # not started: nothing leaves the queue
        first = asyncio.ensure_future(batcher.submit([_image(1, "mlp")]))
        await asyncio.sleep(0)
        with pytest.raises(RequestError) as e:
            await batcher.submit([_image(1, "mlp")])
        first.cancel()
        return f"{e.value.status} {e.value}"
    assert asyncio.run(fill()).startswith("503 model 'mlp': 1 requests are already waiting")
    import gzip

    x = _image(2, "mlp")
    body = gzip.compress(json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2],
                                                 "data": x.ravel().tolist()}]}).encode())
    r = client.post("/v2/models/mlp/infer", content=body, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 200
    np.testing.assert_array_equal(np.array(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(2, 2),
                                  _reference(files, "mlp", x))


def test_a_model_failing_is_a_500_with_its_reason_and_the_next_request_works(client, monkeypatch):
    state = client.app.state.modelkit

    def fail(*args):
        raise RuntimeError("out of memory\nmore lines")
    body = _infer({})
    monkeypatch.setattr(state.tensors["mlp"], "run_batch", fail)
    monkeypatch.setattr(state.texts["tinylm"].engine.decoder, "step", fail)
    r = client.post("/v2/models/mlp/infer", json=body)
    assert r.status_code == 500 and r.json() == {"error": "the model failed: RuntimeError: out of memory"}
    r = client.post("/v1/completions", json={"model": "tinylm", "prompt": "x", "max_tokens": 3})
    assert r.status_code == 500 and "out of memory" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert client.post("/v2/models/mlp/infer", json=body).status_code == 200
    assert client.post("/v1/completions", json={"model": "tinylm", "prompt": "x", "max_tokens": 3}).status_code == 200


def test_concurrent_requests_are_batched_and_metrics_count_them(files):
    """16 requests at once through the ASGI app: each gets its own rows back, and /metrics shows runs of
    several rows, the request counts and a latency histogram; responses carry the request id."""
    app = modelkit.serve({"cnn": files["cnn"]}, batch_timeout_ms=20)

    async def run() -> tuple[list, str, str, str]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://serve") as c:
                before = (await c.get("/metrics")).text
                xs = [_image(1 + i % 3) for i in range(16)]
                rs = await asyncio.gather(*(c.post("/v2/models/cnn/infer", json={"inputs": [
                    {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}) for x in xs))
                outs = [(x, np.array(r.json()["outputs"][0]["data"], dtype=np.float32)) for x, r in zip(xs, rs, strict=True)]
                tagged = await c.get("/v2/health/live", headers={"X-Request-ID": "abc-123"})
                return outs, before, (await c.get("/metrics")).text, tagged.headers["x-request-id"]
    outs, before, metrics, request_id = asyncio.run(run())
    for x, got in outs:
        np.testing.assert_allclose(got.reshape(len(x), 10), _reference(files, "cnn", x), rtol=0, atol=ATOL)   # batched
    assert request_id == "abc-123"

    def series(text: str) -> dict[str, float]:
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("modelkit_"))}
    after, start = series(metrics), series(before)

    def grew(key: str) -> float:
        return after[key] - start.get(key, 0.0)
    assert grew('modelkit_batch_size_sum{model="cnn"}') == sum(len(x) for x, _ in outs)
    assert grew('modelkit_batch_size_count{model="cnn"}') < 16          # some runs held several requests
    assert grew('modelkit_requests_total{model="cnn",route="v2/infer",status="200"}') == 16
    assert grew('modelkit_request_seconds_bucket{le="+Inf",model="cnn",route="v2/infer"}') == 16


USER_MODULE = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 2)

    def forward(self, features, mask):
        return self.a(features), self.b(features) * mask

def make():
    torch.manual_seed(0)
    return Net()
"""


def test_a_users_module_with_two_inputs_and_two_outputs(tmp_path, monkeypatch):
    (tmp_path / "user_net.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_net

    torch.save(user_net.make().state_dict(), tmp_path / "net.pt")
    app = modelkit.serve({"net": tmp_path / "net.pt"}, arch="user_net:make", input_shapes=["features=2x4", "mask=2x2"])
    x, mask = np.arange(12, dtype=np.float32).reshape(3, 4), np.array([[1, 0]] * 3, dtype=np.float32)
    with starlette_testclient.TestClient(app) as c:
        meta = c.get("/v2/models/net").json()
        r = c.post("/v2/models/net/infer", json={"inputs": [
            {"name": "features", "datatype": "FP32", "shape": [3, 4], "data": x.tolist()},
            {"name": "mask", "datatype": "FP32", "shape": [3, 2], "data": mask.tolist()}], "outputs": [{"name": "output_1"}]})
    assert [i["name"] for i in meta["inputs"]] == ["features", "mask"]
    assert [(o["name"], o["shape"]) for o in meta["outputs"]] == [("output_0", [-1, 3]), ("output_1", [-1, 2])]
    (out,) = r.json()["outputs"]
    with torch.no_grad():
        expected = user_net.make().b(torch.from_numpy(x)) * torch.from_numpy(mask)
    np.testing.assert_allclose(np.array(out["data"], dtype=np.float32).reshape(3, 2), expected.numpy(), rtol=1e-6)


def test_any_onnx_file_runs_in_onnxruntime_with_its_graph_names(tmp_path, files):
    """--runtime onnxruntime: an ONNX graph modelkit did not write (no ArchSpec), served by its own input and
    output names, batched on axis 0; the other files still run in torch."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    w = np.arange(6, dtype=np.float32).reshape(3, 2) / 7
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["features", "w"], ["scores"])], "affine",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 2])], [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "affine.onnx")
    app = modelkit.serve({"affine": tmp_path / "affine.onnx", "mlp": files["mlp"]}, runtime="onnxruntime")
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    with starlette_testclient.TestClient(app) as c:
        meta = c.get("/v2/models/affine").json()
        r = c.post("/v2/models/affine/infer", json={"inputs": [{"name": "features", "datatype": "FP32", "shape": [4, 3],
                                                                "data": x.tolist()}]})
        assert c.get("/v2/models/mlp").json()["platform"] == "pytorch"
    assert meta["platform"] == "onnxruntime" and meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 2]}]
    np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(4, 2), x @ w, rtol=1e-6)


def test_every_file_passes_the_scanner_before_it_is_served(tmp_path):
    from modelkit.errors import UnsafeFileError
    from modelkit.testing.payloads import system_pickle, torch_zip

    evil = tmp_path / "evil.pt"
    evil.write_bytes(torch_zip(system_pickle(f"touch {tmp_path / 'pwned'}")))
    with pytest.raises(UnsafeFileError, match="refused: pickle.global.denied posix.system"):
        modelkit.serve([evil], trust=True)
    assert not (tmp_path / "pwned").exists()


def test_kserve_model_dir_serves_its_one_file_or_the_model_folder(tmp_path, files):
    from click.testing import CliRunner

    from modelkit.cli import EXIT_ERROR, main
    from modelkit.cli.serve import _model_dir

    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(files["cnn"], one / "model.safetensors")
    assert _model_dir(str(one), "digits") == f"digits={one / 'model.safetensors'}"
    assert _model_dir(str(files["llama"]), None) == str(files["llama"])          # a model folder, as it is
    two = tmp_path / "two"
    two.mkdir()
    for stem in ("a", "b"):
        shutil.copy(files["cnn"], two / f"{stem}.safetensors")
    result = CliRunner().invoke(main, ["serve", "--model_dir", str(two)])
    assert result.exit_code == EXIT_ERROR and "holds 2 entries (a.safetensors, b.safetensors)" in result.stderr
    result = CliRunner().invoke(main, ["serve", "--json"])
    assert result.exit_code == EXIT_ERROR and "give a MODEL to serve" in json.loads(result.stdout)["error"]["message"]


def test_a_v2_model_name_with_a_slash_is_refused(files):
    from modelkit.errors import ConfigError

    with pytest.raises(ConfigError, match="model name 'a/b': a v2 model's name must be non-empty without '/'"):
        modelkit.serve({"a/b": files["mlp"]})


def test_a_folder_given_as_dot_is_named_after_the_folder(tmp_path, monkeypatch):
    from modelkit.pipeline.serve import model_names

    (tmp_path / "qwen").mkdir()
    monkeypatch.chdir(tmp_path / "qwen")
    assert model_names([".", "lm=."]) == {"qwen": Path("."), "lm": Path(".")}


@pytest.mark.parametrize("host, expected", [("127.0.0.1", "Address already in use; pick another --port"),
                                            ("no-such-host.invalid", "--host no-such-host.invalid: cannot be resolved")])
def test_a_port_in_use_or_a_bad_host_is_one_line_before_any_model_loads(tmp_path, host, expected):
    import socket

    from click.testing import CliRunner

    from modelkit.cli import EXIT_ERROR, main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", str(tmp_path / "not-loaded.safetensors"), "--host", host,
                                           "--port", str(port)])
    assert result.exit_code == EXIT_ERROR and expected in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


# ------------------------------------------------------------------------------------------ OpenAI, in-process
@pytest.mark.parametrize("model", ["tinylm", "llama"])
def test_completions_equal_greedy_generate_streaming_and_not(client, loaded, model):
    for prompt, tokens in zip(PROMPTS if model == "tinylm" else PROMPTS[:2], (20, 30, 5, 12), strict=False):
        expected = _generated(loaded, model, prompt, tokens)
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
        r = client.post("/v1/completions", json=body).json()
        assert r["choices"][0]["text"] == expected and r["choices"][0]["finish_reason"] in ("length", "stop")
        assert r["usage"]["completion_tokens"] <= tokens and r["object"] == "text_completion"
        events = client.post("/v1/completions", json={**body, "stream": True}).text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected
        assert chunks[-1]["choices"][0]["finish_reason"] == r["choices"][0]["finish_reason"]


def test_chat_uses_the_template_and_stop_seed_and_usage_work(client, files, loaded):
    expected = _generated(loaded, "llama", "Hi there", 10, chat=True)
    body = {"model": "llama", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
            "max_tokens": 10, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body).json()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert r["usage"]["prompt_tokens"] == len(modelkit.pipeline.generate.prompt_ids(
        transformers.AutoTokenizer.from_pretrained(files["llama"]), "Hi there", chat=True))
    text = _generated(loaded, "tinylm", "def ", 30)
    stop = text[10:13]
    r = client.post("/v1/completions", json={"model": "tinylm", "prompt": "def ", "max_tokens": 30, "temperature": 0,
                                             "stop": [stop]}).json()
    assert r["choices"][0] == {"index": 0, "text": text[:text.index(stop)], "logprobs": None, "finish_reason": "stop"}
    sampled = [client.post("/v1/completions", json={"model": "tinylm", "prompt": "def ", "max_tokens": 20,
                                                    "temperature": 0.9, "top_p": 0.8, "seed": seed}).json()
               ["choices"][0]["text"] for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]
    r = client.post("/v1/completions", json={"model": "tinylm", "prompt": "ab", "max_tokens": 0}).json()
    assert r["choices"][0]["text"] == "" and r["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tinylm", "llama"]
    metrics = client.get("/metrics").text
    assert 'modelkit_requests_total{model="llama",route="v1/chat/completions",status="200"} 1.0' in metrics
    assert float(metrics.split('modelkit_generated_tokens_total{model="tinylm"} ')[1].split()[0]) >= 30


@pytest.mark.parametrize("model", ["tinylm", "llama"])
def test_sequences_of_different_lengths_share_decode_steps(loaded, model):
    """The decoder itself: prompts of different lengths prefilled, then decoded together one step at a time
    (per-sequence positions, padding masks); each row's greedy tokens equal `generate`'s alone."""
    from modelkit.pipeline.serve_text import HFDecoder, Job, Sampling, TinyLMDecoder

    lm = loaded[model]
    decoder = TinyLMDecoder(lm.model, slots=4) if model == "tinylm" else HFDecoder(lm.model)
    prompts = PROMPTS if model == "tinylm" else PROMPTS[:2] + ["Once upon a time, in a land far away"]
    tokens = 24
    jobs = []
    for prompt in prompts:
        ids = list(prompt.encode()) or [10] if model == "tinylm" else list(lm.tokenizer(prompt)["input_ids"])
        job = Job(ids, Sampling(tokens), lambda event: None)
        job.ids.append(int(decoder.prefill(job).argmax()))
        jobs.append(job)
    finished = jobs.pop(1)                  # a sequence that leaves early: its slot is reused by the others
    decoder.release(finished)
    with torch.no_grad():
        for _ in range(tokens - 1):
            for job, logits in zip(jobs, decoder.step(jobs), strict=True):
                job.ids.append(int(logits.argmax()))
    for prompt, job in zip([p for i, p in enumerate(prompts) if i != 1], jobs, strict=True):
        new = job.ids[job.prompt_tokens:]
        expected = _generated(loaded, model, prompt, tokens)
        assert (bytes(new).decode("utf-8", errors="replace") if model == "tinylm"
                else lm.tokenizer.decode(new, skip_special_tokens=True)) == expected


# ------------------------------------------------------------------------------------------ the live server
# One server for these three, on one xdist worker, in this order: the last one stops it.
live_group = pytest.mark.xdist_group("serve-live")


@live_group
def test_tritonclient_and_openai_against_a_live_server(live, files, loaded):
    import tritonclient.http as triton
    from openai import OpenAI

    base, _ = live
    c = triton.InferenceServerClient(base.removeprefix("http://"))
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("cnn")
    assert c.get_model_metadata("cnn")["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    for model in ("cnn", "mlp"):
        x = _image(5, model)
        given = triton.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x)                                    # binary, tritonclient's default
        np.testing.assert_allclose(c.infer(model, [given]).as_numpy("logits"), _reference(files, model, x), rtol=0, atol=ATOL)
    with pytest.raises(triton.InferenceServerException, match="no model 'nope'"):
        c.infer("nope", [given])
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    expected = _generated(loaded, "tinylm", "def ", 25)
    assert client.completions.create(model="tinylm", prompt="def ", max_tokens=25, temperature=0).choices[0].text == expected
    stream = client.completions.create(model="tinylm", prompt="def ", max_tokens=25, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == expected


@live_group
def test_kserve_client_against_a_live_server(live, files):
    kserve = pytest.importorskip("kserve", reason="the KServe client: pip install 'modelkit[serve-judges]'")
    base, _ = live
    x = _image(4)

    async def run() -> list:
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2"))
        outs = []
        for binary in (False, True):
            given = kserve.InferInput("x", list(x.shape), "FP32")
            given.set_data_from_numpy(x, binary_data=binary)
            res = await client.infer(base, kserve.InferRequest(model_name="cnn", infer_inputs=[given]), model_name="cnn")
            outs.append(res.outputs[0].as_numpy())
        assert await client.is_model_ready(base, "cnn")
        await client.close()
        return outs
    for out in asyncio.run(run()):
        np.testing.assert_allclose(out, _reference(files, "cnn", x), rtol=0, atol=ATOL)


@live_group
def test_sigterm_lets_the_stream_in_flight_finish(live, loaded):
    """SIGTERM while a completion streams: the stream still ends with every token and [DONE], then the server
    exits 0 (drained, not killed by the signal) and logged the request's id."""
    base, process = live
    expected = _generated(loaded, "tinylm", "x", 120)          # past the 64-byte window: a full pass per token
    text, done = "", False
    with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                      json={"model": "tinylm", "prompt": "x", "max_tokens": 120, "temperature": 0, "stream": True}) as r:
        request_id = r.headers["x-request-id"]
        for i, line in enumerate(r.iter_lines()):
            if i == 0:
                process.send_signal(signal.SIGTERM)
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
    assert done and text == expected
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, (process.returncode, stderr[-500:])          # drained: exit 0, not by SIGTERM
    assert f"request {request_id} POST /v1/completions -> 200" in stderr
