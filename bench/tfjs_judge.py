"""The TensorFlow.js judge: TF.js 4.22 itself loads the Layers models modelkit writes and runs them.

For each case (the zoo's mlp and cnn built with seed 0; float32, float16, TF.js's uint8/uint16 quantized
weights (modelkit quantize --scheme tfjs-uint8), and a cnn cut into 100 KB shards so that weights straddle
shards; a user's own Sequential of conv, batch norm, pooling, GELU, softmax), this writes the TF.js model with `modelkit.convert`, runs
bench/tfjs_judge.mjs in node (`tf.loadLayersModel` with an fs IO handler, the pure JavaScript CPU backend)
on seeded inputs, compares TF.js's outputs with torch's (the f16 case: torch with the same float16-rounded
weights; the quantized cases: torch with the weights modelkit reads back, and the float model for the
quantization error) and records the verdicts in fixtures/tfjs/judge.json: the inputs, TF.js's outputs, the sha256 of
the files modelkit wrote, the TF.js version and the measured max abs difference. It also has TF.js write a
model of its own (fixtures/tfjs/tfjs_written/, with TF.js's predictions) for the reader to be judged on. tests/test_tfjs.py checks
that record without node: the same files come out, and torch is within the pinned tolerance of TF.js.

    npm install --prefix /work/tfjs-judge @tensorflow/tfjs@4.22.0      # once, outside the repository
    TFJS_MODULES=/work/tfjs-judge/node_modules .venv/bin/python bench/tfjs_judge.py
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import modelkit
from modelkit.models import build

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "fixtures" / "tfjs" / "judge.json"
TOLERANCE = 1e-4          # the bar for TF.js against torch
# (name, model, dtype, shard size)
# (dtype uint8 / uint16: `modelkit quantize --scheme tfjs-uint8 / tfjs-uint16`, TF.js's quantized weights)
CASES = (("mlp", "mlp", None, None), ("mlp-f16", "mlp", "f16", None), ("cnn", "cnn", None, None),
         ("cnn-f16", "cnn", "f16", None), ("cnn-shards", "cnn", None, 100_000), ("user", "user", None, None),
         ("mlp-uint8", "mlp", "uint8", None), ("cnn-uint8", "cnn", "uint8", None), ("cnn-uint16", "cnn", "uint16", None))


def user_sequential() -> torch.nn.Sequential:
    """A user's own Sequential (mapped by modelkit.models.keras_map): conv, batch norm with real statistics,
    pooling, flatten, GELU, dropout, softmax."""
    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Linear(64, 8), nn.GELU(), nn.Dropout(0.1), nn.Linear(8, 3), nn.Softmax(dim=-1))
    with torch.no_grad():
        norm = net[1]
        norm.running_mean.uniform_(-1, 1), norm.running_var.uniform_(0.5, 2)
        norm.weight.uniform_(0.5, 1.5), norm.bias.uniform_(-0.5, 0.5)
    return net.eval()


def _model(model: str) -> torch.nn.Module:
    return user_sequential() if model == "user" else build(model, seed=0).eval()


def inputs(model: str) -> np.ndarray:
    """Seeded inputs as Keras takes them (channels_last)."""
    rng = np.random.default_rng(0)
    shape = {"cnn": (4, 8, 8, 1), "user": (4, 8, 8, 3), "mlp": (4, 2)}[model]
    return (rng.standard_normal(shape) if model == "mlp" else rng.random(shape)).astype(np.float32)


def write_case(folder: Path, name: str) -> Path:
    """The TF.js model of case `name` in `folder`/`name`/model.json, as the test regenerates it."""
    _, model, dtype, shard = next(c for c in CASES if c[0] == name)
    target = folder / name / "model.json"
    if model == "user":
        modelkit.export(user_sequential(), target, example_inputs=torch.zeros(1, 3, 8, 8))
        return target
    src = folder / f"{model}.safetensors"
    if not src.exists():
        modelkit.export(build(model, seed=0), src)
    if dtype in ("uint8", "uint16"):
        modelkit.quantize(src, target, scheme=f"tfjs-{dtype}")
    else:
        modelkit.convert(src, target, dtype=dtype, shard_size=shard)
    return target


def digests(target: Path) -> dict[str, str]:
    """sha256 of the shards and of model.json without the version fields (which change with modelkit's version)."""
    doc = json.loads(target.read_text())
    doc.pop("generatedBy"), doc.pop("convertedBy")
    out = {"model.json (without generatedBy, convertedBy)":
           hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()}
    for p in sorted(target.parent.glob("*.bin")):
        out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def torch_outputs(model: str, dtype: str | None, x: np.ndarray, target: Path | None = None) -> np.ndarray:
    """torch's outputs on the same weights as the file (float16-rounded for f16; for uint8/uint16 the weights
    modelkit reads back from `target`, decoded as TF.js decodes them; None: the float model), in float32."""
    from modelkit.checkpoint import instantiate

    net = _model(model)
    if dtype == "f16":
        net = net.half().float()
    if dtype in ("uint8", "uint16") and target is not None:
        net = instantiate(modelkit.load(target))
    t = torch.from_numpy(x)
    if model != "mlp":
        t = t.permute(0, 3, 1, 2)                 # Keras's (B, H, W, C) -> torch's (B, C, H, W)
    with torch.no_grad():
        return net(t).numpy()


def record_tfjs_written(modules: str) -> None:
    """TF.js writes models of its own (bench/tfjs_save.mjs, tfjs-node's file:// layout: model.json +
    weights.bin) into fixtures/tfjs/tfjs_written/ (Dense 4->8 relu, 8->3 tanh) and fixtures/tfjs/tfjs_mlp/
    (the zoo mlp's Keras layout), each with its predictions on seeded inputs: what the reader is judged
    against (tests/test_tfjs.py computes the first from the weights modelkit reads, and runs the second,
    converted to ONNX with --arch mlp, in onnxruntime)."""
    for name, shape, features in (("tfjs_written", "small", 4), ("tfjs_mlp", "mlp", 2)):
        folder = FIXTURE.parent / name
        x = np.random.default_rng(0).standard_normal((5, features)).astype(np.float32)
        with tempfile.TemporaryDirectory() as tmp:
            given = Path(tmp) / "inputs.json"
            given.write_text(json.dumps({"shape": list(x.shape), "data": x.reshape(-1).tolist()}))
            run = subprocess.run(["node", str(ROOT / "bench" / "tfjs_save.mjs"), str(folder), str(given), shape],
                                 capture_output=True, text=True, check=True, env={**os.environ, "TFJS_MODULES": modules})
        result = json.loads(run.stdout.strip().splitlines()[-1])
        (folder / "predictions.json").write_text(json.dumps({
            "tfjs_version": result["version"], "inputs": {"shape": list(x.shape), "data": x.reshape(-1).tolist()},
            "outputs": {"shape": result["shape"], "data": result["outputs"]}}, indent=1) + "\n")
        print(f"TF.js {result['version']} wrote {folder.relative_to(ROOT)} ({shape})")


def main() -> int:
    modules = os.environ.get("TFJS_MODULES", "/work/tfjs-judge/node_modules")
    record_tfjs_written(modules)
    cases, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, model, dtype, _ in CASES:
            target = write_case(folder, name)
            x = inputs(model)
            given = folder / f"{name}.inputs.json"
            given.write_text(json.dumps({"shape": list(x.shape), "data": x.reshape(-1).tolist()}))
            run = subprocess.run(["node", str(ROOT / "bench" / "tfjs_judge.mjs"), str(target), str(given)],
                                 capture_output=True, text=True, env={**os.environ, "TFJS_MODULES": modules})
            if run.returncode != 0:
                print(f"{name}: TF.js refused the model:\n{run.stderr[-2000:]}", file=sys.stderr)
                return 1
            result = json.loads(run.stdout.strip().splitlines()[-1])
            got = np.asarray(result["outputs"], dtype=np.float32).reshape(result["shape"])
            diff = float(np.abs(got - torch_outputs(model, dtype, x, target)).max())
            worst = max(worst, diff)
            print(f"{name}: TF.js {result['version']} loaded {result['layers']}; max abs diff vs torch {diff:.2e}")
            case = {"name": name, "inputs": {"shape": list(x.shape), "data": x.reshape(-1).tolist()},
                    "tfjs_outputs": {"shape": result["shape"], "data": result["outputs"]},
                    "max_abs_diff": diff, "files": digests(target), "layers": result["layers"]}
            if dtype in ("uint8", "uint16"):       # the quantization error: TF.js against the float model
                case["max_abs_diff_vs_float"] = float(np.abs(got - torch_outputs(model, None, x)).max())
                print(f"{name}: max abs diff vs the float model {case['max_abs_diff_vs_float']:.2e}")
            cases.append(case)
            version = result["version"]
    record = {"judge": "TensorFlow.js (@tensorflow/tfjs, pure JavaScript CPU backend, tf.loadLayersModel)",
              "tfjs_version": version, "tolerance": TOLERANCE, "max_abs_diff": worst, "cases": cases}
    FIXTURE.write_text(json.dumps(record, indent=1) + "\n")
    print(f"worst max abs diff {worst:.2e} (tolerance {TOLERANCE}); written {FIXTURE.relative_to(ROOT)}")
    return 0 if worst < TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
