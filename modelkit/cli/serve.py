"""`modelkit serve`: models behind HTTP (Open Inference Protocol v2, OpenAI routes), run by uvicorn."""
from __future__ import annotations

import errno
import signal
import socket
from pathlib import Path

import click

from modelkit.cli.options import device_option, output_options, read_options
from modelkit.formats import RUNTIMES


def _model_dir(model_dir: str, name: str | None) -> str:
    """KServe's --model_dir: the folder the storage initializer filled. A model folder (config.json) is served as
    it is; a folder of one file serves that file."""
    folder = Path(model_dir)
    files = [p for p in folder.iterdir() if not p.name.startswith(".")] if folder.is_dir() else []
    path = files[0] if len(files) == 1 and files[0].is_file() and not (folder / "config.json").exists() else folder
    if path == folder and folder.is_dir():
        from modelkit.errors import FormatError
        from modelkit.formats import detect_format

        try:
            detect_format(folder)
        except FormatError:
            shown = ", ".join(sorted(p.name for p in files)[:4]) + (", ..." if len(files) > 4 else "")
            raise click.BadParameter(f"{model_dir} holds {len(files)} entries ({shown or 'none'}) and is not a model "
                                     "folder; give a folder holding one model file, or the model's path as MODEL",
                                     param_hint="--model_dir") from None
    return f"{name}={path}" if name else str(path)


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM while the models load: stop now, as the signal would (a container's PID 1 ignores a signal it has no
    handler for, so `docker stop` would wait its timeout and kill)."""
    raise SystemExit(128 + signum)


def _drained(signum: int, frame: object) -> None:
    """SIGTERM after uvicorn's graceful shutdown: the requests finished, the process exits 0."""


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, taken before any model loads, so a port in use or an address this machine
    lacks is one line of error at once, not uvicorn's log after the models loaded. uvicorn listens on it."""
    from modelkit.errors import ConfigError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ConfigError(f"--host {host}: cannot be resolved to an address ({e.strerror or e}); "
                          f"pass 127.0.0.1, 0.0.0.0 or one of its interfaces' addresses") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        fix = "pick another --port (0: any free one)" if e.errno == errno.EADDRINUSE else "pick another --host or --port"
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}; {fix}") from e
    return sock


@click.command()
@click.argument("models", nargs=-1, metavar="[NAME=]MODEL...")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", "--http_port", "port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="HTTP port (--http_port: KServe's name).")
@click.option("--model_name", "--model-name", "model_name", help="KServe: the name of the model in --model_dir.")
@click.option("--model_dir", "--model-dir", "model_dir", type=click.Path(exists=True),
              help="KServe: the folder holding the model (a model folder, or a folder with one model file).")
@click.option("--max-batch", type=click.IntRange(1), default=32, show_default=True,
              help="Rows of a tensor model run together; sequences of a language model decoded together.")
@click.option("--batch-timeout-ms", type=click.FloatRange(0), default=2.0, show_default=True,
              help="How long a tensor batch that is not full waits for more requests.")
@click.option("--max-queue", type=click.IntRange(1), default=256, show_default=True,
              help="Requests waiting per model; more are refused with 503.")
@click.option("--max-body-mb", type=click.FloatRange(0, min_open=True), default=64.0, show_default=True,
              help="Largest request body in MiB; larger ones get 413.")
@click.option("--graceful-timeout", type=click.FloatRange(0), default=30.0, show_default=True,
              help="On SIGTERM/SIGINT, seconds in-flight requests get to finish.")
@click.option("--input-shape", "--example-input", "input_shapes", multiple=True, metavar="NAME=DIMS[:DTYPE]",
              help="A user's module (--arch module:function): an input, batch axis first; repeat for several.")
@click.option("--runtime", type=click.Choice(RUNTIMES), default="torch", show_default=True,
              help="onnxruntime: run ONNX files in an onnxruntime session instead of torch.")
@device_option
@read_options()
@output_options
def serve(models: tuple[str, ...], host: str, port: int, model_name: str | None, model_dir: str | None, max_batch: int,
          batch_timeout_ms: float, max_queue: int, max_body_mb: float, graceful_timeout: float,
          input_shapes: tuple[str, ...], runtime: str, device: str, source_format: str | None, trust: bool, key: str | None, arch: str | None,
          as_json: bool) -> None:
    """Serve MODEL files or folders over HTTP until SIGTERM or Ctrl-C.

    Tensor models (the zoo, ONNX, TorchScript, quantized files, users' modules with --arch) answer the Open
    Inference Protocol v2 (/v2/models/NAME/infer: tritonclient, the KServe client); language models (tinylm,
    Hugging Face causal LMs with their tokenizer) answer OpenAI's /v1/completions and /v1/chat/completions.
    Every file passes the scanner first. Names are the files' stems unless given as NAME=MODEL. Prometheus
    metrics at /metrics. docs/serving.md shows the routes, a KServe ServingRuntime and a Dockerfile.

    \b
    Examples:
      modelkit serve runs/cnn/model.safetensors --port 8080
      modelkit serve cnn=runs/cnn/model.onnx lm=./Qwen2.5-0.5B-Instruct --host 0.0.0.0
      modelkit serve --model_name cnn --model_dir /mnt/models --http_port 8080 --host 0.0.0.0
    """
    import logging

    previous = signal.signal(signal.SIGTERM, _terminated)          # before the imports and loads that take seconds
    click.get_current_context().call_on_close(lambda: signal.signal(signal.SIGTERM, previous))
    import uvicorn

    from modelkit.pipeline.serve import serve as build

    items = list(models)
    if model_dir is not None:
        items.append(_model_dir(model_dir, model_name))
    elif model_name is not None:
        if len(items) != 1:
            raise click.UsageError("--model_name names one model: give one MODEL or --model_dir")
        items = [f"{model_name}={items[0]}"]
    if not items:
        raise click.UsageError("give a MODEL to serve (or --model_dir)")
    logger = logging.getLogger("modelkit")
    if logger.getEffectiveLevel() > logging.INFO and logger.level != logging.ERROR:     # -q keeps ERROR
        logger.setLevel(logging.INFO)            # a server's log: one line per request with its id
    sock = _listening_socket(host, port)
    app = build(items, format=source_format, trust=trust, key=key, arch=arch, input_shapes=input_shapes,
                device=device, runtime=runtime, max_batch=max_batch, batch_timeout_ms=batch_timeout_ms, max_queue=max_queue,
                max_body_bytes=int(max_body_mb * 1024 * 1024))
    routes = [f"{', '.join(names)} ({protocol})" for names, protocol in ((app.state.modelkit.tensors, "v2"),
                                                                         (app.state.modelkit.texts, "OpenAI")) if names]
    shown = f"[{host}]" if ":" in host else host                     # an IPv6 address in a URL
    click.echo(f"serving {' and '.join(routes)} on http://{shown}:{sock.getsockname()[1]}", err=True)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=graceful_timeout)
    # uvicorn drains on SIGTERM, restores the handler it found and sends the signal again, so the process would
    # end by it (143 under tini or a shell; a container's PID 1 ignores it and exits 0). The handler it finds is
    # this no-op: a drained shutdown exits 0 wherever it runs.
    signal.signal(signal.SIGTERM, _drained)
    uvicorn.Server(config).run(sockets=[sock])
