"""`modelkit eval`: a reference model's metric on a split of its own data; a language model's on text."""
from __future__ import annotations

import click

from modelkit.cli.options import device_option, output_options, read_options
from modelkit.cli.output import Progress, emit_json, format_metrics
from modelkit.formats import EVAL_RUNTIMES


@click.command("eval")
@click.argument("checkpoint", type=click.Path(dir_okay=True))
@click.option("--split", type=click.Choice(["train", "val", "test"]),
              help="Data split (default: test for classifiers, val for tinylm and Hugging Face language models).")
@click.option("--data", type=click.Path(exists=True, dir_okay=False),
              help="Hugging Face language models: a UTF-8 text file to measure on instead of the split.")
@click.option("--context", type=click.IntRange(1), help="Hugging Face language models: tokens per window "
              "(default: the model's context length, at most 512).")
@click.option("--max-tokens", "max_tokens", type=click.IntRange(1),
              help="Hugging Face language models: score at most this many tokens of the text.")
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False),
              help="Hugging Face language models: the folder holding the tokenizer files, for a file that carries "
                   "none (an ONNX export; default: the files next to it).")
@device_option
@click.option("--runtime", type=click.Choice(EVAL_RUNTIMES), default="torch", show_default=True,
              help="onnxruntime: run an ONNX file in an onnxruntime session instead of torch; openvino: an "
                   "OpenVINO IR in OpenVINO's runtime.")
@read_options()
@output_options
def eval_command(checkpoint: str, split: str | None, data: str | None, context: int | None, max_tokens: int | None,
                 tokenizer: str | None, device: str, runtime: str, source_format: str | None, trust: bool, key: str | None, arch: str | None,
                 as_json: bool) -> None:
    """Evaluate CHECKPOINT: accuracy for mlp/cnn; bits per byte, perplexity and the unigram baseline for tinylm.

    A causal language model of a Hugging Face family (a model folder, a GGUF of one, a quantized output)
    is measured on text with its own tokenizer: bits per byte (cross-entropy in bits over the text's UTF-8
    bytes, comparable across tokenizers) and perplexity per token, on --data FILE or on the held-out
    standard-library text tinylm is measured on, in windows of --context tokens. Its ONNX export runs in
    onnxruntime with --runtime onnxruntime, measured with the tokenizer files next to the .onnx or in
    --tokenizer FOLDER.

    \b
    Examples:
      modelkit eval runs/cnn/model.safetensors
      modelkit eval runs/tinylm/model.safetensors --split test --json
      modelkit eval cnn.onnx --runtime onnxruntime
      modelkit eval cnn.xml --runtime openvino
      modelkit eval ./Qwen2.5-0.5B --max-tokens 20000
      modelkit eval model-q4_0.gguf --data notes.txt --context 256 --json
      modelkit eval llama.onnx --runtime onnxruntime --tokenizer ./Llama-3.2-1B --max-tokens 20000
    """
    from modelkit.api import evaluate

    with Progress("eval (tokens)", enabled=not as_json) as progress:
        result = evaluate(checkpoint, split=split, arch=arch, device=device, runtime=runtime, format=source_format,
                          trust=trust, key=key, data=data, context=context, max_tokens=max_tokens, tokenizer=tokenizer,
                          progress=progress)
    if as_json:
        emit_json({"schema": "modelkit.eval/1", "ok": True, "path": checkpoint, **result})
        return
    click.echo(f"{result['model']} on {result['split']}: {format_metrics(result)}")
