"""Continuing a prompt with a causal language model: the API behind `modelkit generate`.

tinylm (the zoo's byte-level Llama) continues byte by byte with its own loop (modelkit.models.tinylm);
a Hugging Face family's model runs transformers' `generate` (KV cache), with the model's own tokenizer
and, on request, its chat template. A Llama-family model (llama, mistral, qwen2, qwen3) whose products are
all packed weights (a GGUF file, an int8/int4 output) decodes instead with a static cache and one C call
per token (pipeline/hf_llama_decoder.py): the prompt through transformers' forward, then the fused step,
with transformers' own temperature/top-k/top-p warpers and sampling. Both report how many tokens were
read and written and how fast.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from modelkit.errors import ConfigError


@dataclass
class Generation:
    """A prompt's continuation and its speed: `prompt_seconds` is the pass over the prompt (prefill, up to
    the first new token's logits), `decode_seconds` the rest; `stopped` is "eos" or "length"."""

    prompt: str
    completion: bytes                  # the continuation: UTF-8 text, or tinylm's raw bytes
    prompt_tokens: int
    new_tokens: int
    prompt_seconds: float
    decode_seconds: float
    stopped: str
    token_ids: list[int]               # the new tokens (tinylm: the bytes)
    chat: bool = False

    @property
    def text(self) -> str:
        return self.completion.decode("utf-8", errors="replace")

    def to_dict(self) -> dict[str, Any]:
        values = {k: v for k, v in asdict(self).items() if k != "completion"}
        return {**values, "completion": self.text,
                "prompt_tokens_per_second": _rate(self.prompt_tokens, self.prompt_seconds),
                "decode_tokens_per_second": _rate(self.new_tokens - 1, self.decode_seconds)}


def _rate(tokens: int, seconds: float) -> float | None:
    return round(tokens / seconds, 2) if tokens > 0 and seconds > 0 else None


@torch.no_grad()
def generate_bytes(model: nn.Module, prompt: str | bytes, *, max_new_tokens: int, temperature: float = 0.0,
                   top_k: int | None = None, seed: int = 0) -> Generation:
    """tinylm: its bytes are its tokens. The same tokens as modelkit.models.tinylm.generate (a full pass
    over the window per byte), computed with serve's key/value cache (tinylm_decoder.TinyLMDecoder): one pass
    over the prompt, then one position per byte; past the model's window, full passes as tinylm's."""
    from modelkit.models.tinylm import next_byte
    from modelkit.pipeline.tinylm_decoder import Stream, TinyLMDecoder

    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    data = prompt.encode("utf-8") if isinstance(prompt, str) else prompt
    generator = torch.Generator(device="cpu").manual_seed(seed)
    seq = Stream(list(data) or [ord("\n")])
    decoder = TinyLMDecoder(model, slots=1)
    started = first = time.perf_counter()
    for i in range(max_new_tokens):
        logits = decoder.step([seq])[0] if i else decoder.prefill(seq)
        seq.ids.append(next_byte(logits, temperature, top_k, generator))
        if not i:
            first = time.perf_counter()
    ended = time.perf_counter()
    out = bytes(seq.ids[len(data) if data else 1:])
    text = prompt if isinstance(prompt, str) else prompt.decode("utf-8", errors="replace")
    return Generation(text, out, len(data), len(out), first - started, ended - first, "length", list(out))


def prompt_ids(tokenizer: Any, prompt: str, *, chat: bool = False, source: str = "the model") -> list[int]:
    """The prompt as token ids: with the tokenizer's own special tokens (BOS where it adds one), or, with
    `chat`, rendered by the model's chat template as one user message followed by the assistant's turn."""
    if not chat:
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{source} has no chat template (tokenizer_config.json chat_template or "
                          "chat_template.jinja); drop --chat to continue the prompt as plain text")
    return chat_ids(tokenizer, [{"role": "user", "content": prompt}])


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Messages ({"role", "content"}) rendered by the tokenizer's chat template with the assistant's turn
    opened, as token ids (the template writes any BOS itself)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class _FirstStep:
    """A logits processor that changes nothing and notes when generation first asks for one (the prompt's
    forward pass is done then)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def eos_ids(tokenizer: Any, model: nn.Module, assets: dict[str, bytes] | None) -> list[int]:
    """The ids that end generation: generation_config.json's, else the tokenizer's and config's EOS."""
    values: list[Any] = []
    if assets and "generation_config.json" in assets:
        try:
            values.append(json.loads(assets["generation_config.json"]).get("eos_token_id"))
        except (json.JSONDecodeError, AttributeError):
            pass
    values += [tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None)]
    ids: list[int] = []
    for v in values:
        for i in (v if isinstance(v, list) else [v]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


@torch.no_grad()
def generate_tokens(model: nn.Module, tokenizer: Any, prompt: str, *, max_new_tokens: int = 64,
                    temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                    chat: bool = False, assets: dict[str, bytes] | None = None,
                    source: str = "the model", fused: bool = True) -> Generation:
    """Continue `prompt` with a transformers causal LM and its tokenizer: greedy when temperature is 0,
    else sampled (top_k, top_p; seeded, without touching the caller's random state); stops at an EOS
    token or after `max_new_tokens`. `assets` (the model's files) supply generation_config.json's EOS ids.
    `fused`: decode a packed Llama-family model with the fused step where it applies (see the module
    docstring); False always runs transformers' generate."""
    import transformers

    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
    ids = prompt_ids(tokenizer, prompt, chat=chat, source=source)
    if not ids:
        raise ConfigError("the prompt is empty and the tokenizer adds no BOS token; give --prompt TEXT")
    device = next(model.parameters()).device
    eos = eos_ids(tokenizer, model, assets)
    sample = temperature > 0
    config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sample, eos_token_id=eos or None,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else None),
        **({"temperature": temperature, "top_k": top_k or 0, "top_p": top_p or 1.0} if sample else {}))
    model.eval()
    decoder = _fused_decoder(model, len(ids) + max_new_tokens) if fused and max_new_tokens else None
    if decoder is not None:
        return _decode_fused(decoder, tokenizer, prompt, ids, eos, config, seed, chat)
    first = _FirstStep()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        started = time.perf_counter()
        out = model.generate(torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), device=device,
                             dtype=torch.long), generation_config=config,
                             logits_processor=transformers.LogitsProcessorList([first]))
        ended = time.perf_counter()
    new = out[0, len(ids):].tolist()
    stopped = "eos" if new and new[-1] in eos else "length"
    text = tokenizer.decode(new, skip_special_tokens=True)
    prefill = (first.at or ended) - started
    return Generation(prompt, text.encode("utf-8"), len(ids), len(new), prefill, ended - started - prefill, stopped,
                      new, chat)


# Generation settings a model's own generation_config could add that the fused loop does not apply.
_PROCESSORS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": None,
               "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
               "forced_bos_token_id": None, "forced_eos_token_id": None, "encoder_repetition_penalty": 1.0}


def _fused_decoder(model: nn.Module, window: int) -> Any:
    """The fused decoder for this model (a static cache of `window` positions), or None."""
    from modelkit.pipeline.hf_llama_decoder import llama_decoder

    own = getattr(model, "generation_config", None)
    if own is not None and any(getattr(own, k, v) not in (v, None) for k, v in _PROCESSORS.items()):
        return None
    return llama_decoder(model, 1, window)


def _decode_fused(decoder: Any, tokenizer: Any, prompt: str, ids: list[int], eos: list[int], config: Any, seed: int,
                  chat: bool) -> Generation:
    """As transformers' generate with `config` (greedy, or its temperature/top-k/top-p warpers and
    multinomial draw, seeded), with the decoder's prefill and fused steps."""
    import transformers

    from modelkit.pipeline.tinylm_decoder import Stream

    warpers = transformers.LogitsProcessorList()
    if config.do_sample:
        if config.temperature != 1.0:
            warpers.append(transformers.TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            warpers.append(transformers.TopKLogitsWarper(config.top_k))
        if config.top_p < 1.0:
            warpers.append(transformers.TopPLogitsWarper(config.top_p))
    seq = Stream(list(ids))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        started = time.perf_counter()
        logits = decoder.prefill(seq)
        first = time.perf_counter()
        while True:
            scores = logits.float()[None]
            if config.do_sample:
                scores = warpers(torch.tensor([seq.ids]), scores)
                token = int(torch.multinomial(scores.softmax(-1), 1))
            else:
                token = int(scores.argmax())
            seq.ids.append(token)
            if token in eos or len(seq.ids) - len(ids) >= config.max_new_tokens:
                break
            logits = decoder.step([seq])[0]
        ended = time.perf_counter()
    new = seq.ids[len(ids):]
    stopped = "eos" if new[-1] in eos else "length"
    text = tokenizer.decode(new, skip_special_tokens=True)
    return Generation(prompt, text.encode("utf-8"), len(ids), len(new), first - started, ended - first, stopped,
                      new, chat)
