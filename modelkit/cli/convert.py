"""`modelkit convert`: any supported format to any other, verified before the output appears."""
from __future__ import annotations

import click

from modelkit.cli.options import force_option, input_options, kv_cache_option, output_options, read_options
from modelkit.cli.output import Progress, emit_json, human_bytes, note
from modelkit.formats import FORMATS


def describe_verify(verify: dict | None) -> str:
    if verify is None:
        return "not verified (--no-verify)"
    if verify["method"] == "bit-exact":
        return f"weights bit-exact ({verify['tensors_checked']} tensors)"
    if "inputs" not in verify:          # a format convention that is not exact (Gemma's norms + 1 in GGUF)
        return f"weights {verify['method']} ({verify['tensors_checked']} tensors, max abs err {verify['max_abs_err']:.1e})"
    return (f"outputs match torch eager within {verify['atol']:.0e} (max abs err {verify['max_abs_err']:.2e} "
            f"on {verify['inputs']} inputs); weights bit-exact ({verify['tensors_checked']} tensors)")


@click.command()
@click.argument("src", type=click.Path(dir_okay=True))
@click.argument("dst", type=click.Path(dir_okay=True))
@click.option("--to", "to", type=click.Choice(sorted(FORMATS)), help="Output format (default: from DST's suffix).")
@click.option("--dtype", type=click.Choice(["f32", "f16", "bf16"]), help="Cast floating-point tensors.")
@click.option("--shard-size", help="safetensors, hf, tfjs: split into shards of at most this size (e.g. 2GB; tfjs: 4MB by default); DST is a folder.")
@click.option("--verify/--no-verify", default=True, show_default=True, help="Check the output before it takes its name.")
@read_options()
@input_options
@kv_cache_option
@force_option
@output_options
def convert(src: str, dst: str, to: str | None, source_format: str | None, dtype: str | None, arch: str | None,
            key: str | None, shard_size: str | None, verify: bool, trust: bool, force: bool, as_json: bool,
            example_inputs: tuple[str, ...], dynamic: tuple[str, ...], kv_cache: bool) -> None:
    """Convert SRC to DST. The input format is detected from content; the output's from --to or DST's suffix.

    Weight formats (safetensors, pth, hdf5, gguf) convert tensor by tensor and are checked bit for
    bit; graph formats (onnx, pt2, torchscript) are rebuilt from the file's ArchSpec (or --arch) and
    checked by running both models. A failed check exits 2 and leaves no output. A module of your own
    (--arch module:function, found in the current directory) is exported with the example inputs
    --input-shape gives; HDF5 files named *.weights.h5 get its Keras layers.

    \b
    Examples:
      modelkit convert runs/cnn/model.safetensors cnn.onnx
      modelkit convert checkpoint.bin model.safetensors --key state_dict
      modelkit convert runs/tinylm/model.safetensors tinylm.gguf --dtype f16
      modelkit convert big.pt out/ --to safetensors --shard-size 2GB
      modelkit convert weights.safetensors m.onnx --arch mypkg.models:make_model
      modelkit convert w.safetensors m.onnx --arch user_model:make \\
          --input-shape input=1x3x224x224:float32 --dynamic input:0
      modelkit convert w.safetensors lm.onnx --arch user_model:Net \\
          --input-shape ids=1x16:int64 --dynamic ids:0 --dynamic ids:1
      modelkit convert w.safetensors m.weights.h5 --arch user_model:make
      modelkit convert Llama-3.2-1B/ llama.onnx --kv-cache
      modelkit convert Llama-3.2-1B/ llama-copy       # a Hugging Face folder's suffix-less output: a folder
      modelkit convert runs/cnn/model.safetensors web/model.json --dtype f16   # TF.js Layers model in web/
    """
    from modelkit.pipeline.convert import convert as run_convert

    with Progress("convert", enabled=not as_json, unit="bytes") as progress:
        report = run_convert(src, dst, to=to, source_format=source_format, dtype=dtype, arch=arch,
                             shard_size=shard_size, verify=verify, force=force, trust=trust, key=key,
                             progress=progress, example_inputs=example_inputs or None, dynamic=dynamic or None,
                             kv_cache=kv_cache)
    if as_json:
        emit_json({"schema": "modelkit.convert/1", "ok": True, **report.to_dict()})
        return
    for line in report.notes:
        note(line)
    target = report.target
    click.echo(f"{report.source['path']} ({report.source['format']}) -> {target['path']} ({target['format']}"
               f"{', ' + target['dtype'] if target.get('dtype') else ''}), {human_bytes(target['bytes'])}, "
               f"{report.tensors} tensors, {report.seconds:.1f}s")
    click.echo(f"verified: {describe_verify(report.verify)}")
