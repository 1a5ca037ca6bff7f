"""`modelkit quantize`: make a model smaller with one or several schemes and print what it cost."""
from __future__ import annotations

import click

from modelkit.cli.options import force_option, output_options, read_options
from modelkit.cli.output import Progress, emit_json, human_bytes, note, table
from modelkit.formats import FORMATS
from modelkit.quantizers.gguf_recipes import RECIPES, describe

SCHEMA = "modelkit.quantize/1"


def _schemes(values: tuple[str, ...]) -> list[str]:
    """--scheme int8 --scheme int4, or --scheme int8,int4: in order, without repeats."""
    names: list[str] = []
    for value in values:
        for name in value.split(","):
            if name.strip() and name.strip() not in names:
                names.append(name.strip())
    return names


def _metric_cells(report) -> list[str]:
    metric = report.metric
    if metric is None:
        return ["-", "-", "-"]
    if metric["name"] == "accuracy":     # points, as the bars are written
        return [f"{100 * metric['float']:.2f}%", f"{100 * metric['quantized']:.2f}%", f"{100 * metric['delta']:+.2f} pt"]
    return [f"{metric['float']:.4f}", f"{metric['quantized']:.4f}", f"{100 * metric['relative']:+.2f}%"]


def _latency_cells(report) -> list[str]:
    if report.latency_ms is None:
        return ["-", "-"]
    f, q = report.latency_ms["float"], report.latency_ms["quantized"]
    return [f"{f[k]:.2f} -> {q[k]:.2f}" for k in ("batch_1", "batch_64")]


def _verified(verify: dict | None) -> str:
    if verify is None:
        return "not verified (--no-verify)"
    if verify.get("method") == "both sessions":
        return (f"verified: float and quantized sessions agree within {verify['max_relative_err']:.1%} "
                f"(bound {verify['bound']:.0%})")
    if "rebuilt_outputs" not in verify:          # a weight file quantized without a model
        return f"verified: stored tensors bit-exact ({verify.get('tensors_checked', 0)} tensors)"
    return "verified: stored tensors bit-exact, model rebuilt from the file gives identical outputs"


def render(reports: list) -> str:
    """The comparison table: one row per scheme."""
    metric = next((r.metric["name"] for r in reports if r.metric), "metric")
    label = "bits/byte" if metric == "bits_per_byte" else metric
    headers = ["scheme", "bits/w", "file", "ratio", f"{label} float", "quantized", "delta",
               "ms b1 (f->q)", "ms b64 (f->q)", "quantize s"]
    rows = []
    for r in reports:
        bpw = r.stats.get("bits_per_weight")
        size = human_bytes(r.target["bytes"]) if r.target.get("bytes") is not None else "-"
        rows.append([r.scheme, f"{bpw:.2f}" if bpw is not None else "-", size,
                     f"{r.size_ratio:.3f}" if r.size_ratio is not None else "-",
                     *_metric_cells(r), *_latency_cells(r), f"{r.seconds_quantize:.3g}"])
    return table(headers, rows, align="lrrrrrrrrr")


@click.command()
@click.argument("src", type=click.Path(dir_okay=True))
@click.argument("dst", type=click.Path(dir_okay=True))
@click.option("--scheme", "scheme_values", multiple=True, required=True,
              help="Scheme (repeat or comma-separate for a comparison run): int8, int8-dynamic, int4, gptq, "
                   "q8_0, q4_0, q4_1, q5_0, q5_1, q3_k, q4_k, q5_k, iq4_nl, iq4_xs (one GGUF block type for every "
                   "weight), fp16, bf16, tfjs-uint8, tfjs-uint16 (TF.js model.json); "
                   "llama.cpp's file types (any case, per-tensor types as llama-quantize picks them): "
                   + "; ".join(describe(r) for r in RECIPES.values())
                   + ". For .onnx input: int8-dynamic, int8-static, int4.")
@click.option("--allow-requantize", is_flag=True,
              help="Accept an input that is already block-quantized (GGUF): dequantize and quantize it again, as "
                   "llama-quantize --allow-requantize (quality is lost twice).")
@click.option("--group-size", type=int, help="int4 / gptq: input columns per scale (32, 64 or 128; ONNX int4: a power of two from 16 to 256).")
@click.option("--imatrix", type=click.Path(dir_okay=False),
              help="GGUF block schemes: llama.cpp importance matrix (GGUF or .dat; `modelkit imatrix` makes one).")
@click.option("--skip", multiple=True, help="Keep modules matching this fnmatch pattern in float (repeatable).")
@click.option("--to", "to", type=click.Choice(sorted(FORMATS)), help="Output format (default: from DST's suffix).")
@click.option("--qat", is_flag=True, help="Quantization-aware training first (int8, int4, int8-dynamic).")
@click.option("--epochs", type=int, default=1, show_default=True, help="QAT epochs.")
@click.option("--steps", type=int, help="QAT: stop each epoch after this many steps.")
@click.option("--lr", type=float, help="QAT peak learning rate (default: a tenth of the model's recipe; 2e-05 for a "
                                       "Hugging Face language model).")
@click.option("--data", type=click.Path(dir_okay=False, exists=True),
              help="QAT of a Hugging Face language model: train on this UTF-8 text file (default: the standard "
                   "library's train split).")
@click.option("--eval", "evaluate", is_flag=True, help="Measure the metric before and after, and CPU latency.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Draw the metric against size for every scheme (PNG).")
@click.option("--verify/--no-verify", default=True, show_default=True, help="Read the output back and rebuild the model.")
@read_options()
@force_option
@output_options
def quantize(src: str, dst: str, scheme_values: tuple[str, ...], allow_requantize: bool, group_size: int | None,
             imatrix: str | None,
             skip: tuple[str, ...],
             to: str | None, qat: bool, epochs: int, steps: int | None, lr: float | None, data: str | None, evaluate: bool,
             plot: str | None, verify: bool, source_format: str | None, trust: bool, key: str | None,
             arch: str | None, force: bool, as_json: bool) -> None:
    """Quantize SRC into DST and report the cost: bits per weight, file size and ratio, the
    model's metric before and after (--eval), CPU latency at batch 1 and 64, and the time taken.

    With several schemes DST is a folder and each output is DST/<scheme>.<suffix> (--to picks the
    format; default safetensors, or onnx for .onnx input). GGUF outputs take the q* schemes.

    \b
    Examples:
      modelkit quantize runs/cnn/model.safetensors cnn-int8.safetensors --scheme int8 --eval
      modelkit quantize runs/tinylm/model.safetensors tinylm-q4_0.gguf --scheme q4_0
      modelkit quantize model-f16.gguf model-Q4_K_M.gguf --scheme Q4_K_M      # llama-quantize's recipe
      modelkit quantize weights.safetensors weights-q8_0.gguf --scheme q8_0      # no model, no torch needed
      modelkit quantize runs/tinylm/model.safetensors tinylm-q3_k.gguf --scheme q3_k --imatrix imatrix.gguf
      modelkit quantize runs/tinylm/model.safetensors out/ --scheme q8_0,q4_0,int4,gptq --eval --plot q.png
      modelkit quantize runs/cnn/model.safetensors cnn-qat.safetensors --scheme int4 --qat --epochs 3 --eval
      modelkit quantize ./Qwen2.5-0.5B qwen-int4 --scheme int4 --qat --steps 200 --lr 1e-5 --eval
      modelkit quantize cnn.onnx cnn-int8.onnx --scheme int8-static --eval
      modelkit quantize cnn.xml cnn-int8.xml --scheme int8 --eval     # OpenVINO IR: NNCF's int8 weights
    """
    from pathlib import Path

    from modelkit.errors import ConfigError
    from modelkit.pipeline.quantize import compare, plot_reports
    from modelkit.pipeline.quantize import quantize as run_quantize

    names = _schemes(scheme_values)
    if not names:
        raise ConfigError("--scheme needs at least one scheme name")
    options = {"group_size": group_size, "skip": skip, "qat": qat, "epochs": epochs, "steps": steps, "lr": lr,
               "verify": verify, "source_format": source_format, "trust": trust, "key": key, "arch": arch,
               "imatrix": imatrix, "allow_requantize": allow_requantize, "data": data}
    # QAT shows its training; a weight file quantized to GGUF without a model, the bytes written
    with Progress("qat" if qat else "quantize", enabled=(qat or len(names) == 1) and not as_json,
                  unit="" if qat else "bytes") as progress, \
            Progress("schemes", enabled=len(names) > 1 and not qat and not as_json) as schemes_done:
        if len(names) == 1:
            reports = [run_quantize(src, dst, scheme=names[0], format=to, evaluate=evaluate, force=force,
                                    progress=progress, **options)]
        else:     # a line per scheme done (with QAT, the training's own progress shows instead)
            reports = compare(src, dst, scheme_names=names, format=to or "safetensors", evaluate=evaluate,
                              force=force, progress=progress, schemes_done=schemes_done, **options)
    reports = [r for r in reports if r is not None]
    if not reports:                     # a rank other than 0 under torchrun: rank 0 writes and reports
        return
    if plot:
        plot_reports(reports, Path(plot), title=Path(src).name)
    if as_json:
        emit_json({"schema": SCHEMA, "ok": True, "source": reports[0].source,
                   "reports": [r.to_dict() for r in reports], "plot": plot})
        return
    for report in reports:
        for line in report.notes:
            note(line)
    click.echo(f"{src}: {reports[0].stats.get('parameters', '?')} parameters")
    click.echo(render(reports))
    for report in reports:
        if report.target.get("path"):
            click.echo(f"{report.scheme}: {report.target['path']} ({report.target['format']}), {_verified(report.verify)}")
    if plot:
        click.echo(f"plot: {plot}")
