"""A second judge of the TF.js Layers models modelkit writes: tensorflowjs's own Python loader
(`tensorflowjs.converters.load_keras_model`, what `tensorflowjs_converter --input_format tfjs_layers_model` runs)
rebuilds each as a tf-keras model, which then predicts on the inputs torch ran.

Two steps, in two environments (TensorFlow is no dependency of modelkit; fixtures/tfjs/make_converter_models.py
says how to make its environment):

    .venv/bin/python bench/tfjs_keras_judge.py write /tmp/judge          # modelkit writes the models, torch's outputs
    /work/tfjsconv/bin/python bench/tfjs_keras_judge.py judge /tmp/judge # tensorflowjs + tf-keras load and predict

Cases: the zoo's mlp and cnn (seed 0) in float32, the mlp in float16 (`--dtype f16`), the cnn as TF.js uint8 codes
(`modelkit quantize --scheme tfjs-uint8`), and a Sequential of a user's own (Conv2d, BatchNorm2d with set
statistics, ReLU, MaxPool2d, Flatten, Linear). The expected outputs are torch's on the model modelkit reads back
from the folder it wrote (for f16 and uint8: the weights as stored). Prints the largest difference per case.
"""
from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

CASES = ("mlp", "mlp_f16", "cnn", "cnn_uint8", "user_seq")
BAR = 1e-4


def write(folder: Path) -> None:
    import numpy as np
    import torch
    from torch import nn

    import modelkit
    from modelkit.checkpoint import instantiate
    from modelkit.models import build, load_model_module

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    user = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 5)).eval()
    user[1].running_mean.uniform_(-0.5, 0.5)
    user[1].running_var.uniform_(0.5, 1.5)
    for case in CASES:
        out = folder / case / "model.json"
        if case == "user_seq":
            x = torch.randn(3, 3, 8, 8)
            modelkit.export(user, out, example_inputs=(x,), force=True)
        else:
            name = case.split("_")[0]
            source = folder / f"{name}.safetensors"
            modelkit.export(build(name, seed=0).eval(), source, force=True)
            x = load_model_module(name).example_inputs(3)
            if case == "cnn_uint8":
                from modelkit.pipeline.quantize import quantize

                quantize(source, out, scheme="tfjs-uint8", force=True)
            else:
                modelkit.convert(source, out, dtype="f16" if case.endswith("f16") else None, force=True)
        model = user if case == "user_seq" else instantiate(modelkit.load(out), dequantize=True).float().eval()
        with torch.no_grad():
            y = model(x)
        keras_x = x.permute(0, 2, 3, 1) if x.ndim == 4 else x          # channels_last, as Keras takes images
        np.save(folder / case / "x.npy", keras_x.numpy())
        np.save(folder / case / "y.npy", y.numpy())
    print(f"wrote {', '.join(CASES)} under {folder}")


def judge(folder: Path) -> None:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.modules.setdefault("tensorflow_decision_forests", types.ModuleType("tensorflow_decision_forests"))
    from importlib.metadata import version

    import numpy as np
    import tensorflowjs

    results = {"judge": f"tensorflowjs {version('tensorflowjs')} load_keras_model, tf-keras {version('tf-keras')}",
               "cases": {}}
    for case in CASES:
        model = tensorflowjs.converters.load_keras_model(str(folder / case / "model.json"))
        got = model.predict(np.load(folder / case / "x.npy"), verbose=0)
        worst = float(np.abs(got - np.load(folder / case / "y.npy")).max())
        results["cases"][case] = {"layers": [type(layer).__name__ for layer in model.layers], "max_abs_diff": worst}
        print(f"{case:10s} {worst:.3g} {'ok' if worst < BAR else 'MISSED'}  {results['cases'][case]['layers']}")
    print(json.dumps(results))


if __name__ == "__main__":
    step, where = sys.argv[1], Path(sys.argv[2])
    {"write": write, "judge": judge}[step](where)
