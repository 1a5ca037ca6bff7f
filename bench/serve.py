"""`modelkit serve` under load: 64 concurrent clients against one sequential client, on the same live server.

    .venv/bin/python bench/serve.py [--seconds 60] [--clients 64] [--baseline-seconds 15] [--procs 2]
                                    [--max-batch 64] [--batch-timeout-ms 2] [--lm-clients 16] [--port 0]

It trains nothing: the CNN is the zoo's default architecture with seeded weights (throughput does not depend
on them), written to a temporary folder with tinylm beside it. One `modelkit serve` subprocess serves both;
the load comes from an asyncio generator (keep-alive connections, a few lines of asyncio
streams) in `--procs` processes (the clients split evenly), each
client posting one v2 infer request (one 8x8 image, JSON) after another.

It prints, from one run:
- CNN, one sequential client for `--baseline-seconds`: requests/s, p50/p99 latency;
- CNN, `--clients` concurrent clients for `--seconds`: requests/s, p50/p99, errors, mean batch size (from
  /metrics), and the throughput ratio to the sequential client (bar: >= 2x, zero errors);
- tinylm, `--lm-clients` concurrent greedy completions of 64 tokens against the same requests one at a time:
  generated tokens/s of each and their ratio (continuous batching sharing decode steps).

Both sides run on the same machine as the server: on a shared or small machine, the load generator takes
CPU from the server, so the ratio is the figure to compare, not the absolute rates.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BAR_RATIO = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_models(folder: Path) -> dict[str, Path]:
    import modelkit
    from modelkit.models import build

    paths = {"cnn": folder / "cnn.safetensors", "tinylm": folder / "tinylm.safetensors"}
    for name, path in paths.items():
        modelkit.export(build(name, seed=0).eval(), path)
    return paths


def start_server(paths: dict[str, Path], port: int, args: argparse.Namespace) -> subprocess.Popen:
    command = [sys.executable, "-m", "modelkit", "-q", "serve", *map(str, paths.values()), "--port", str(port),
               "--max-batch", str(args.max_batch), "--batch-timeout-ms", str(args.batch_timeout_ms),
               "--max-queue", "1024"]
    server = subprocess.Popen(command)
    import httpx

    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        time.sleep(0.2)
    server.terminate()
    raise SystemExit("the server did not become ready in 120 s")


# ------------------------------------------------------------------------------------------ load generator
def _image_request() -> bytes:
    import random

    data = [random.random() for _ in range(64)]
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": data}]}).encode()


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> bytes:
    """One HTTP/1.1 keep-alive exchange on an open connection: the response body (status 200 only)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
    body = await reader.readexactly(length)
    if status != 200:
        raise ValueError(f"status {status}: {body[:200]!r}")
    return body


async def _clients(host: str, port: int, path: str, clients: int, seconds: float) -> tuple[list[float], int]:
    """`clients` keep-alive connections posting one after another until `seconds` pass. The generator is a few
    lines of asyncio streams (as wrk is C), so that it takes little of the CPU the server needs."""
    latencies: list[float] = []
    errors = 0
    body = _image_request()
    request = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    end = time.perf_counter() + seconds

    async def one() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection(host, port)
        while time.perf_counter() < end:
            started = time.perf_counter()
            try:
                answer = await _post(reader, writer, request)
                ok = len(json.loads(answer)["outputs"][0]["data"]) == 10
            except (OSError, ValueError, KeyError, asyncio.IncompleteReadError):
                ok = False
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                errors += 1
        writer.close()
    await asyncio.gather(*(one() for _ in range(clients)))
    return latencies, errors


def _worker(url: str, clients: int, seconds: float, out: multiprocessing.Queue) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    out.put(asyncio.run(_clients(parts.hostname, parts.port, parts.path, clients, seconds)))


def load(url: str, clients: int, seconds: float, procs: int) -> dict[str, float]:
    """`clients` concurrent clients in `procs` processes for `seconds`: requests/s, p50/p99 (ms), errors."""
    procs = max(1, min(procs, clients))
    out: multiprocessing.Queue = multiprocessing.Queue()
    shares = [clients // procs + (i < clients % procs) for i in range(procs)]
    workers = [multiprocessing.Process(target=_worker, args=(url, n, seconds, out)) for n in shares]
    started = time.perf_counter()
    for w in workers:
        w.start()
    results = [out.get() for _ in workers]
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - started
    latencies = sorted(x for lat, _ in results for x in lat)
    errors = sum(e for _, e in results)
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [latencies[0]] * 99
    return {"requests": len(latencies), "errors": errors, "rps": len(latencies) / elapsed,
            "p50_ms": 1000 * q[49], "p99_ms": 1000 * q[98]}


def mean_batch(base: str, model: str) -> float | None:
    import httpx

    text = httpx.get(f"{base}/metrics").text
    total = re.search(rf'modelkit_batch_size_sum{{model="{model}"}} ([0-9.e+]+)', text)
    count = re.search(rf'modelkit_batch_size_count{{model="{model}"}} ([0-9.e+]+)', text)
    return float(total[1]) / float(count[1]) if total and count and float(count[1]) else None


def _lm_steps(base: str) -> tuple[float, float]:
    """tinylm's decode steps so far: (sequences summed over steps, steps)."""
    import httpx

    text = httpx.get(f"{base}/metrics").text
    found = [re.search(rf'modelkit_batch_size_{k}{{model="tinylm"}} ([0-9.e+]+)', text) for k in ("sum", "count")]
    return tuple(float(m[1]) if m else 0.0 for m in found)


# ------------------------------------------------------------------------------------------ language model
async def _completions(base: str, prompts: list[str], concurrent: bool) -> tuple[int, float]:
    import httpx

    async with httpx.AsyncClient(timeout=300) as client:
        async def one(prompt: str) -> int:
            r = await client.post(f"{base}/v1/completions", json={"model": "tinylm", "prompt": prompt, "max_tokens": 64,
                                                                   "temperature": 0})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]
        started = time.perf_counter()
        if concurrent:
            counts = await asyncio.gather(*(one(p) for p in prompts))
        else:
            counts = [await one(p) for p in prompts]
        return sum(counts), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--baseline-seconds", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--procs", type=int, default=2, help="load-generator processes")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--batch-timeout-ms", type=float, default=2.0)
    parser.add_argument("--lm-clients", type=int, default=16)
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    args = parser.parse_args()

    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_models(Path(tmp))
        server = start_server(paths, port, args)
        try:
            url = f"{base}/v2/models/cnn/infer"
            load(url, 4, 2.0, 1)                                     # warm-up
            sequential = load(url, 1, args.baseline_seconds, 1)
            before = mean_batch(base, "cnn")
            concurrent = load(url, args.clients, args.seconds, args.procs)
            batch = mean_batch(base, "cnn")
            ratio = concurrent["rps"] / sequential["rps"]
            print(f"CNN, 1 sequential client, {args.baseline_seconds:.0f} s: {sequential['rps']:.0f} req/s, "
                  f"p50 {sequential['p50_ms']:.2f} ms, p99 {sequential['p99_ms']:.2f} ms, errors {sequential['errors']}")
            print(f"CNN, {args.clients} concurrent clients, {args.seconds:.0f} s: {concurrent['rps']:.0f} req/s, "
                  f"p50 {concurrent['p50_ms']:.2f} ms, p99 {concurrent['p99_ms']:.2f} ms, "
                  f"errors {concurrent['errors']} of {concurrent['requests'] + concurrent['errors']}, "
                  f"mean batch {batch:.1f} rows (before: {before or 0:.1f})")
            verdict = "PASS" if ratio >= BAR_RATIO and concurrent["errors"] == 0 else "FAIL"
            print(f"CNN throughput ratio: {ratio:.2f}x (bar >= {BAR_RATIO}x, 0 errors): {verdict}")

            prompts = [("def ", "import os\n", "class ", "    return ")[i % 4] * (1 + i % 3) for i in range(args.lm_clients)]
            tokens_seq, seconds_seq = asyncio.run(_completions(base, prompts, concurrent=False))
            steps = _lm_steps(base)
            tokens_con, seconds_con = asyncio.run(_completions(base, prompts, concurrent=True))
            after = _lm_steps(base)
            decode_batch = (after[0] - steps[0]) / (after[1] - steps[1]) if after[1] > steps[1] else 0.0
            print(f"tinylm, {args.lm_clients} greedy completions of 64 tokens: one at a time {tokens_seq / seconds_seq:.0f} "
                  f"tokens/s, concurrent {tokens_con / seconds_con:.0f} tokens/s "
                  f"({(tokens_con / seconds_con) / (tokens_seq / seconds_seq):.2f}x), mean decode batch when concurrent "
                  f"{decode_batch:.1f}")
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"(cpus: {os.cpu_count()}; load generator and server share them)")


if __name__ == "__main__":
    main()
