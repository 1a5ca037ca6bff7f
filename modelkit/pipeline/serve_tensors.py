"""Tensor models behind `modelkit serve`: the Open Inference Protocol v2 tensors and dynamic batching.

A request's tensors arrive as JSON (`datatype`, `shape`, row-major `data`) or in the binary-data extension
that tritonclient sends by default (the JSON header's length in `Inference-Header-Content-Length`, each
tensor's raw little-endian bytes after it, sized by `parameters.binary_data_size`). Responses answer in the
same two forms: binary when the request asks for it (`parameters.binary_data_output`, or an output's
`parameters.binary_data`), JSON otherwise.

Concurrent requests to one model are batched: `Batcher` takes what is queued (at most `max_batch` rows; it
waits up to `timeout_ms` for more while the batch is not full), stacks requests whose item shapes agree along
axis 0, runs the module once in a worker thread and hands each request its rows back.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from modelkit.errors import ConfigError, RequestError

if TYPE_CHECKING:
    from torch import nn

# v2 datatype -> numpy type (little-endian, as the binary extension stores them). BYTES (strings) and BF16
# (no numpy type) are refused with a reason.
DATATYPES = {"BOOL": "bool", "UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "INT8": "<i1",
             "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}
_NUMPY_TO_V2 = {(np.dtype(v).kind, np.dtype(v).itemsize): k for k, v in DATATYPES.items()}
HEADER_LENGTH = "Inference-Header-Content-Length"


def v2_datatype(array_dtype: Any) -> str:
    """The v2 name of a numpy dtype (ConfigError for one v2 cannot carry)."""
    dtype = np.dtype(array_dtype)
    name = _NUMPY_TO_V2.get((dtype.kind, dtype.itemsize))
    if name is None:
        raise ConfigError(f"the model uses {dtype}, which the v2 protocol has no datatype for")
    return name


@dataclass(frozen=True)
class TensorSpec:
    """One input or output in model metadata: -1 marks the batch axis (any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass
class InferRequest:
    """A decoded v2 infer request: its inputs by name, and how the response should carry each output."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[str] | None                    # the names asked for; None: all
    binary: dict[str, bool] = field(default_factory=dict)       # per output name
    binary_default: bool = False


def _load_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None


def decode_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    """Parse a v2 infer request body (JSON, or JSON + binary tensors); RequestError for anything malformed."""
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            raise RequestError(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 < length <= len(body):
            raise RequestError(f"{HEADER_LENGTH} {length} is outside the body's {len(body)} bytes")
        document, binary = _load_json(body[:length]), memoryview(body)[length:]
    else:
        document, binary = _load_json(body), memoryview(b"")
    if not isinstance(document, dict) or not isinstance(document.get("inputs"), list) or not document["inputs"]:
        raise RequestError('the request needs "inputs": a non-empty list of tensors')
    parameters = _parameters(document, "the request")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for item in document["inputs"]:
        name, array, used = _decode_tensor(item, binary, offset)
        if name in inputs:
            raise RequestError(f"input {name!r} is given twice")
        inputs[name] = array
        offset += used
    if offset != len(binary):
        raise RequestError(f"the body holds {len(binary) - offset} bytes of binary data no input claims")
    outputs, binary_flags = None, {}
    if document.get("outputs") is not None:
        if not isinstance(document["outputs"], list):
            raise RequestError('"outputs" must be a list of {"name": ...}')
        outputs = []
        for item in document["outputs"]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise RequestError('each requested output needs a "name"')
            outputs.append(item["name"])
            flag = _parameters(item, f"output {item['name']!r}").get("binary_data")
            if flag is not None:
                binary_flags[item["name"]] = bool(flag)
    request_id = document.get("id")
    return InferRequest(None if request_id is None else str(request_id), inputs, outputs, binary_flags,
                        bool(parameters.get("binary_data_output", False)))


def _parameters(item: dict[str, Any], what: str) -> dict[str, Any]:
    parameters = item.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise RequestError(f'{what}: "parameters" must be an object')
    return parameters


def _decode_tensor(item: Any, binary: memoryview, offset: int) -> tuple[str, np.ndarray, int]:
    """One input tensor -> (name, array, binary bytes it used)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise RequestError('each input needs "name", "datatype", "shape" and "data"')
    name = item["name"]
    datatype, shape = item.get("datatype"), item.get("shape")
    if datatype not in DATATYPES:
        raise RequestError(f"input {name!r}: datatype {datatype!r} is not supported; use one of "
                           f"{', '.join(DATATYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise RequestError(f'input {name!r}: "shape" must be a list of non-negative integers, got {shape!r}')
    count = math.prod(shape)
    dtype = np.dtype(DATATYPES[datatype])
    size = _parameters(item, f"input {name!r}").get("binary_data_size")
    if size is not None:
        if type(size) is not int or size != count * dtype.itemsize:
            raise RequestError(f"input {name!r}: binary_data_size {size!r} does not match shape {shape} of "
                               f"{datatype} ({count * dtype.itemsize} bytes)")
        if offset + size > len(binary):
            raise RequestError(f"input {name!r}: the body ends before its {size} bytes of binary data")
        array = np.frombuffer(binary[offset:offset + size], dtype=dtype).reshape(shape)
        return name, array.astype(dtype.newbyteorder("="), copy=True), size
    if "data" not in item:
        raise RequestError(f'input {name!r}: no "data" and no binary_data_size')
    return name, _from_json_data(name, item["data"], datatype, dtype, shape, count), 0


def _from_json_data(name: str, data: Any, datatype: str, dtype: np.dtype, shape: list[int], count: int) -> np.ndarray:
    try:
        values = np.asarray(data)
    except ValueError:
        raise RequestError(f'input {name!r}: "data" is ragged; give it flat or nested row-major') from None
    kinds = {"b": "b", "i": "biu", "u": "biu", "f": "biuf"}[dtype.kind]
    if values.size and values.dtype.kind not in kinds:
        raise RequestError(f"input {name!r}: data holds {_kind_name(values.dtype.kind)} values, not {datatype}")
    if values.size != count:
        raise RequestError(f"input {name!r}: shape {shape} needs {count} values, data has {values.size}")
    if dtype.kind in "iu" and values.size:
        info = np.iinfo(dtype)
        if values.min() < info.min or values.max() > info.max:
            raise RequestError(f"input {name!r}: values outside the range of {datatype}")
    return values.astype(dtype.newbyteorder("=")).reshape(shape)


def _kind_name(kind: str) -> str:
    return {"U": "string", "S": "bytes", "O": "mixed", "f": "floating-point", "b": "boolean"}.get(kind, "integer")


def encode_infer_response(model_name: str, request: InferRequest, outputs: dict[str, np.ndarray]) \
        -> tuple[bytes, dict[str, str]]:
    """The response body and headers: JSON, with the outputs asked for in binary after it."""
    names = request.outputs if request.outputs is not None else list(outputs)
    items, chunks = [], []
    for name in names:
        array = np.ascontiguousarray(outputs[name])
        item: dict[str, Any] = {"name": name, "datatype": v2_datatype(array.dtype), "shape": list(array.shape)}
        if request.binary.get(name, request.binary_default):
            raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            item["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            item["data"] = array.reshape(-1).tolist()
        items.append(item)
    document: dict[str, Any] = {"model_name": model_name, "outputs": items}
    if request.id is not None:
        document["id"] = request.id
    header = json.dumps(document, separators=(",", ":")).encode()
    if not chunks:
        return header, {"content-type": "application/json"}
    return b"".join([header, *chunks]), {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(header))}


class TensorModel:
    """A module that takes and returns tensors, with the signature its metadata shows.

    Args:
        name: The name clients use.
        module: The runnable model (eval mode).
        example: Example inputs, one per forward argument (batch axis first): give the names, dtypes and item
            shapes. Their outputs give the output specs.
        input_names: One per example input.
        output_names: One per output (a module returning one tensor: one name).
        platform: What metadata reports as the platform ("pytorch", or the file's format).
    """

    def __init__(self, name: str, module: nn.Module, example: Sequence[Any], input_names: Sequence[str],
                 output_names: Sequence[str] | None = None, *, platform: str = "pytorch") -> None:
        self.name, self.module, self.platform = name, module.eval(), platform
        arrays = [t.numpy() for t in example]
        self.inputs = [TensorSpec(n, v2_datatype(a.dtype), (-1, *a.shape[1:])) for n, a in zip(input_names, arrays, strict=True)]
        outputs = self._run(arrays)
        names = list(output_names or (["logits"] if len(outputs) == 1 else [f"output_{i}" for i in range(len(outputs))]))
        if len(names) != len(outputs):
            raise ConfigError(f"{name}: {len(outputs)} outputs but {len(names)} output names")
        self.outputs = [TensorSpec(n, v2_datatype(a.dtype), (-1, *a.shape[1:])) for n, a in zip(names, outputs, strict=True)]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "versions": ["1"], "platform": self.platform,
                "inputs": [s.to_dict() for s in self.inputs], "outputs": [s.to_dict() for s in self.outputs]}

    def check(self, request: InferRequest) -> list[np.ndarray]:
        """The request's inputs in forward's order, checked against the metadata (RequestError: which and why)."""
        known = [s.name for s in self.inputs]
        for name in request.inputs:
            if name not in known:
                raise RequestError(f"model {self.name!r} has no input {name!r}; inputs: {', '.join(known)}")
        for name in request.outputs or ():
            if name not in (s.name for s in self.outputs):
                raise RequestError(f"model {self.name!r} has no output {name!r}; outputs: "
                                   f"{', '.join(s.name for s in self.outputs)}")
        arrays, rows = [], None
        for spec in self.inputs:
            array = request.inputs.get(spec.name)
            if array is None:
                raise RequestError(f"model {self.name!r} needs input {spec.name!r} ({spec.datatype} {list(spec.shape)})")
            if v2_datatype(array.dtype) != spec.datatype:
                raise RequestError(f"input {spec.name!r} must be {spec.datatype}, got {v2_datatype(array.dtype)}")
            if array.ndim != len(spec.shape) or any(want not in (-1, got) for want, got in zip(spec.shape, array.shape, strict=True)):
                raise RequestError(f"input {spec.name!r} must have shape {list(spec.shape)} (-1: any), got {list(array.shape)}")
            if rows is not None and array.shape[0] != rows:
                raise RequestError(f"inputs disagree on the batch size ({rows} and {array.shape[0]})")
            rows = array.shape[0]
            arrays.append(array)
        if not rows:
            raise RequestError("the batch is empty (axis 0 has size 0)")
        return arrays

    def _run(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        import torch

        weight = next((p for p in self.module.parameters() if p.is_floating_point()), None)
        device = weight.device if weight is not None else torch.device("cpu")

        def tensor(a: np.ndarray) -> torch.Tensor:     # float inputs in the weights' type (a bfloat16 model takes FP32)
            t = torch.from_numpy(np.ascontiguousarray(a)).to(device)
            return t.to(weight.dtype) if weight is not None and t.is_floating_point() else t

        with torch.inference_mode():
            out = self.module(*(tensor(a) for a in arrays))
        outs = out if isinstance(out, (tuple, list)) else [out]
        return [_numpy(o) if isinstance(o, torch.Tensor) else np.asarray(o) for o in outs]

    def run_batch(self, batch: Sequence[Sequence[np.ndarray]]) -> list[list[np.ndarray]]:
        """Run several requests' inputs as one batch (axis 0); each request's output rows, in order."""
        stacked = [np.concatenate(parts) if len(parts) > 1 else parts[0] for parts in zip(*batch, strict=True)]
        outputs = self._run(stacked)
        bounds = np.cumsum([0, *(arrays[0].shape[0] for arrays in batch)])
        return [[o[bounds[i]:bounds[i + 1]] for o in outputs] for i in range(len(batch))]


def _numpy(t: Any) -> np.ndarray:
    """A model's output as numpy: bfloat16 (no numpy type) widened to float32, as `eval` reads it."""
    import torch

    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def model_failure(exc: BaseException) -> RequestError:
    """The model's own exception as a 500 with one line."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return RequestError(f"the model failed: {type(exc).__name__}: {first[:300]}", 500)


def forward_names(module: nn.Module, count: int) -> list[str]:
    """forward's positional parameter names for `count` inputs (input_<i> past them)."""
    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"input_{i}" for i in range(count)]


@dataclass
class _Job:
    arrays: list[np.ndarray]
    future: asyncio.Future[list[np.ndarray]]

    @property
    def key(self) -> tuple[Any, ...]:      # requests batch together when their item shapes and dtypes agree
        return tuple((a.shape[1:], a.dtype.str) for a in self.arrays)

    @property
    def rows(self) -> int:
        return self.arrays[0].shape[0]


class Batcher:
    """Dynamic batching for one TensorModel: a bounded queue and one task that runs what is queued.

    Args:
        model: What to run.
        max_batch: Rows in one run (a single larger request still runs, alone).
        timeout_ms: How long a batch that is not full waits for more requests after the first.
        max_queue: Requests waiting at most; one more is refused with 503.
        on_batch: Called with each run's (requests, rows, seconds), for metrics.
    """

    def __init__(self, model: TensorModel, *, max_batch: int, timeout_ms: float, max_queue: int,
                 on_batch: Any = None) -> None:
        self.model, self.max_batch, self.timeout = model, max_batch, timeout_ms / 1000
        self.queue: asyncio.Queue[_Job] = asyncio.Queue(maxsize=max_queue)
        self.on_batch = on_batch
        self._held: _Job | None = None          # taken from the queue but of another shape: first next time
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher:{self.model.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def submit(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        job = _Job(arrays, asyncio.get_running_loop().create_future())
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            raise RequestError(f"model {self.model.name!r}: {self.queue.maxsize} requests are already waiting; "
                               "retry later", 503) from None
        self._arrived.set()
        return await job.future

    async def _next(self, deadline: float | None) -> _Job | None:
        """The next job: the one held back first, else the queue's; waits until `deadline` (loop time; None: for
        ever). Waiting is on an event, never on a cancelled `queue.get()`, so no job is lost to a timeout."""
        if self._held is not None:
            job, self._held = self._held, None
            return job
        loop = asyncio.get_running_loop()
        while self.queue.empty():
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return None
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)
        return self.queue.get_nowait()

    async def _loop(self) -> None:
        import time

        loop = asyncio.get_running_loop()
        while True:
            first = await self._next(None)
            jobs, rows = [first], first.rows
            deadline = loop.time() + self.timeout
            while rows < self.max_batch:
                job = await self._next(deadline)
                if job is None:
                    break
                if job.key != first.key or rows + job.rows > self.max_batch:
                    self._held = job
                    break
                jobs.append(job)
                rows += job.rows
            jobs = [j for j in jobs if not j.future.done()]     # a client that went away
            if not jobs:
                continue
            started = time.perf_counter()
            try:
                results = await asyncio.to_thread(self.model.run_batch, [j.arrays for j in jobs])
            except Exception as e:  # the model's own failure: every request of the batch gets it as a 500
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(model_failure(e))
                continue
            if self.on_batch is not None:
                self.on_batch(len(jobs), rows, time.perf_counter() - started)
            for j, result in zip(jobs, results, strict=True):
                if not j.future.done():
                    j.future.set_result(result)
