"""`modelkit demo` (what `make demo` runs): train the zoo, evaluate it, check each bar, convert each
model to every format, quantize cnn and tinylm with a comparison table, and run one compression
chain (prune, fine-tune, int8, ONNX) on cnn with the metric after each step."""
from __future__ import annotations

import time
from pathlib import Path

import click

from modelkit.cli.app import EXIT_ERROR
from modelkit.cli.options import output_options
from modelkit.cli.output import Progress, emit_json, format_metrics, human_bytes, note, table
from modelkit.cli.quantize import render

# What `make demo` trains, in this order; each model declares its own quality bar (QUALITY).
ZOO = ("mlp", "cnn", "tinylm")

# The comparison tables `make demo` prints (modelkit quantize --eval); QAT is left to bench/quantize.py.
QUANT_SCHEMES = {
    "cnn": ("int8", "int8-dynamic", "int4", "gptq", "q8_0", "q4_0", "fp16"),
    "tinylm": ("q8_0", "q4_0", "int4", "gptq"),
}


def _conversions(results: dict, out: Path) -> list[dict]:
    """Convert each trained model to every other format; each result is verified by convert()."""
    from modelkit.errors import ModelkitError
    from modelkit.formats import FORMATS
    from modelkit.pipeline.convert import convert

    rows = []
    for name, result in results.items():
        for fmt, info in FORMATS.items():
            if info.folder:                     # Hugging Face folders hold Hugging Face families, not the zoo
                continue
            target = out / name / "formats" / f"model{info.suffixes[0]}"
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                report = convert(result["path"], target, to=fmt, force=True)
            except ModelkitError as e:          # shown in the matrix, and fails the demo
                rows.append({"model": name, "format": fmt, "ok": False, "error": str(e)})
                continue
            rows.append({"model": name, "format": fmt, "ok": True, "bytes": report.target["bytes"],
                         "seconds": round(report.seconds, 2), "verify": report.verify})
    return rows


def _quantization(results: dict, out: Path) -> dict[str, list]:
    """modelkit quantize --eval on cnn and tinylm, every scheme of QUANT_SCHEMES; one report each."""
    from modelkit.pipeline.quantize import compare

    return {name: compare(results[name]["path"], out / name / "quantized", scheme_names=schemes, evaluate=True,
                          force=True)
            for name, schemes in QUANT_SCHEMES.items()}


def _chain(results: dict, out: Path, seed: int) -> list[dict]:
    """cnn: structured prune 50% + 10 epochs fine-tune -> int8 -> ONNX, the metric after each step."""
    from modelkit.api import evaluate, inspect
    from modelkit.pipeline.compress import prune_file
    from modelkit.pipeline.convert import convert
    from modelkit.pipeline.quantize import quantize
    from modelkit.quantizers.prune import PruneConfig

    folder = out / "cnn" / "chain"
    folder.mkdir(parents=True, exist_ok=True)
    trained, pruned = Path(results["cnn"]["path"]), folder / "pruned.safetensors"
    int8, onnx = folder / "pruned-int8.safetensors", folder / "pruned-int8.onnx"

    def row(step: str, path: Path, accuracy: float, command: str) -> dict:
        return {"step": step, "path": str(path), "parameters": inspect(path).num_parameters,
                "bytes": path.stat().st_size, "accuracy": accuracy, "command": command}

    steps = [row("trained", trained, results["cnn"]["value"], "modelkit train cnn")]
    report = prune_file(trained, pruned, PruneConfig(method="structured", sparsity=0.5), finetune_epochs=10,
                        seed=seed, force=True)
    steps.append(row("structured prune 50% + 10 epochs fine-tune", pruned, report.values["finetuned"],
                     "modelkit prune --method structured --sparsity 0.5 --finetune-epochs 10"))
    quantized = quantize(pruned, int8, scheme="int8", evaluate=True, force=True)
    steps.append(row("int8 (per-channel, symmetric)", int8, quantized.metric["quantized"],
                     "modelkit quantize --scheme int8"))
    convert(int8, onnx, force=True)                       # verified: onnxruntime against torch
    steps.append(row("ONNX (QDQ), run in onnxruntime", onnx, evaluate(onnx, runtime="onnxruntime")["accuracy"],
                     "modelkit convert pruned-int8.safetensors pruned-int8.onnx"))
    return steps


def _verify_cell(row: dict) -> str:
    if not row["ok"]:
        return f"FAILED: {row['error']}"
    verify = row["verify"]
    if verify["method"] == "bit-exact":
        return f"bit-exact ({verify['tensors_checked']} tensors)"
    return f"outputs max err {verify['max_abs_err']:.1e} <= {verify['atol']:.0e}; weights bit-exact"


@click.command()
@click.option("--out", default="runs", show_default=True, type=click.Path(file_okay=False), help="Folder for the trained models.")
@click.option("--seed", type=int, default=0, show_default=True)
@output_options
def demo(out: str, seed: int, as_json: bool) -> None:
    """Train mlp, cnn and tinylm, check their bars, convert each to every format, quantize cnn and
    tinylm with every main scheme, run a prune -> int8 -> ONNX chain on cnn, print summaries.

    Exits 2 if a model misses its bar or a conversion fails. About four minutes on two CPU cores.

    \b
    Example:
      modelkit demo --out runs
    """
    from modelkit.api import generate, inspect
    from modelkit.models import load_model_module
    from modelkit.pipeline.train import TrainConfig, train

    results = {}
    for name in ZOO:
        note(f"== training {name}")
        started = time.perf_counter()
        with Progress(f"train {name}", enabled=not as_json) as progress:
            result = train(name, Path(out) / name, config=TrainConfig(seed=seed), force=True, progress=progress)
        info = inspect(result.path)
        quality = load_model_module(name).QUALITY     # the bar each model declares
        split, metric, bar, direction = quality.split, quality.metric, quality.bar, quality.direction
        value = result.metrics[split][metric]
        results[name] = {"path": str(result.path), "parameters": info.num_parameters, "file_bytes": info.file_bytes,
                         "seconds": round(time.perf_counter() - started, 1), "split": split, "metric": metric,
                         "value": value, "bar": bar, "direction": direction, "passed": quality.met(value),
                         "metrics": result.metrics}
        note(f"   {name} {split}: {format_metrics(result.metrics[split])}")
    note("== converting each model to every format")
    conversions = _conversions(results, Path(out))
    note("== quantizing cnn and tinylm (modelkit quantize --eval)")
    quantized = _quantization(results, Path(out))
    note("== compression chain on cnn: prune, fine-tune, int8, ONNX")
    chain = _chain(results, Path(out), seed)
    sample = generate(results["tinylm"]["path"], "def ", max_new_bytes=200, temperature=0.7, top_k=20,
                      seed=seed).decode("utf-8", errors="replace")
    ok = all(r["passed"] for r in results.values()) and all(row["ok"] for row in conversions)
    if as_json:
        emit_json({"schema": "modelkit.demo/1", "ok": ok, "models": results, "conversions": conversions,
                   "quantization": {name: [r.to_dict() for r in reports] for name, reports in quantized.items()},
                   "chain": chain, "sample": "def " + sample})
    else:
        rows = [(name, f"{r['parameters']:,}", human_bytes(r["file_bytes"]), f"{r['seconds']:.0f}s",
                 f"{r['split']} {r['metric']} {r['value']:.4f}",
                 f"{'>=' if r['direction'] == 'higher' else '<='} {r['bar']}", "ok" if r["passed"] else "MISSED")
                for name, r in results.items()]
        click.echo(table(["model", "params", "file", "time", "result", "bar", ""], rows, align="lrrrlll"))
        lm = results["tinylm"]["metrics"]["val"]
        click.echo(f"\ntinylm: {lm['bits_per_byte']:.3f} bits/byte vs {lm['unigram_bits_per_byte']:.3f} for the "
                   f"unigram baseline on the same validation text; perplexity {lm['perplexity']:.2f}")
        click.echo("\nconversions (modelkit convert, verified):")
        click.echo(table(["model", "format", "size", "time", "verification"],
                         [(r["model"], r["format"], human_bytes(r["bytes"]) if r["ok"] else "-",
                           f"{r['seconds']:.1f}s" if r["ok"] else "-", _verify_cell(r)) for r in conversions],
                         align="llrrl"))
        for name, reports in quantized.items():
            click.echo(f"\nmodelkit quantize {results[name]['path']} --eval (CPU latency in ms, float -> quantized):")
            click.echo(render(reports))
        click.echo("\ncompression chain on cnn (each step's output is a normal checkpoint):")
        click.echo(table(["step", "params", "file", "test accuracy", "command"],
                         [(c["step"], f"{c['parameters']:,}", human_bytes(c["bytes"]), f"{100 * c['accuracy']:.2f}%",
                           c["command"]) for c in chain], align="lrrrl"))
        click.echo(f"\nmodelkit generate {results['tinylm']['path']} --prompt 'def ' --temperature 0.7 --top-k 20\n"
                   + "def " + sample)
    if not ok:
        click.get_current_context().exit(EXIT_ERROR)
