"""Build docs/serving/Dockerfile and run the image as its users do (not part of `make test`: it needs a docker daemon).

    .venv/bin/python bench/serve_image.py [--image modelkit-serve:check] [--no-build] [--port 18080] [--keep]
                                          [-- DOCKER BUILD ARGS...]

From the repository root, with docker able to build and run (the image's base and torch's index reachable, or
their build args given after `--`, e.g. `-- --network host --build-arg BASE=... --build-arg TORCH_INDEX=...`;
docs/serving.md, "The image"). This venv judges the container from outside: modelkit (the reference outputs),
tritonclient, openai and httpx. Tiny seeded models are written to a temporary folder and mounted read-only:

1. the build (time, image size) and the compiled kernels inside it (fast_linear.ISA);
2. a pickle that runs a shell command, as KServe mounts it: the container refuses it and exits non-zero;
   `docker stop` while a model still loads ends the container at once (143);
3. the cnn with the image's default command (KServe's --model_dir /mnt/models, under `docker run --init`):
   tritonclient infer, binary and JSON, equal to `load_module`; `docker stop` exits 0;
4. the cnn with KServe's arguments (--model_name, --model_dir, --http_port; the process is PID 1): infer,
   a bad request is a 4xx and the server stays live, /metrics counts it; `docker stop` exits 0;
5. tinylm and a Hugging Face llama folder named on the command line: openai completions (streaming and not)
   equal to greedy `modelkit generate`, a chat reply with usage; `docker stop` during a 120-token stream lets it
   finish ([DONE], the same text), and the container exits 0 with the request's log line.

Each check prints a line; the script exits 1 if any failed. Times are wall-clock on this machine (the build's
downloads included).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch

import modelkit
from modelkit.models import build

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "fixtures" / "llama_cpp" / "hf" / "llama3"
FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}{f'  ({detail})' if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def make_models(root: Path) -> dict[str, Path]:
    """The cnn and tinylm as zoo files, each alone in a folder (as KServe's storage initializer fills one), and
    a Llama folder with a real tokenizer; readable by the image's user (uid 1000)."""
    import transformers

    paths = {"cnn": root / "cnn" / "model.safetensors", "tinylm": root / "tinylm" / "model.safetensors",
             "llama": root / "llama", "evil": root / "evil" / "model.pt"}
    for name in ("cnn", "tinylm", "evil"):
        paths[name].parent.mkdir()
    modelkit.export(build("cnn", {"channels": [4, 8], "hidden": 16}, seed=0).eval(), paths["cnn"])
    modelkit.export(build("tinylm", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                     "num_attention_heads": 4, "num_key_value_heads": 2,
                                     "max_position_embeddings": 64}, seed=0).eval(), paths["tinylm"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    config = transformers.LlamaConfig(vocab_size=640, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(paths["llama"])
    for f in TOKENIZER.iterdir():
        shutil.copy(f, paths["llama"] / f.name)
    from modelkit.testing.payloads import system_pickle, torch_zip

    paths["evil"].write_bytes(torch_zip(system_pickle("echo pwned > /tmp/pwned")))
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return paths


class Container:
    """`docker run -d` of the image; stopped and removed on exit."""

    def __init__(self, image: str, port: int, mount: Path, args: list[str], init: bool = False):
        self.name = f"modelkit-check-{port}-{time.monotonic_ns()}"
        run = docker("run", "-d", "--name", self.name, *(["--init"] if init else []), "-p", f"127.0.0.1:{port}:8080",
                     "-v", f"{mount}:/mnt/models:ro", image, *args)
        if run.returncode:
            raise SystemExit(f"docker run failed: {run.stderr.strip()}")
        self.base = f"http://127.0.0.1:{port}"
        start = time.perf_counter()
        while True:
            try:
                if httpx.get(f"{self.base}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if docker("inspect", self.name, "--format", "{{.State.Running}}").stdout.strip() != "true" \
                    or time.perf_counter() - start > 180:
                raise SystemExit(f"{self.name} did not become ready:\n{self.logs()}")
            time.sleep(0.2)
        self.ready_s = time.perf_counter() - start

    def logs(self) -> str:
        out = docker("logs", self.name)
        return out.stdout + out.stderr

    def stop(self) -> tuple[int, float]:
        """docker stop: (exit code, seconds it took)."""
        start = time.perf_counter()
        docker("stop", self.name)
        took = time.perf_counter() - start
        return int(docker("inspect", self.name, "--format", "{{.State.ExitCode}}").stdout), took

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc) -> None:
        docker("rm", "-f", self.name)


def check_v2(c: Container, name: str, cnn: Path, label: str) -> None:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(c.base.removeprefix("http://"))
    meta = client.get_model_metadata(name)
    check(f"{label}: ready in {c.ready_s:.1f} s, metadata of {name!r}",
          client.is_model_ready(name) and meta["inputs"][0]["shape"] == [-1, 1, 8, 8], json.dumps(meta["inputs"]))
    x = np.random.default_rng(0).random((5, 1, 8, 8), dtype=np.float32)
    with torch.no_grad():
        expected = modelkit.load_module(cnn)(torch.from_numpy(x)).numpy()
    for binary in (True, False):
        given = triton.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x, binary_data=binary)
        out = client.infer(name, [given], outputs=[triton.InferRequestedOutput("logits", binary_data=binary)])
        got = out.as_numpy("logits")
        diff = float(np.abs(got - expected).max())
        check(f"{label}: tritonclient infer ({'binary' if binary else 'JSON'}) equals load_module", diff <= 1e-6,
              f"max |diff| {diff:.1e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="modelkit-serve:check")
    parser.add_argument("--no-build", action="store_true", help="check an image built before")
    parser.add_argument("--port", type=int, default=18080, help="host port the containers publish 8080 on")
    parser.add_argument("--keep", action="store_true", help="keep the image afterwards")
    parser.add_argument("build_args", nargs="*", help="after --: more `docker build` arguments")
    args = parser.parse_args()

    if not args.no_build:
        start = time.perf_counter()
        built = subprocess.run(["docker", "build", "-f", "docs/serving/Dockerfile", "-t", args.image, *args.build_args,
                                "."], cwd=ROOT, capture_output=True, text=True)
        took = time.perf_counter() - start
        check(f"docker build in {took:.0f} s", built.returncode == 0, built.stderr.strip()[-2000:])
        if built.returncode:
            return 1
    size = int(docker("image", "inspect", args.image, "--format", "{{.Size}}").stdout)
    print(f"image {args.image}: {size / 1e9:.2f} GB", flush=True)
    isa = docker("run", "--rm", "--network", "none", "--entrypoint", "python", args.image, "-c",
                 "import modelkit, modelkit.quantizers.fast_linear as f, torch; "
                 "print(modelkit.__version__, torch.__version__, f.ISA)")
    check("the image imports modelkit with its compiled kernels", isa.returncode == 0 and not
          isa.stdout.strip().endswith("None"), (isa.stdout + isa.stderr).strip()[-300:])

    try:
        with tempfile.TemporaryDirectory(prefix="modelkit-image-") as tmp:
            run_checks(args, make_models(Path(tmp)))
    finally:
        if not args.keep:
            docker("rmi", args.image)
    print(f"{len(FAILED)} failed" + (f": {', '.join(FAILED)}" if FAILED else ""))
    return 1 if FAILED else 0


def run_checks(args: argparse.Namespace, paths: dict[str, Path]) -> None:
    from openai import OpenAI

    from modelkit.pipeline.generate import generate_bytes, generate_tokens
    from modelkit.pipeline.load import load_language_model

    evil = docker("run", "--rm", "-v", f"{paths['evil'].parent}:/mnt/models:ro", args.image)
    check("a pickle running a command is refused before it loads", evil.returncode != 0 and "refused" in evil.stderr,
          f"exit {evil.returncode}: {evil.stderr.strip().splitlines()[-1] if evil.stderr.strip() else ''}")

    name = f"modelkit-check-load-{args.port}"
    docker("run", "-d", "--name", name, "-v", f"{paths['cnn'].parents[1]}:/mnt/models:ro", args.image, "/mnt/models/llama")
    time.sleep(1)                                        # importing torch: the model is not loaded yet
    start = time.perf_counter()
    docker("stop", "-t", "20", name)
    took = time.perf_counter() - start
    code = docker("inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip()
    docker("rm", "-f", name)
    check(f"docker stop while the model loads ends it in {took:.1f} s (exit 143, not killed at the timeout)",
          code == "143" and took < 10, f"exit {code}")

    with Container(args.image, args.port, paths["cnn"].parent, [], init=True) as c:
        check_v2(c, "model", paths["cnn"], "default command, --init")
        code, took = c.stop()
        check(f"default command, --init: docker stop exits 0 in {took:.1f} s", code == 0, f"exit {code}")

    kserve = ["--model_name", "digits", "--model_dir", "/mnt/models", "--http_port", "8080"]
    with Container(args.image, args.port, paths["cnn"].parent, kserve) as c:
        check_v2(c, "digits", paths["cnn"], "KServe args")
        bad = httpx.post(f"{c.base}/v2/models/digits/infer", content=b"{not json")
        live = httpx.get(f"{c.base}/v2/health/live")
        check("KServe args: bad JSON is a 4xx with a reason, the server stays live",
              400 <= bad.status_code < 500 and "error" in bad.json() and live.json() == {"live": True},
              f"{bad.status_code} {bad.text}")
        metrics = httpx.get(f"{c.base}/metrics").text
        counted = [line for line in metrics.splitlines()
                   if line.startswith("modelkit_requests_total{") and 'model="digits"' in line]
        check("KServe args: /metrics counts the requests", bool(counted), "; ".join(counted[:3]))
        code, took = c.stop()
        check(f"KServe args (PID 1): docker stop exits 0 in {took:.1f} s", code == 0, f"exit {code}")

    lms = {name: load_language_model(paths[name]) for name in ("tinylm", "llama")}

    def greedy(name: str, prompt: str, tokens: int) -> str:
        lm = lms[name]
        if lm.tokenizer is None:
            return generate_bytes(lm.model, prompt, max_new_tokens=tokens).text
        return generate_tokens(lm.model, lm.tokenizer, prompt, max_new_tokens=tokens, assets=dict(lm.assets)).text

    served = ["tinylm=/mnt/models/tinylm/model.safetensors", "llama=/mnt/models/llama", "--http_port", "8080"]
    with Container(args.image, args.port, paths["cnn"].parents[1], served) as c:
        client = OpenAI(base_url=f"{c.base}/v1", api_key="unused")
        listed = sorted(m.id for m in client.models.list())
        check(f"language models: ready in {c.ready_s:.1f} s, /v1/models lists them", listed == ["llama", "tinylm"],
              str(listed))
        for name, prompt in (("tinylm", "def "), ("llama", "The quick brown fox")):
            expected = greedy(name, prompt, 25)
            text = client.completions.create(model=name, prompt=prompt, max_tokens=25, temperature=0).choices[0].text
            stream = client.completions.create(model=name, prompt=prompt, max_tokens=25, temperature=0, stream=True)
            streamed = "".join(chunk.choices[0].text for chunk in stream)
            check(f"{name}: openai completion, streaming and not, equals greedy generate",
                  text == expected == streamed, f"{text!r} / {streamed!r} / {expected!r}")
        chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, temperature=0)
        check("llama: chat completion with usage", chat.usage.completion_tokens > 0
              and chat.choices[0].message.role == "assistant", f"usage {chat.usage}")

        expected = greedy("tinylm", "x", 120)
        text, done, stopped = "", False, {}
        stopper = threading.Thread(target=lambda: stopped.update(zip(("code", "took"), c.stop(), strict=True)))
        with httpx.stream("POST", f"{c.base}/v1/completions", timeout=120, json={
                "model": "tinylm", "prompt": "x", "max_tokens": 120, "temperature": 0, "stream": True}) as r:
            request_id = r.headers["x-request-id"]
            for i, line in enumerate(r.iter_lines()):
                if i == 0:
                    stopper.start()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
        stopper.join()
        check("docker stop during a 120-token stream: the stream finishes with [DONE] and the same text",
              done and text == expected, f"{len(text)} of {len(expected)} characters")
        logged = f"request {request_id} POST /v1/completions -> 200" in c.logs()
        check(f"... and the container exits 0 in {stopped.get('took', 0):.1f} s, having logged the request",
              stopped.get("code") == 0 and logged, f"exit {stopped.get('code')}, logged {logged}")


if __name__ == "__main__":
    sys.exit(main())
