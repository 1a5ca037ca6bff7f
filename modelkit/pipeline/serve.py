"""`modelkit serve`: models behind HTTP, as an ASGI app (Starlette; uvicorn runs it).

Routes:
- Open Inference Protocol v2 (KServe, Triton, MLServer clients): `GET /v2/health/live`, `/v2/health/ready`,
  `/v2`, `/v2/models/{name}[/versions/{v}]`, `.../ready`, `POST .../infer` (modelkit.pipeline.serve_tensors).
- OpenAI-compatible, for language models: `GET /v1/models`, `POST /v1/completions`, `/v1/chat/completions`,
  with `stream: true` as server-sent events (modelkit.pipeline.serve_text).
- `GET /metrics`: Prometheus text.

Every file is opened by the loaders every command uses (the scanner gate first; `trust` as elsewhere).
Errors are `{"error": "one line"}` with a 4xx status (5xx only for the model's own failure or a full queue);
every response carries an `X-Request-ID` (the client's, or a new one), which the log lines name.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelkit.errors import ConfigError, ModelkitError, RequestError

log = logging.getLogger("modelkit.serve")
PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class ServeOptions:
    """How the server batches and what it accepts.

    Args:
        max_batch: Rows of a tensor model run together; sequences of a language model decoded together.
        batch_timeout_ms: How long a tensor batch that is not full waits for more requests.
        max_queue: Requests waiting per model; one more gets 503.
        max_body_bytes: Largest request body (after decompression); larger gets 413.
    """

    max_batch: int = 32
    batch_timeout_ms: float = 2.0
    max_queue: int = 256
    max_body_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 1 or self.max_body_bytes < 1:
            raise ConfigError("max_batch, max_queue and max_body_bytes must be positive")
        if self.batch_timeout_ms < 0:
            raise ConfigError(f"batch_timeout_ms must be >= 0, got {self.batch_timeout_ms}")


def model_names(paths: Sequence[PathLike] | Mapping[str, PathLike]) -> dict[str, Path]:
    """Names for the models: given ones, `NAME=PATH` items, else each file's stem (a folder's name)."""
    if isinstance(paths, Mapping):
        return {str(k): Path(v) for k, v in paths.items()}
    named: dict[str, Path] = {}
    for item in paths:
        text = os.fspath(item)
        name, sep, rest = text.partition("=")
        if sep and name and not Path(text).exists():
            path = Path(rest)
        else:
            path = Path(text)
            name = path.name if path.is_dir() else path.stem
        if name in named:
            raise ConfigError(f"two models are named {name!r} ({named[name]} and {path}); name them: NAME=PATH")
        named[name] = path
    return named


# --------------------------------------------------------------------------------------------- loading
def load_served(name: str, path: Path, *, format: str | None = None, trust: bool = False, key: str | None = None,
                arch: str | None = None, input_shapes: Sequence[str] | None = None, options: ServeOptions,
                metrics: Metrics, device: str = "auto", runtime: str = "torch") -> Any:
    """A TensorModel or TextModel for one file: language models (tinylm, a Hugging Face causal LM with its
    tokenizer) get the OpenAI routes, every other module the v2 routes. runtime="onnxruntime" runs an ONNX
    file in an onnxruntime session instead of the module its weights rebuild."""
    if runtime == "onnxruntime":
        from modelkit.pipeline.load import resolve_input

        path, fmt = resolve_input(path, format)
        if fmt == "onnx":                     # other formats run in torch as usual
            return onnx_session_model(name, path)
    from modelkit.models import hf_config_of, load_model_module
    from modelkit.models.tinylm import TinyLM
    from modelkit.pipeline.distributed import DistInfo, resolve_device
    from modelkit.pipeline.generate import eos_ids
    from modelkit.pipeline.load import load_language_model
    from modelkit.pipeline.serve_tensors import TensorModel, forward_names
    from modelkit.pipeline.serve_text import TextModel

    loaded = load_language_model(path, format=format, trust=trust, key=key, arch=arch)
    model = loaded.model.eval().to(resolve_device(device, DistInfo()))
    on_step = metrics.text_step(name)
    if isinstance(model, TinyLM):
        return TextModel(name, model, None, max_batch=options.max_batch, max_queue=options.max_queue, on_step=on_step)
    if hf_config_of(model) is not None:
        if loaded.tokenizer is None:
            raise ConfigError(f"{path} carries no tokenizer (tokenizer.json or tokenizer.model); copy the model's "
                              "tokenizer files into its folder to serve it")
        return TextModel(name, model, loaded.tokenizer, eos=eos_ids(loaded.tokenizer, model, dict(loaded.assets)),
                         max_batch=options.max_batch, max_queue=options.max_queue, on_step=on_step)
    if input_shapes:
        from modelkit.pipeline.inputs import example_inputs

        example = example_inputs(model, list(input_shapes))
        tensors, names = list(example.tensors), list(example.names)
    else:
        arch_name = getattr(type(model), "arch", None)
        make = getattr(load_model_module(arch_name), "example_inputs", None) if arch_name else None
        if make is None:
            raise ConfigError(f"{path}: a user's module needs its inputs described: --input-shape NAME=DIMS[:DTYPE] "
                              "(the first axis is the batch)")
        example = make(2)
        tensors = list(example) if isinstance(example, (tuple, list)) else [example]
        names = forward_names(model, len(tensors))
    return TensorModel(name, model, tensors, names, platform="pytorch")


# ONNX element types (onnxruntime's NodeArg.type) -> torch dtype names, for the example inputs of a session
_ORT_TYPES = {"tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int16)": "int16", "tensor(int8)": "int8",
              "tensor(uint8)": "uint8", "tensor(bool)": "bool"}


def onnx_session_model(name: str, path: Path) -> Any:
    """An ONNX file as a TensorModel run by onnxruntime (the converter's `runnable`: external data checked
    first). Inputs and outputs are the graph's, by name; axis 0 is the batch; other free axes are refused."""
    import torch
    from torch import nn

    from modelkit.formats import load_format
    from modelkit.pipeline.serve_tensors import TensorModel

    run = load_format("onnx").runnable(path)
    examples = []
    for arg in run.session.get_inputs():
        dtype = _ORT_TYPES.get(arg.type)
        items = list(arg.shape[1:])
        if dtype is None or not all(isinstance(d, int) and d > 0 for d in items):
            raise ConfigError(f"{path}: input {arg.name!r} ({arg.type}, shape {arg.shape}) needs a numeric type and "
                              "fixed sizes past the batch axis to be served")
        examples.append(torch.zeros((1, *items), dtype=getattr(torch, dtype)))

    class Session(nn.Module):
        def forward(self, *inputs: torch.Tensor) -> Any:
            return run(*inputs)

    return TensorModel(name, Session(), examples, run.input_names, [o.name for o in run.session.get_outputs()],
                       platform="onnxruntime")


# --------------------------------------------------------------------------------------------- metrics
class Metrics:
    """Prometheus series of one app (its own registry, so several apps live in one process)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("modelkit_requests", "HTTP requests answered", ["route", "model", "status"],
                                registry=self.registry)
        self.latency = Histogram("modelkit_request_seconds", "Time from request to the last byte of the answer",
                                 ["route", "model"], registry=self.registry,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.batch = Histogram("modelkit_batch_size", "Rows per tensor-model run; sequences per decode step",
                               ["model"], registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.tokens = Counter("modelkit_generated_tokens", "Tokens generated", ["model"], registry=self.registry)
        self.tokens_per_second = Gauge("modelkit_tokens_per_second", "Tokens per second of the last decode step",
                                       ["model"], registry=self.registry)
        self.queue = Gauge("modelkit_queue_depth", "Requests waiting", ["model"], registry=self.registry)

    def tensor_batch(self, name: str) -> Any:
        def record(requests: int, rows: int, seconds: float) -> None:
            self.batch.labels(name).observe(rows)
        return record

    def text_step(self, name: str) -> Any:
        def record(stats: Any) -> None:
            self.tokens.labels(name).inc(stats.tokens)
            if stats.batch:
                self.batch.labels(name).observe(stats.batch)
                if stats.seconds > 0:
                    self.tokens_per_second.labels(name).set(stats.tokens / stats.seconds)
        return record

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# --------------------------------------------------------------------------------------------- the app
def serve(models: Sequence[PathLike] | Mapping[str, PathLike], *, format: str | None = None, trust: bool = False,
          key: str | None = None, arch: str | None = None, input_shapes: Sequence[str] | None = None,
          device: str = "auto", runtime: str = "torch", max_batch: int = 32, batch_timeout_ms: float = 2.0, max_queue: int = 256,
          max_body_bytes: int = 64 * 1024 * 1024) -> Any:
    """Load the models and return the ASGI app that serves them (Starlette; run it with uvicorn, or mount it
    in tests with starlette's TestClient). Each model loads through the scanner gate, as every command does.

    Args:
        models: Model files or folders (any `load_module` runs), or {name: path}; names default to each file's
            stem, and `NAME=PATH` items name one.
        format, trust, key, arch: As for `load_module`, for every model.
        input_shapes: For a user's module (`arch="module:function"`): its inputs, `NAME=DIMS[:DTYPE]`, batch first.
        device: Where the models run: "auto" (cuda, then mps, then cpu), "cpu", "cuda", "mps".
        runtime: "torch", or "onnxruntime" to run the ONNX files among them in an onnxruntime session (CPU).
        max_batch, batch_timeout_ms, max_queue, max_body_bytes: see ServeOptions.

    Example:
        >>> app = modelkit.serve(["runs/cnn/model.safetensors"])            # doctest: +SKIP
        >>> uvicorn.run(app, port=8080)                                       # doctest: +SKIP
    """
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
    except ModuleNotFoundError as e:
        from modelkit.errors import MissingDependencyError

        raise MissingDependencyError(f"serving needs {e.name}: pip install 'modelkit[serve]'") from e
    options = ServeOptions(max_batch=max_batch, batch_timeout_ms=batch_timeout_ms, max_queue=max_queue,
                           max_body_bytes=max_body_bytes)
    metrics = Metrics()
    named = model_names(models)
    if not named:
        raise ConfigError("give at least one model to serve")
    loaded = {name: load_served(name, path, format=format, trust=trust, key=key, arch=arch, input_shapes=input_shapes,
                                options=options, metrics=metrics, device=device, runtime=runtime)
              for name, path in named.items()}
    return build_app(loaded, options, metrics)


def build_app(models: Mapping[str, Any], options: ServeOptions, metrics: Metrics | None = None) -> Any:
    """The Starlette app over loaded TensorModels and TextModels."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    from modelkit.pipeline.serve_tensors import Batcher, TensorModel

    metrics = metrics or Metrics()
    tensors = {n: m for n, m in models.items() if isinstance(m, TensorModel)}
    texts = {n: m for n, m in models.items() if n not in tensors}
    state = _State(tensors, texts, options, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        for name, model in tensors.items():
            state.batchers[name] = Batcher(model, max_batch=options.max_batch, timeout_ms=options.batch_timeout_ms,
                                           max_queue=options.max_queue, on_batch=metrics.tensor_batch(name))
            state.batchers[name].start()
        for model in texts.values():
            model.engine.start()
        state.ready = True
        log.info("serving %s", ", ".join(f"{n} ({'v1' if n in texts else 'v2'})" for n in models))
        try:
            yield
        finally:
            state.ready = False
            for batcher in state.batchers.values():
                await batcher.stop()
            for model in texts.values():
                await asyncio.to_thread(model.engine.stop)
            log.info("stopped")

    v2 = "/v2/models/{name}"
    routes = [
        Route("/v2/health/live", state.live), Route("/v2/health/ready", state.ready_route), Route("/v2", state.server),
        *(Route(prefix + suffix, handler, methods=methods)
          for prefix in (v2, v2 + "/versions/{version}")
          for suffix, handler, methods in (("", state.model_metadata, ["GET"]), ("/ready", state.model_ready, ["GET"]),
                                           ("/infer", state.infer, ["POST"]))),
        Route("/v1/models", state.list_models), Route("/v1/models/{name:path}", state.get_model),
        Route("/v1/completions", state.completions, methods=["POST"]),
        Route("/v1/chat/completions", state.chat, methods=["POST"]),
        Route("/metrics", state.metrics_route),
    ]
    from starlette.exceptions import HTTPException

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, ModelkitError: _request_error})
    app.add_middleware(_RequestIds, metrics=metrics, max_body_bytes=options.max_body_bytes, models=frozenset(models))
    app.state.modelkit = state
    return app


def _error(message: str, status: int, request: Any = None) -> Any:
    """{"error": message}; on the OpenAI routes OpenAI's shape, {"error": {"message", "type", "code"}}, which its
    clients show."""
    from starlette.responses import JSONResponse

    if request is not None and request.url.path.startswith("/v1/"):
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                            status_code=status)
    return JSONResponse({"error": message}, status_code=status)


async def _http_error(request: Any, exc: Any) -> Any:
    if exc.status_code == 404:
        return _error(f"no route {request.url.path}; see /v2/health/live, /v2/models/NAME, /v1/models", 404, request)
    if exc.status_code == 405:
        return _error(f"{request.method} is not allowed on {request.url.path}", 405, request)
    return _error(str(exc.detail), exc.status_code, request)


async def _request_error(request: Any, exc: ModelkitError) -> Any:
    status = exc.status if isinstance(exc, RequestError) else 400
    log.log(logging.ERROR if status >= 500 else logging.INFO, "request %s refused (%d): %s",
            request.scope.get("modelkit.request_id"), status, exc)
    return _error(str(exc), status, request)


class _RequestIds:
    """ASGI middleware: a request id on every request and response, one log line and the metrics per request,
    and the body limit (Content-Length checked up front; a body sent without one is counted as it arrives)."""

    def __init__(self, app: Any, *, metrics: Metrics, max_body_bytes: int, models: frozenset[str]) -> None:
        self.app, self.metrics, self.limit, self.models = app, metrics, max_body_bytes, models

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope["modelkit.request_id"] = request_id
        started, status = time.perf_counter(), [500]
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _send_json(send, 413, {"error": f"the request body is {int(length)} bytes; the limit is {self.limit}"},
                             request_id)
            return self._done(scope, 413, started, request_id)

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._done(scope, status[0], started, request_id)

    def _done(self, scope: dict[str, Any], status: int, started: float, request_id: str) -> None:
        seconds = time.perf_counter() - started
        route, model = _route_of(scope["path"], self.models)
        model = scope.get("modelkit.model", model)          # the OpenAI routes name it in the body
        self.metrics.requests.labels(route, model, str(status)).inc()
        self.metrics.latency.labels(route, model).observe(seconds)
        log.info("request %s %s %s -> %d in %.1f ms", request_id, scope["method"], scope["path"], status, seconds * 1000)


def _route_of(path: str, models: frozenset[str]) -> tuple[str, str]:
    """(route, model) labels without unbounded values: the model only where the path names a served one."""
    parts = path.strip("/").split("/")
    if parts[:2] == ["v2", "models"] and len(parts) >= 3:
        return "v2/" + (parts[-1] if parts[-1] in ("infer", "ready") else "metadata"), parts[2] if parts[2] in models else ""
    if parts[:1] == ["v1"] and "/".join(parts[:3]) in ("v1/completions", "v1/chat/completions", "v1/models"):
        return "/".join(parts[:3]), ""
    return (path if path in ("/metrics", "/v2", "/v2/health/live", "/v2/health/ready") else "other"), ""


async def _send_json(send: Any, status: int, document: dict[str, Any], request_id: str) -> None:
    body = json.dumps(document).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"x-request-id", request_id.encode("latin-1"))]})
    await send({"type": "http.response.body", "body": body})


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, at most `limit` bytes (413 past it), gzip/deflate Content-Encoding undone."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the request body is over the limit of {limit} bytes", 413)
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding in ("gzip", "deflate"):
        inflate = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        try:
            body = inflate.decompress(body, limit + 1)
        except zlib.error as e:
            raise RequestError(f"the body is not valid {encoding}: {e}") from None
        if len(body) > limit or inflate.unconsumed_tail:
            raise RequestError(f"the decompressed request body is over the limit of {limit} bytes", 413)
    elif encoding != "identity":
        raise RequestError(f"Content-Encoding {encoding!r} is not supported (gzip, deflate)", 415)
    return body


async def read_json(request: Any, limit: int) -> dict[str, Any]:
    body = await read_body(request, limit)
    try:
        document = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(document, dict):
        raise RequestError("the request body must be a JSON object")
    return document


class _State:
    """The handlers, over the served models."""

    def __init__(self, tensors: dict[str, Any], texts: dict[str, Any], options: ServeOptions, metrics: Metrics) -> None:
        self.tensors, self.texts, self.options, self.metrics = tensors, texts, options, metrics
        self.batchers: dict[str, Any] = {}
        self.ready = False

    # ---- v2
    async def live(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"live": True})

    async def ready_route(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"ready": self.ready}, status_code=200 if self.ready else 503)

    async def server(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        from modelkit import __version__

        return JSONResponse({"name": "modelkit", "version": __version__, "extensions": ["binary_tensor_data"]})

    def _tensor_model(self, request: Any) -> Any:
        name = request.path_params["name"]
        version = request.path_params.get("version")
        if name in self.texts:
            raise RequestError(f"model {name!r} is a language model: use /v1/completions or /v1/chat/completions", 404)
        if name not in self.tensors:
            from modelkit.errors import did_you_mean

            raise RequestError(f"no model {name!r}; served: {', '.join(self.tensors) or 'none'}"
                               f"{did_you_mean(name, self.tensors)}", 404)
        if version not in (None, "1"):
            raise RequestError(f"model {name!r} has one version, 1; got {version!r}", 404)
        return self.tensors[name]

    async def model_metadata(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(self._tensor_model(request).metadata())

    async def model_ready(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        model = self._tensor_model(request)
        return JSONResponse({"name": model.name, "ready": self.ready}, status_code=200 if self.ready else 503)

    async def infer(self, request: Any) -> Any:
        from starlette.responses import Response

        from modelkit.pipeline.serve_tensors import HEADER_LENGTH, decode_infer_request, encode_infer_response

        model = self._tensor_model(request)
        body = await read_body(request, self.options.max_body_bytes)
        decoded = decode_infer_request(body, request.headers.get(HEADER_LENGTH))
        arrays = model.check(decoded)
        outputs = await self.batchers[model.name].submit(arrays)
        content, headers = encode_infer_response(model.name, decoded, dict(zip((s.name for s in model.outputs), outputs,
                                                                                strict=True)))
        return Response(content, headers={k: v for k, v in headers.items() if k != "content-type"},
                        media_type=headers["content-type"])

    # ---- OpenAI
    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "modelkit"}

    async def list_models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [self._model_card(n) for n in self.texts]})

    async def get_model(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        name = request.path_params["name"]
        self.text_model(name)
        return JSONResponse(self._model_card(name))

    def text_model(self, name: Any, request: Any = None) -> Any:
        if not isinstance(name, str):
            raise RequestError('"model" must name a served language model (GET /v1/models lists them)')
        if name in self.tensors:
            raise RequestError(f"model {name!r} is not a language model: use POST /v2/models/{name}/infer", 404)
        if name not in self.texts:
            from modelkit.errors import did_you_mean

            raise RequestError(f"no language model {name!r}; served: {', '.join(self.texts) or 'none'}"
                               f"{did_you_mean(name, self.texts)}", 404)
        if request is not None:
            request.scope["modelkit.model"] = name      # the metrics' model label
        return self.texts[name]

    async def completions(self, request: Any) -> Any:
        from modelkit.pipeline.serve_openai import complete

        return await complete(self, await read_json(request, self.options.max_body_bytes), chat=False, request=request)

    async def chat(self, request: Any) -> Any:
        from modelkit.pipeline.serve_openai import complete

        return await complete(self, await read_json(request, self.options.max_body_bytes), chat=True, request=request)

    async def metrics_route(self, request: Any) -> Any:
        from starlette.responses import Response

        for name, batcher in self.batchers.items():
            self.metrics.queue.labels(name).set(batcher.queue.qsize())
        for name, model in self.texts.items():
            self.metrics.queue.labels(name).set(model.engine.waiting.qsize())
        content, media_type = self.metrics.render()
        return Response(content, headers={"content-type": media_type})
