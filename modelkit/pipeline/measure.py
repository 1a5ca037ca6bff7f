"""Measuring a model: its task metric on its own data, and CPU latency. One place for both, used by
`modelkit eval`, the quantize (torch and ONNX), prune and distill reports, the demo and bench/quantize.py."""
from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modelkit.errors import ConfigError, UnsupportedConversionError
from modelkit.formats import EVAL_RUNTIMES, detect_format
from modelkit.models import ArchSpec

PathLike = str | os.PathLike[str]
LATENCY_BATCHES = (1, 64)


def arch_name(model: nn.Module) -> str:
    """The registered model a module is, for metrics and latency inputs; a clear error otherwise."""
    from modelkit.models import MODELS

    name = getattr(type(model), "arch", None)
    if name not in MODELS:
        raise UnsupportedConversionError(type(model).__name__, "quantization report",
                                         "metrics, QAT and calibration need a reference model (mlp, cnn, tinylm)")
    return name




def evaluate(path_or_model: PathLike | nn.Module, *, split: str | None = None, arch: str | None = None,
             device: str = "auto", runtime: str = "torch", format: str | None = None, trust: bool = False,
             key: str | None = None, data: PathLike | None = None, context: int | None = None,
             max_tokens: int | None = None, tokenizer: Any = None,
             progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Evaluate a model (a file or a module) on text or on a split of its own data.

    Returns the metrics plus "model" and "split": accuracy for classifiers; bits per byte,
    perplexity and the unigram baseline for tinylm. The default split is the model's own
    (test for classifiers, validation for tinylm). `runtime="onnxruntime"` runs an ONNX file
    in an onnxruntime session (CPU), `runtime="openvino"` an OpenVINO IR in OpenVINO's runtime (CPU, f32),
    instead of rebuilding the torch module from its weights.
    `format`, `trust`, `key` and `arch` are `load_module`'s, for files.

    A causal language model of a Hugging Face family (a folder, a GGUF of one, a quantized output)
    gets `text_metrics` on `data` (a UTF-8 text file) or, by default, on the held-out standard-library
    text tinylm is measured on (`split`), tokenized with its own tokenizer (`tokenizer` for a module:
    transformers' tokenizer). `context`, `max_tokens` and `progress` (tokens scored, tokens in all) are
    `text_metrics`'. A file that carries no tokenizer (an ONNX export, run in onnxruntime or rebuilt in
    torch) is measured with `tokenizer` (transformers' tokenizer, or the folder holding its files) or the
    tokenizer files next to it (modelkit.pipeline.graph_lm.tokenizer_beside).
    """
    from torch import nn

    from modelkit.models import hf_config_of, load_model_module
    from modelkit.pipeline import distributed
    from modelkit.pipeline import train as training
    from modelkit.pipeline.graph_lm import folder_tokenizer, tokenizer_beside
    from modelkit.pipeline.load import load_language_model

    if runtime not in EVAL_RUNTIMES:
        raise ConfigError(f"unknown runtime {runtime!r}; known: {', '.join(EVAL_RUNTIMES)}")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = folder_tokenizer(tokenizer, trust=trust)
    graph = _RUNTIME_FORMATS.get(runtime)
    if graph is not None:
        fmt, suffix, called = graph
        if isinstance(path_or_model, nn.Module) or detect_format(Path(path_or_model)) != fmt:
            raise ConfigError(f"{path_or_model}: runtime {runtime} needs {called} file; convert it with "
                              f"modelkit convert SRC model{suffix} first")
        model, device = session_module(path_or_model, fmt=fmt), "cpu"
        if hf_config_of(model) is not None and tokenizer is None:
            tokenizer = tokenizer_beside(path_or_model, trust=trust)
    elif isinstance(path_or_model, nn.Module):
        model = path_or_model
    else:
        loaded = load_language_model(path_or_model, format=format, arch=arch, trust=trust, key=key)
        model, tokenizer = loaded.model, tokenizer or loaded.tokenizer
        if hf_config_of(model) is not None and tokenizer is None and Path(path_or_model).is_file():
            tokenizer = tokenizer_beside(path_or_model, trust=trust)        # a file that carries none: ONNX
    dev = distributed.resolve_device(device, distributed.DistInfo())
    if hf_config_of(model) is not None:
        return _evaluate_text(model, tokenizer, split=split, data=data, context=context, max_tokens=max_tokens,
                              device=dev, progress=progress)
    name = getattr(type(model), "arch", None)
    if name is None:
        raise ConfigError(f"{type(model).__name__} is not a reference model; evaluation needs one of its tasks")
    if data is not None or context is not None or max_tokens is not None:
        raise ConfigError(f"{name} is measured on its own task's data; --data, --context and --max-tokens apply "
                          "to Hugging Face language models")
    split = split or load_model_module(name).TASK.default_split
    metrics = training.evaluate(model.to(dev), name, split, device=dev)
    return {"model": name, "split": split, **metrics}


# Longest window text_metrics runs by default: a model's context can be 128k tokens, and a 512-token
# window already conditions on most of what helps a next-token guess on source code.
EVAL_CONTEXT = 512
# Logits a batch may hold ((windows, tokens, vocabulary), float32): 2**26 is 256 MiB.
EVAL_LOGITS = 2**26


def _evaluate_text(model: nn.Module, tokenizer: Any, *, split: str | None, data: PathLike | None,
                   context: int | None, max_tokens: int | None, device: torch.device,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    from modelkit.models import arch_spec, load_model_module

    if tokenizer is None:
        raise ConfigError(f"evaluating a {type(model).__name__} needs its tokenizer: the model carries no "
                          "tokenizer.json (copy the tokenizer files into its folder; API: tokenizer=...)")
    if data is not None:
        if split is not None:
            raise ConfigError("give --data FILE or --split, not both")
        try:
            text = Path(data).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{data}: cannot read it as UTF-8 text ({e})") from e
        label = str(data)
    else:
        split = split or "val"
        text = load_model_module("tinylm").TASK.text(split).decode("utf-8", errors="replace")
        label = split
    metrics = text_metrics(model.to(device), tokenizer, text, context=context, max_tokens=max_tokens, progress=progress)
    return {"model": arch_spec(model).name, "split": label, **metrics}


@torch.no_grad()
def text_metrics(model: nn.Module, tokenizer: Any, text: str, *, context: int | None = None,
                 max_tokens: int | None = None, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Perplexity and bits per byte of a causal language model (transformers' module) on `text`.

    The text is tokenized once, with a BOS token first when the tokenizer has one (so its first token
    is predicted too), cut to `max_tokens` predicted tokens, and scored in non-overlapping windows of
    `context` tokens (default: the model's context length, at most EVAL_CONTEXT), batched; each token is
    predicted once, from the tokens before it in its window. Bits per byte is the summed cross-entropy
    in bits over the UTF-8 bytes those tokens cover, so models with different tokenizers compare;
    perplexity is per token. `progress(tokens scored, n)` is called after each batch of windows.
    """
    import torch.nn.functional as F

    if not text:
        raise ConfigError("the text to evaluate on is empty")
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    context = context or min(limit or EVAL_CONTEXT, EVAL_CONTEXT)
    if context < 1 or (limit and context > limit):
        raise ConfigError(f"--context {context}: must be between 1 and the model's context length {limit}")
    started = time.perf_counter()
    ids, ends = _token_spans(tokenizer, text, max_tokens)
    bos = tokenizer.bos_token_id
    seq = ([bos] if bos is not None else []) + ids
    # targets are seq[1:]; the byte span they cover starts after the first token when there is no BOS
    first_byte = 0 if bos is not None else ends[0]
    n = len(seq) - 1 if max_tokens is None else min(len(seq) - 1, max_tokens)
    if n < 1:
        raise ConfigError("the text is a single token; nothing to predict")
    target_end = ends[n - 1 if bos is not None else n]              # char end of the last target token
    n_bytes = len(text[:target_end].encode("utf-8")) - len(text[:first_byte].encode("utf-8"))
    tokens = torch.tensor(seq[:n + 1], dtype=torch.long)
    device = next(model.parameters(), torch.empty(0)).device      # none: a graph in onnxruntime (CPU)
    vocab = int(model.config.vocab_size)
    largest = int(tokens.max())
    if largest >= vocab:        # a tokenizer of another model: the embedding lookup would fail deep in torch
        raise ConfigError(f"the tokenizer gives token id {largest} for a model with a vocabulary of {vocab}: the "
                          "tokenizer files belong to another model; use the tokenizer the model was trained with")
    batch = max(1, EVAL_LOGITS // (context * vocab))
    full = n // context
    windows = [tokens[:full * context + 1].unfold(0, context + 1, context)] if full else []   # (full, context + 1)
    if n % context:
        windows.append(tokens[full * context:][None])                                     # (1, rest + 1)
    was_training = model.training
    model.eval()
    nll, scored = 0.0, 0
    for group in windows:
        for chunk in group.split(batch):
            chunk = chunk.to(device)
            logits = model(input_ids=chunk[:, :-1], use_cache=False).logits.float()       # (B, T, vocab)
            nll += float(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
            scored += chunk[:, 1:].numel()
            if progress is not None:
                progress(scored, n)
    model.train(was_training)
    seconds = time.perf_counter() - started
    return {"bits_per_byte": nll / math.log(2) / n_bytes, "perplexity": math.exp(nll / n), "tokens": n,
            "bytes": n_bytes, "bytes_per_token": n_bytes / n, "context": context,
            "windows": full + (1 if n % context else 0), "seconds": round(seconds, 3)}


def _token_spans(tokenizer: Any, text: str, max_tokens: int | None = None) -> tuple[list[int], list[int]]:
    """The text's token ids (no special tokens) and, for each, the character offset where it ends.

    With `max_tokens`, a prefix of the text long enough for them is tokenized (the tokens past the cut
    are dropped), not the whole text."""
    if max_tokens is not None and len(text) > 64 * (max_tokens + 2):
        ids, ends = _token_spans(tokenizer, text[:64 * (max_tokens + 2)])
        if len(ids) > max_tokens + 2:           # the last tokens may be cut by the prefix: never scored
            return ids[:max_tokens + 1], ends[:max_tokens + 1]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    if not ids:
        raise ConfigError("the text tokenizes to no tokens")
    ends, last = [], 0
    for _, end in offsets:                 # special or merged tokens may report (0, 0): keep the ends rising
        last = max(last, int(end))
        ends.append(last)
    ends[-1] = len(text)                   # trailing text a normalizer dropped still belongs to the last token
    return ids, ends


@torch.no_grad()
def latency_ms(model: nn.Module, inputs: Any, *, repeats: int = 20, min_seconds: float = 0.2) -> float:
    """Median wall time of one forward pass on CPU, in milliseconds (after two warm-up calls)."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    model.eval()
    for _ in range(2):
        model(*args)
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - started < min_seconds and len(times) < 10 * repeats):
        t0 = time.perf_counter()
        model(*args)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def latencies(model: nn.Module, batches: Sequence[int] = LATENCY_BATCHES) -> dict[str, float]:
    """CPU latency at each batch size on the model's example inputs (tinylm, and Hugging Face language
    models: 16-token windows of random ids)."""
    from modelkit.models import hf_config_of, load_model_module

    config = hf_config_of(model)
    if config is not None:
        vocab = int(getattr(model.config, "vocab_size", 2))

        def make(batch: int) -> torch.Tensor:
            return torch.randint(0, vocab, (batch, 16), generator=torch.Generator().manual_seed(0))
    else:
        make = load_model_module(arch_name(model)).example_inputs
    return {f"batch_{b}": round(latency_ms(model.cpu(), make(b)), 4) for b in batches}


def metric_change(name: str, higher_is_better: bool, before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """One metric before and after a transform (as `evaluate` returns them): the reports' "metric" entry."""
    b, a = before[name], after[name]
    return {"name": name, "higher_is_better": higher_is_better, "float": b, "quantized": a, "delta": a - b,
            "relative": (a - b) / b if b else math.nan}


# Runtimes that run a graph file's own graph: runtime -> (its format, the suffix to convert to).
# runtime -> (format, suffix, how the format is named in a sentence)
_RUNTIME_FORMATS = {"onnxruntime": ("onnx", ".onnx", "an ONNX"), "openvino": ("openvino", ".xml", "an OpenVINO IR")}


def session_module(path: PathLike, arch: ArchSpec | None = None, fmt: str = "onnx") -> nn.Module:
    """A graph file's own runtime (an onnxruntime session; OpenVINO's compiled model for fmt "openvino") dressed
    as the reference model, so the zoo's evaluation runs it.

    `arch` defaults to the ArchSpec stored in the file (ONNX metadata_props, the IR's rt_info).
    """
    from modelkit.formats import ReadOptions, load_format
    from modelkit.models import MODELS, config_from_dict

    path = Path(path)
    if arch is None:
        arch = load_format(fmt).read(path, ReadOptions()).arch
        if arch is None:
            raise UnsupportedConversionError(path.name, "onnxruntime" if fmt == "onnx" else fmt, "running the file as "
                                             f"a reference model needs the ArchSpec modelkit records when it writes {fmt}")
    hf = arch.name in MODELS and MODELS[arch.name].hf
    if hf and fmt != "onnx":
        raise UnsupportedConversionError(path.name, fmt, f"a {arch.name} language model runs in onnxruntime (an ONNX "
                                         "export) or in torch; not in OpenVINO's runtime")
    run = load_format(fmt).runnable(path)
    if hf:
        from modelkit.pipeline.graph_lm import graph_causal_lm

        return graph_causal_lm(path, arch, run)

    class Session(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = config_from_dict(arch.name, arch.config)

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(run(*inputs))

    Session.arch = arch.name
    return Session()
