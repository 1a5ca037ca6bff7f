"""What an importance matrix buys on tinylm: validation bits per byte of K-quants with and without one.

    .venv/bin/python bench/imatrix.py [--model runs/tinylm/model.safetensors] [--schemes q2_k,q3_k]
                                      [--calibration-bytes 262144] [--imatrix FILE]

Uses a trained tinylm (train one with `modelkit train tinylm` first). Computes its importance matrix
with `modelkit imatrix`'s code on the first --calibration-bytes of tinylm's *training* text (unless
--imatrix names one), then for each scheme quantizes the model twice (without and with the matrix, as
`modelkit quantize --scheme S [--imatrix FILE]` does) and measures bits per byte on the *validation*
split (tinylm's metric, lower is better), next to the float model's. Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from modelkit import schemes
from modelkit.models import load_model_module
from modelkit.pipeline import measure
from modelkit.pipeline.imatrix import compute_imatrix
from modelkit.pipeline.load import load_module
from modelkit.pipeline.quantize import quantize_module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/tinylm/model.safetensors")
    parser.add_argument("--schemes", default="q2_k,q3_k")
    parser.add_argument("--calibration-bytes", type=int, default=262144)
    parser.add_argument("--imatrix", help="an importance matrix to use instead of computing one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        imatrix = args.imatrix
        if imatrix is None:
            text = load_model_module("tinylm").TASK.text("train")[:args.calibration_bytes]
            calibration = Path(tmp) / "calibration.txt"
            calibration.write_text(text.decode("utf-8", errors="ignore"), encoding="utf-8")
            imatrix = str(Path(tmp) / "imatrix.gguf")
            started = time.perf_counter()
            report = compute_imatrix(args.model, calibration, imatrix)
            print(f"imatrix: {report.entries} weights, {report.chunks} chunks of {report.chunk_size} tokens of "
                  f"training text, {time.perf_counter() - started:.1f} s")
        model = load_module(args.model).eval()
        float_bpb = measure.evaluate(model, split="val", device="cpu")["bits_per_byte"]
        rows = {"float": float_bpb}
        for scheme in args.schemes.split(","):
            config = schemes.load_scheme(scheme)()
            for label, cfg in ((scheme, config), (f"{scheme}+imatrix", replace(config, imatrix=imatrix))):
                quantized = quantize_module(model, cfg)
                rows[label] = measure.evaluate(quantized, split="val", device="cpu")["bits_per_byte"]
    print(f"{'model':<16} {'val bits/byte':>14} {'vs float':>9}")
    for label, bpb in rows.items():
        print(f"{label:<16} {bpb:>14.4f} {100 * (bpb / float_bpb - 1):>+8.2f}%")
    print(json.dumps({"model": args.model, "val_bits_per_byte": rows}))


if __name__ == "__main__":
    main()
