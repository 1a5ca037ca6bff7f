"""`modelkit inspect`: what a model file holds, read from its headers only."""
from __future__ import annotations

import json

import click

from modelkit.cli.options import output_options, read_options
from modelkit.cli.output import emit_json, format_metrics, human_bytes, table


@click.command()
@click.argument("file", type=click.Path(dir_okay=True))
@click.option("--limit", type=click.IntRange(0), help="Show at most this many tensors (totals count all).")
@read_options(arch=False)
@output_options
def inspect(file: str, limit: int | None, source_format: str | None, trust: bool, key: str | None,
            as_json: bool) -> None:
    """Show FILE's format, tensors (name, dtype, shape, bytes), totals, metadata and ArchSpec.

    Never reads tensor data, so it is fast on files of any size.

    \b
    Examples:
      modelkit inspect runs/cnn/model.safetensors
      modelkit inspect model.safetensors --json | jq .parameters
      modelkit inspect exported.pt2          # its program's inputs, outputs and dynamic dimensions
      modelkit inspect exported_savedmodel/  # a TensorFlow SavedModel's variables
    """
    from modelkit.api import inspect as run_inspect

    info = run_inspect(file, format=source_format, trust=trust, key=key)
    if as_json:
        emit_json({"schema": "modelkit.inspect/1", "ok": True, **info.to_dict()})
        return
    click.echo(f"{info.path}: {info.format}, {human_bytes(info.file_bytes)}")
    shown = info.tensors if limit is None else info.tensors[:limit]
    rows = [(t.name, t.quantized or t.dtype, "x".join(map(str, t.shape)) or "scalar", t.nbytes) for t in shown]
    click.echo(table(["tensor", "dtype", "shape", "bytes"], rows, align="lllr"))
    if len(shown) < len(info.tensors):
        click.echo(f"... {len(info.tensors) - len(shown)} more tensors")
    click.echo(f"total: {len(info.tensors)} tensors, {info.num_parameters:,} parameters, "
               f"{human_bytes(info.tensor_bytes)} of tensor data")
    if info.layers is not None:
        click.echo(table(["layer", "class", "config"], [(lay["name"], lay["class"], lay["config"]) for lay in info.layers],
                         align="lll"))
    if info.program is not None:
        _echo_program(info.program)
    if info.model:
        _echo_model(info.model)
    elif info.arch and isinstance(info.arch.config.get("topology"), dict):      # a file's own Keras topology
        topology = info.arch.config["topology"]
        click.echo(f"arch: {info.arch.name} (the file's own Keras {topology.get('class_name')}: converts to ONNX and "
                   "TorchScript without --arch)")
    elif info.arch:
        click.echo(f"arch: {info.arch.name} {json.dumps(info.arch.config, sort_keys=True)}")
    else:
        click.echo("arch: none recorded (pass --arch to commands that need a model)")
    for key, value in sorted(info.metadata.items()):
        shown_value = value if len(value) <= 120 else value[:117] + "..."
        click.echo(f"metadata {key}: {shown_value}")
    for split in ("val", "test"):
        if isinstance(info.metrics.get(split), dict):
            click.echo(f"metrics {split}: {format_metrics(info.metrics[split])}")


def _echo_program(program: dict) -> None:
    """An exported program's signature: each input and output with its dtype and shape (dynamic dimensions
    by name), the dynamic dimensions' ranges, and what the program holds."""
    def shape(entry: dict) -> str:
        return "[" + ", ".join(str(d) for d in entry["shape"] or []) + "]"

    rows = [(kind, e["name"], e["dtype"] or "?", shape(e)) for kind, group in (("input", program["inputs"]),
                                                                               ("output", program["outputs"]))
            for e in group]
    click.echo(table(["program", "name", "dtype", "shape"], rows, align="llll"))
    for name, bounds in program["dynamic"].items():
        low, high = bounds["min"], bounds["max"]
        click.echo(f"dynamic {name}: {low if low is not None else 0} .. {high if high is not None else 'unbounded'}")
    click.echo(f"program: {program['parameters']} parameters, {program['buffers']} buffers, {program['constants']} "
               f"constants, {program['nodes']} distinct operators; schema {program['schema_version']}, "
               f"torch {program['torch_version'] or '?'}")


def _echo_model(model: dict) -> None:
    """A Hugging Face family's summary, one fact a line."""
    click.echo(f"arch: {model['family']} (model_type {model['model_type']}; llama.cpp {model['llama_cpp_architecture']})")
    click.echo(f"parameters: {model['parameters']:,}, dtype {model['dtype']}, context length {model['context_length']}, "
               f"vocabulary {model['vocab_size']}")
    tokenizer = model["tokenizer"]
    if tokenizer is None:
        click.echo("tokenizer: none (no tokenizer files)")
    else:
        click.echo(f"tokenizer: {tokenizer['kind']}, {tokenizer['style']}, {tokenizer['vocab_size']} tokens, "
                   f"chat template {'present' if tokenizer['chat_template'] else 'absent'}")
    if "shards" in model:
        click.echo(f"shards: {model['shards']['files']} safetensors file(s), {human_bytes(model['shards']['bytes'])}")
    quantization = model.get("quantization")
    if quantization:
        for group in quantization["groups"]:
            _echo_quantization(group)
        click.echo(f"quantization ignore: {', '.join(quantization['ignore']) or 'nothing'} (left as stored)")
        if quantization["kv_cache"]:
            click.echo(f"quantization kv cache: ({quantization['kv_cache']}) not applied (modelkit runs it in float)")


def _echo_quantization(group: dict) -> None:
    """One compressed-tensors config group of another tool's folder: its scheme and how modelkit reads it."""
    if group["weights"] is not None:
        inputs = f", inputs {group['input_activations']}" if group["input_activations"] else ""
        read = ", ".join(f"{n} as {label}" for label, n in group["read_as"].items()) or "no modules"
        click.echo(f"quantization {group['group']}: {group['format']}, weights {group['weights']}{inputs}; "
                   f"read: {read}")
    for what in group["not_applied"]:
        click.echo(f"quantization {group['group']}: {what} not applied (modelkit runs them in float)")
