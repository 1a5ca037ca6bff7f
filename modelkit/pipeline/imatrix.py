"""`modelkit imatrix`: an importance matrix from calibration text, in llama.cpp's format and names.

What llama-imatrix computes (tools/imatrix/imatrix.cpp): the text is tokenized and cut into chunks
of `context` tokens (the first token of each replaced by BOS when the tokenizer has one), the model runs
on each chunk, and for every weight matrix of the repeating blocks (GGUF names `blk.N.*`: the
attention and feed-forward projections; not the token embeddings, not the output head) it adds, per
input column, the squared activations of every token that went in, and counts the tokens. Here torch
forward pre-hooks on the model's Linear (and transformers' Conv1D) layers collect the same sums, in
float64; the weights' GGUF names come from the family's llama.cpp layout (modelkit.models.gguf_conventions).
The file is written in llama-imatrix's GGUF form (modelkit.quantizers.imatrix.write_imatrix), so
`llama-quantize --imatrix` and `modelkit quantize --imatrix` both take it.

Models: tinylm (its bytes are its tokens) and causal language models of the Hugging Face families
(transformers, with their own tokenizer).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modelkit.errors import ConfigError

PathLike = str | os.PathLike[str]
CONTEXT = 512                   # llama-imatrix's default chunk size (-c 512)
BATCH_TOKENS = 4096             # tokens per forward pass (chunks batched together)
LAYER_PREFIX = "blk."           # llama-imatrix collects these weights only (no --process-output)


@dataclass
class ImatrixReport:
    """What `compute_imatrix` wrote."""

    path: str
    model: str
    datasets: list[str]
    entries: int
    chunks: int
    chunk_size: int
    tokens: int
    bytes: int
    seconds: float
    names: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Collector:
    """Sums of squared inputs (float64) and token counts per weight, from forward pre-hooks."""

    def __init__(self, model: nn.Module, names: dict[str, str]) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.handles = []
        for module_name, module in model.named_modules():
            gguf_name = names.get(f"{module_name}.weight")
            if gguf_name is None or not gguf_name.startswith(LAYER_PREFIX) or not _is_matmul(module):
                continue
            self.handles.append(module.register_forward_pre_hook(self._hook(gguf_name)))

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            rows = x.reshape(-1, x.shape[-1]).double()                              # (tokens, in_features)
            squares = (rows * rows).sum(0)
            self.sums[name] = self.sums[name] + squares if name in self.sums else squares
            self.counts[name] = self.counts.get(name, 0) + rows.shape[0]
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _is_matmul(module: nn.Module) -> bool:
    """A layer multiplying its input by a weight matrix: nn.Linear, or transformers' Conv1D (GPT-2)."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None
                                             and module.weight.ndim == 2)


def _tokens(model: nn.Module, tokenizer: Any, text: str) -> tuple[list[int], int | None, int, Callable[..., Any]]:
    """The text's token ids, the BOS id to start each chunk with, the model's context, and how to run a batch."""
    from modelkit.models import hf_config_of

    if hf_config_of(model) is not None:
        if tokenizer is None:
            raise ConfigError(f"computing an importance matrix for a {type(model).__name__} needs its tokenizer: the "
                              "model carries no tokenizer.json")
        ids = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        return ids, tokenizer.bos_token_id, int(limit or CONTEXT), lambda batch: model(input_ids=batch, use_cache=False)
    if getattr(type(model), "arch", None) == "tinylm":          # a byte-level model: the bytes are the tokens
        return list(text.encode("utf-8")), None, int(model.config.max_position_embeddings), model
    raise ConfigError(f"an importance matrix needs a language model (tinylm or a Hugging Face causal LM), "
                      f"not {type(model).__name__}")


@torch.no_grad()
def collect(model: nn.Module, tokenizer: Any, text: str, *, context: int | None = None, chunks: int | None = None,
            progress: Callable[[int, int], None] | None = None) -> tuple[dict[str, tuple[Any, Any]], int, int, int]:
    """Run `model` on `text` as llama-imatrix does; returns ({GGUF name: (sums (1, n), counts (1,))}, chunks run,
    chunk size, tokens run)."""
    from modelkit.models import arch_spec, gguf_conventions

    ids, bos, limit, run = _tokens(model, tokenizer, text)
    context = context or min(limit, CONTEXT)
    if not 1 <= context <= limit:
        raise ConfigError(f"--context {context}: must be between 1 and the model's context length {limit}")
    available = len(ids) // context
    if available < 1:
        raise ConfigError(f"the calibration text has {len(ids)} tokens, fewer than one chunk of {context}; give more "
                          "text or a smaller --context")
    n_chunks = available if chunks is None else min(chunks, available)
    rules = gguf_conventions(arch_spec(model))
    if rules is None:
        raise ConfigError(f"{arch_spec(model).name} has no llama.cpp layout, so its weights have no GGUF names for "
                          "an importance matrix")
    tokens = torch.tensor(ids[:n_chunks * context], dtype=torch.long).reshape(n_chunks, context)
    if bos is not None:
        tokens[:, 0] = bos                          # as llama-imatrix: BOS replaces each chunk's first token
    device = next(model.parameters()).device
    collector = _Collector(model, dict(rules.names))
    if not collector.handles:
        raise ConfigError(f"no layer of {type(model).__name__} has a llama.cpp weight name under {LAYER_PREFIX}*")
    was_training = model.training
    model.eval()
    try:
        batch = max(1, BATCH_TOKENS // context)
        for start in range(0, n_chunks, batch):
            run(tokens[start:start + batch].to(device))
            if progress is not None:
                progress(min(start + batch, n_chunks), n_chunks)
    finally:
        collector.close()
        model.train(was_training)
    entries = {name: (sums.float().cpu().numpy().reshape(1, -1), [collector.counts[name]])
               for name, sums in collector.sums.items()}
    return entries, n_chunks, context, n_chunks * context


def compute_imatrix(model_path: PathLike, data: PathLike, out: PathLike, *, context: int | None = None,
                    chunks: int | None = None, force: bool = False, device: str = "cpu",
                    progress: Callable[[int, int], None] | None = None, source_format: str | None = None,
                    trust: bool = False, key: str | None = None, arch: Any = None) -> ImatrixReport:
    """Compute an importance matrix for the model at `model_path` on the UTF-8 text in `data`, and write it to
    `out` in llama-imatrix's GGUF form.

    Args:
        context: tokens per chunk (default: the model's context length, at most 512 as llama-imatrix).
        chunks: run at most this many chunks (default: all the text holds).
        force: overwrite `out`.
        device: where to run the model ("cpu", "cuda", "auto").
        progress: called with (chunks done, chunks in all).
        source_format, trust, key, arch: how to read the model, as for `load_module`.

    Raises:
        ConfigError: not a language model, unreadable or too short text, a context the model cannot take.

    Example:
        >>> compute_imatrix("runs/tinylm/model.safetensors", "calibration.txt", "imatrix.gguf")   # doctest: +SKIP
    """
    from modelkit.pipeline import distributed
    from modelkit.pipeline.load import load_language_model
    from modelkit.quantizers.imatrix import write_imatrix
    from modelkit.storage.atomic import check_output

    started = time.perf_counter()
    out = Path(out)
    check_output(out, force=force)                              # before minutes of running the model
    try:
        text = Path(data).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{data}: cannot read it as UTF-8 text ({e})") from e
    loaded = load_language_model(model_path, format=source_format, arch=arch, trust=trust, key=key)
    model = loaded.model.to(distributed.resolve_device(device, distributed.DistInfo()))
    entries, n_chunks, chunk_size, tokens = collect(model, loaded.tokenizer, text, context=context, chunks=chunks,
                                                    progress=progress)
    datasets = [str(data)]
    size = write_imatrix(out, entries, datasets=datasets, chunk_count=n_chunks, chunk_size=chunk_size, force=force)
    from modelkit.models import arch_spec

    return ImatrixReport(path=str(out), model=arch_spec(model).name, datasets=datasets, entries=len(entries),
                         chunks=n_chunks, chunk_size=chunk_size, tokens=tokens, bytes=size,
                         seconds=round(time.perf_counter() - started, 3), names=sorted(entries))
