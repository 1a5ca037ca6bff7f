"""The judges of the .keras and OpenVINO IR writers, and what writing costs against ONNX in the same process.

    .venv/bin/python bench/openvino_keras.py            # needs the openvino extra, and keras for the Keras judge

For mlp, cnn and tinylm (small configs, seeded): each file is written through modelkit (verified), then
OpenVINO's own runtime (Core.read_model + compile_model, CPU, f32) and Keras (keras.saving.load_model,
safe_mode=True, torch backend, in a subprocess) run it against torch on inputs of another batch size. The
write times are printed beside an ONNX export of the same module, measured in the same process (best of 3),
so the ratio holds on a loaded machine. tinylm has no Keras equivalent: its row says why.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import modelkit
from modelkit.errors import UnsupportedConversionError
from modelkit.models import build, load_model_module

CASES = [("mlp", {}), ("cnn", {"channels": [4, 8], "hidden": 16}),
         ("tinylm", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "max_position_embeddings": 64})]
_KERAS = """
import json, sys, numpy as np, keras
net = keras.saving.load_model(sys.argv[1], safe_mode=True)
x = np.load(sys.argv[2])
x = x.transpose(0, 2, 3, 1) if x.ndim == 4 else x
np.save(sys.argv[3], keras.ops.convert_to_numpy(net(x, training=False)))
"""


def _best(module: torch.nn.Module, path: Path, repeat: int = 3) -> float:
    """The fastest of `repeat` verified writes of `module` to `path`, in seconds."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        modelkit.export(module, path, force=True)
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    from modelkit.converters import openvino as ov_converter

    ov = ov_converter.openvino()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        for name, config in CASES:
            module = build(name, config, seed=0).eval()
            x = load_model_module(name).example_inputs(5, seed=1)
            with torch.no_grad():
                want = module(x)
                want = (want if isinstance(want, torch.Tensor) else want[0]).numpy()
            row = {"model": name}
            onnx_s = _best(module, folder / f"{name}.onnx")
            ir_s = _best(module, folder / f"{name}.xml")
            core = ov.Core()
            compiled = core.compile_model(core.read_model(folder / f"{name}.xml"), "CPU", ov_converter.COMPILE_CONFIG)
            got = compiled([x.numpy()])[compiled.output(0)]
            row.update(openvino_max_abs=float(np.abs(got - want).max()), ir_write_s=round(ir_s, 3),
                       onnx_write_s=round(onnx_s, 3), ir_over_onnx=round(ir_s / onnx_s, 2))
            try:
                keras_s = _best(module, folder / f"{name}.keras")
            except UnsupportedConversionError as e:
                row["keras"] = str(e)
            else:
                np.save(folder / "x.npy", x.numpy())
                env = {**os.environ, "KERAS_BACKEND": "torch", "KERAS_HOME": str(folder / "keras-home")}
                subprocess.run([sys.executable, "-c", _KERAS, str(folder / f"{name}.keras"), str(folder / "x.npy"),
                                str(folder / "y.npy")], check=True, env=env)
                row.update(keras_max_abs=float(np.abs(np.load(folder / "y.npy") - want).max()),
                           keras_write_s=round(keras_s, 3), keras_over_onnx=round(keras_s / onnx_s, 2))
            rows.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
