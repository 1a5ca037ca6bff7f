"""Language models behind `modelkit serve`: continuous batching over a key/value cache.

One engine thread per model holds the running sequences. Between decode steps it admits waiting
requests (each prompt is one prefill pass that fills its cache), then runs one decode step for every
running sequence together: sequences of different lengths share the step, each at its own position,
with a mask over the cache columns it has not written. A sequence leaves when it reaches its token
limit, an end-of-sequence token, or its client stops listening (a stop string, a closed stream).

- tinylm (`TinyLMDecoder`, pipeline/tinylm_decoder.py; `modelkit generate` decodes tinylm with it too):
  its own weights walked with a cache of (layers, slots, kv_heads, window, head_dim); running sequences keep slots 0..n-1, so a step reads views, not copies. tinylm's
  `generate` crops the context to the model's window and re-runs it; a sequence that outgrows the
  window does the same here, one full pass per token, so the text stays equal.
- Hugging Face causal LMs (`HFDecoder`): transformers' DynamicCache per sequence; a step left-pads the
  caches to one length with a padding mask and each row's own position ids, as transformers' `generate`
  does for a padded batch. Models with sliding-window layers step one sequence at a time.
- A Llama-family model (llama, mistral, qwen2, qwen3) whose products are all packed weights (a GGUF file,
  an int8/int4 output) runs as tinylm does (`HFLlamaDecoder`, pipeline/hf_llama_decoder.py): a static
  cache of max_batch slots of min(max_position_embeddings, SERVE_WINDOW) positions, one fused C call per
  step while one sequence runs, batched torch steps otherwise; a sequence that outgrows the window runs
  full passes. Where that cache would pass SERVE_CACHE_BYTES the model keeps `HFDecoder`.

Tokens go back to the caller through `emit(event)`, called on the engine thread: ("token", id) for each
new token, then ("done", reason) with reason "eos", "length", "cancelled" or an error message.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from modelkit.errors import RequestError
from modelkit.pipeline.tinylm_decoder import TinyLMDecoder

Emit = Callable[[tuple[str, Any]], None]
SERVE_WINDOW = 4096                   # positions a packed Llama-family model's static cache holds per slot
SERVE_CACHE_BYTES = 1 << 30           # its keys and values together at most (else HFDecoder)


@dataclass(frozen=True)
class Sampling:
    """How one request picks tokens: greedy at temperature 0, else sampled (top_p nucleus), seeded."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise RequestError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0 <= self.temperature <= 100:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(eq=False)
class Job:
    """One request being generated: its tokens so far and its place in the decoder's cache."""

    ids: list[int]
    sampling: Sampling
    emit: Emit
    new_tokens: int = 0
    cancelled: bool = False
    state: Any = None                  # the decoder's: a cache slot, a DynamicCache, or None (full passes)
    generator: torch.Generator | None = None
    prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_tokens = len(self.ids)
        if self.sampling.temperature > 0:
            seed = self.sampling.seed if self.sampling.seed is not None else int.from_bytes(os.urandom(6))
            self.generator = torch.Generator().manual_seed(seed)


def pick(logits: torch.Tensor, seq: Job) -> int:
    """The next token from one row of logits (vocab,): argmax when greedy, else a seeded nucleus sample."""
    if seq.generator is None:
        return int(logits.argmax())
    probs = (logits.float().cpu() / seq.sampling.temperature).softmax(-1)     # the generator is on the CPU
    if seq.sampling.top_p < 1:
        ordered, order = probs.sort(descending=True)
        keep = ordered.cumsum(-1) - ordered < seq.sampling.top_p        # the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
    return int(torch.multinomial(probs, 1, generator=seq.generator))


class HFDecoder:
    """A transformers causal LM with a DynamicCache per sequence (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        from transformers.cache_utils import DynamicCache, DynamicLayer

        from modelkit.testing.causal_lm import _cache_argument

        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.cache_argument = _cache_argument(model)
        self.Cache = DynamicCache
        self.batched = all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        from modelkit.testing.causal_lm import returned_cache

        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self.cache_argument: cache})
        return out.logits[:, -1], returned_cache(out)

    def prefill(self, seq: Job) -> torch.Tensor:
        T = len(seq.ids)
        logits, seq.state = self._forward(torch.tensor([seq.ids], device=self.device),
                                          torch.ones(1, T, dtype=torch.long, device=self.device),
                                          torch.arange(T, device=self.device)[None], self.Cache(config=self.model.config))
        return logits[0]

    def step(self, seqs: Sequence[Job]) -> list[torch.Tensor]:
        if len(seqs) == 1 or not self.batched:
            return [self._step_one(s) for s in seqs]
        lengths = [s.state.get_seq_length() for s in seqs]
        width = max(lengths)
        layers = []
        for i in range(len(seqs[0].state.layers)):       # left-pad every sequence's keys/values to `width`
            ks = [F.pad(s.state.layers[i].keys, (0, 0, width - n, 0)) for s, n in zip(seqs, lengths, strict=True)]
            vs = [F.pad(s.state.layers[i].values, (0, 0, width - n, 0)) for s, n in zip(seqs, lengths, strict=True)]
            layers.append((torch.cat(ks), torch.cat(vs)))
        mask = torch.tensor([[0] * (width - n) + [1] * (n + 1) for n in lengths], device=self.device)
        ids = torch.tensor([[s.ids[-1]] for s in seqs], device=self.device)
        positions = torch.tensor([[n] for n in lengths], device=self.device)
        logits, cache = self._forward(ids, mask, positions, self.Cache(layers, config=self.model.config))
        for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            seq.state = self.Cache([(layer.keys[row:row + 1, :, width - n:], layer.values[row:row + 1, :, width - n:])
                                    for layer in cache.layers], config=self.model.config)
        return list(logits)

    def _step_one(self, seq: Job) -> torch.Tensor:
        n = seq.state.get_seq_length()
        logits, seq.state = self._forward(torch.tensor([[seq.ids[-1]]], device=self.device),
                                          torch.ones(1, n + 1, dtype=torch.long, device=self.device),
                                          torch.tensor([[n]], device=self.device), seq.state)
        return logits[0]

    def release(self, seq: Job) -> None:
        seq.state = None


@dataclass
class StepStats:
    """One engine iteration, for metrics: sequences in the decode step, tokens made, seconds."""

    batch: int
    tokens: int
    seconds: float


class TextEngine:
    """The engine thread of one language model: continuous batching (see the module docstring).

    Args:
        name: The model's name (thread name, messages).
        decoder: A TinyLMDecoder or HFDecoder.
        eos: Token ids that end a sequence.
        max_batch: Sequences decoded together at most; more wait.
        max_queue: Requests waiting at most; one more is refused with 503.
        on_step: Called with a StepStats after each iteration (engine thread).
    """

    def __init__(self, name: str, decoder: Any, *, eos: Sequence[int] = (), max_batch: int = 32, max_queue: int = 256,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        self.name, self.decoder, self.eos = name, decoder, frozenset(eos)
        self.max_batch = max_batch
        self.waiting: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.running: list[Job] = []
        self.on_step = on_step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the engine thread (again after `stop`: an app's lifespan may run more than once)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"modelkit-serve:{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish: running and waiting sequences end as "cancelled"."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, ids: list[int], sampling: Sampling, emit: Emit) -> Job:
        seq = Job(list(ids), sampling, emit)
        try:
            self.waiting.put_nowait(seq)
        except queue.Full:
            raise RequestError(f"model {self.name!r}: {self.waiting.maxsize} requests are already waiting; "
                               "retry later", 503) from None
        return seq

    @torch.inference_mode()
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception as e:  # a fault of ours: end what runs with it, keep serving the next requests
                for seq in list(self.running):
                    self._finish(seq, f"error: {type(e).__name__}: {e}")
        for seq in [*self.running, *_drain(self.waiting)]:
            self._finish(seq, "cancelled")

    def _iterate(self) -> None:
        """Admit waiting sequences, then one decode step for every running one."""
        if not self.running:
            try:
                first = self.waiting.get(timeout=0.05)
            except queue.Empty:
                return
            self._admit(first)
        while len(self.running) < self.max_batch:
            try:
                self._admit(self.waiting.get_nowait())
            except queue.Empty:
                break
        self._drop_cancelled()
        if not self.running:
            return
        started = time.perf_counter()
        batch = list(self.running)
        try:
            rows = self.decoder.step(batch)
        except Exception as e:  # the model's own failure ends every running sequence with it
            for seq in batch:
                self._finish(seq, f"error: {type(e).__name__}: {e}")
            return
        for seq, logits in zip(batch, rows, strict=True):
            self._next_token(seq, logits)
        if self.on_step is not None:
            self.on_step(StepStats(len(batch), len(batch), time.perf_counter() - started))

    def _admit(self, seq: Job) -> None:
        if seq.cancelled:
            return self._finish(seq, "cancelled")
        if seq.sampling.max_tokens == 0:
            return self._finish(seq, "length")
        started = time.perf_counter()
        try:
            logits = self.decoder.prefill(seq)
        except Exception as e:  # e.g. a prompt longer than the model takes
            return self._finish(seq, f"error: {type(e).__name__}: {e}")
        self.running.append(seq)
        self._next_token(seq, logits)
        if self.on_step is not None:
            self.on_step(StepStats(0, 1, time.perf_counter() - started))

    def _next_token(self, seq: Job, logits: torch.Tensor) -> None:
        token = pick(logits, seq)
        seq.ids.append(token)
        seq.new_tokens += 1
        _send(seq, ("token", token))
        if token in self.eos:
            self._finish(seq, "eos")
        elif seq.new_tokens >= seq.sampling.max_tokens:
            self._finish(seq, "length")

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.running if s.cancelled]:
            self._finish(seq, "cancelled")

    def _finish(self, seq: Job, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.decoder.release(seq)
        _send(seq, ("done", reason))


def _send(seq: Job, event: tuple[str, Any]) -> None:
    """Hand an event to the caller; a caller that can no longer take it (its event loop closed) is cancelled."""
    try:
        seq.emit(event)
    except Exception:  # the caller's own failure must not stop the engine
        seq.cancelled = True


def _drain(q: queue.Queue[Job]) -> list[Job]:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def hf_decoder(model: nn.Module, slots: int) -> Any:
    """A packed Llama-family model's HFLlamaDecoder where its cache fits SERVE_CACHE_BYTES, else HFDecoder."""
    from modelkit.pipeline.hf_llama_decoder import llama_decoder, unsupported

    cfg = model.config
    window = min(getattr(cfg, "max_position_embeddings", None) or SERVE_WINDOW, SERVE_WINDOW)
    if unsupported(model, window) is None:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        cache = 2 * 4 * cfg.num_hidden_layers * slots * cfg.num_key_value_heads * window * head_dim
        decoder = llama_decoder(model, slots, window) if cache <= SERVE_CACHE_BYTES else None
        if decoder is not None:
            return decoder
    return HFDecoder(model)


class TextModel:
    """A language model as the OpenAI routes see it: tokenizer, chat template, end tokens, engine.

    Args:
        name: The name clients use.
        model: tinylm or a transformers causal LM.
        tokenizer: transformers' tokenizer (None for tinylm: bytes are its tokens).
        eos: The ids that end generation.
        max_batch, max_queue, on_step: the engine's (TextEngine).
    """

    def __init__(self, name: str, model: nn.Module, tokenizer: Any, *, eos: Sequence[int] = (), max_batch: int = 32,
                 max_queue: int = 256, on_step: Callable[[StepStats], None] | None = None) -> None:
        self.name, self.tokenizer = name, tokenizer
        decoder = hf_decoder(model, max_batch) if tokenizer is not None else TinyLMDecoder(model, slots=max_batch)
        self.engine = TextEngine(name, decoder, eos=eos, max_batch=max_batch, max_queue=max_queue, on_step=on_step)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, prompt: str) -> list[int]:
        """As `modelkit generate` reads a prompt: tinylm's bytes (an empty prompt is one newline), else the
        tokenizer's ids with its special tokens."""
        if self.tokenizer is None:
            return list(prompt.encode("utf-8")) or [ord("\n")]
        from modelkit.pipeline.generate import prompt_ids

        ids = prompt_ids(self.tokenizer, prompt, source=self.name)
        if not ids:
            raise RequestError("the prompt is empty and the tokenizer adds no BOS token")
        return ids

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The messages rendered by the model's chat template, with the assistant's turn opened."""
        if not self.has_chat_template:
            raise RequestError(f"model {self.name!r} has no chat template; use /v1/completions with a prompt")
        from modelkit.pipeline.generate import chat_ids

        return chat_ids(self.tokenizer, messages)

    def decode(self, ids: Sequence[int]) -> str:
        """New tokens as text, as `modelkit generate` prints them."""
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def check_window(model: TextModel, ids: Sequence[int]) -> None:
    """Refuse a prompt longer than a Hugging Face model's positions (tinylm crops, as generate does)."""
    limit = getattr(getattr(model.engine.decoder.model, "config", None), "max_position_embeddings", None)
    if model.tokenizer is not None and isinstance(limit, int) and len(ids) > limit:
        raise RequestError(f"the prompt is {len(ids)} tokens; model {model.name!r} takes at most {limit}")


def finish_reason(reason: str) -> str:
    """The OpenAI finish_reason of an engine's "done" reason."""
    return "length" if reason == "length" else "stop"


def stop_at(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string begins in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` could begin a stop string (held back from a stream)."""
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                keep = max(keep, n)
                break
    return keep

