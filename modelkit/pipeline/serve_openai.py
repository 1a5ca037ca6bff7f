"""The OpenAI-compatible completion routes of `modelkit serve`: request fields in, responses and SSE chunks out.

Fields read: `model`, `prompt` (a string, or a list of one) or `messages` (chat: `role` and `content`, a string or
text parts), `max_tokens` (chat also `max_completion_tokens`), `temperature` (OpenAI's default 1.0: 0 is greedy,
equal to `modelkit generate`), `top_p`, `seed`, `stop` (a string or up to 4), `stream`,
`stream_options.include_usage`, `n` (1 only). Other fields are ignored, as OpenAI-compatible servers do.
The text is the model's new tokens decoded as `modelkit generate` decodes them, cut before the first stop string.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from modelkit.errors import RequestError
from modelkit.pipeline.serve_text import Sampling, check_window, finish_reason, held_back, stop_at

DEFAULT_MAX_TOKENS = 16            # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256      # chat has no OpenAI default short of the context; this keeps a bound


def _number(document: dict[str, Any], key: str, default: float | None, kind: type = float) -> Any:
    value = document.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise RequestError(f'"{key}" must be {"an integer" if kind is int else "a number"}, got {json.dumps(value)}')
    return kind(value)


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise RequestError('"stop" must be a string or a list of up to 4 strings')
    return [s for s in stops if s]


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError('"messages" must be a non-empty list of {"role", "content"}')
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError('each message needs a "role" and a "content"')
        content = m.get("content")
        if isinstance(content, list):           # text parts
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise RequestError("message content parts must be text parts ({\"type\": \"text\", \"text\": ...})")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError('each message needs a "content" string')
        out.append({"role": m["role"], "content": content})
    return out


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise RequestError('"prompt" must be a string (or a list of one string)')
    return value


class TextAssembler:
    """Token ids in, text out: the full text so far (cut before a stop string) and the part safe to stream
    (nothing that might still become a stop string or a multi-byte character)."""

    def __init__(self, model: Any, stops: list[str]) -> None:
        self.model, self.stops = model, stops
        self.tokens: list[int] = []
        self.text, self.sent = "", ""
        self.stopped = False

    def add(self, token: int) -> str:
        """Take one token; the new text safe to send."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        self.text = self.model.decode(self.tokens)
        cut = stop_at(self.text, self.stops)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._delta(self.text)
        safe = self.text[:len(self.text) - held_back(self.text, self.stops)].rstrip("\ufffd")
        return self._delta(safe)

    def finish(self) -> str:
        return self._delta(self.text)

    def _delta(self, safe: str) -> str:
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta


async def complete(state: Any, document: dict[str, Any], *, chat: bool, request: Any) -> Any:
    """Answer one /v1/completions or /v1/chat/completions request."""
    from starlette.responses import JSONResponse, StreamingResponse

    model = state.text_model(document.get("model"), request)
    request_id = request.scope.get("modelkit.request_id", "")
    if _number(document, "n", 1, int) != 1:
        raise RequestError('"n" must be 1 (one choice per request)')
    if chat:
        ids = model.chat_ids(_messages(document.get("messages")))
        limit = document.get("max_completion_tokens", document.get("max_tokens"))
        max_tokens = _number({"max_tokens": limit}, "max_tokens", DEFAULT_CHAT_MAX_TOKENS, int)
    else:
        ids = model.prompt_ids(_prompt(document.get("prompt")))
        max_tokens = _number(document, "max_tokens", DEFAULT_MAX_TOKENS, int)
    check_window(model, ids)
    sampling = Sampling(max_tokens, _number(document, "temperature", 1.0), _number(document, "top_p", 1.0),
                        _number(document, "seed", None, int))
    stops = _stops(document.get("stop"))
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError('"stream" must be true or false')
    options = document.get("stream_options") or {}
    include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False

    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    job = model.engine.submit(ids, sampling, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
    text = TextAssembler(model, stops)
    kind = "chat.completion" if chat else "text_completion"
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", "created": int(time.time()), "model": model.name}

    def usage() -> dict[str, int]:
        return {"prompt_tokens": len(ids), "completion_tokens": len(text.tokens),
                "total_tokens": len(ids) + len(text.tokens)}

    async def run() -> AsyncIterator[tuple[str, str | None]]:
        """(new text, finish_reason or None) as tokens arrive; the last item carries the finish reason."""
        try:
            while True:
                kind_, value = await events.get()
                if kind_ == "token":
                    delta = text.add(value)
                    if text.stopped:
                        job.cancelled = True
                    if delta:
                        yield delta, None
                    continue
                if value.startswith("error"):
                    raise RequestError(f"the model failed: {value.removeprefix('error: ')}", 500)
                yield text.finish(), "stop" if text.stopped else finish_reason(value)
                return
        finally:
            job.cancelled = True          # a client that went away, or an early stop: the engine drops it

    if not stream:
        reason = "stop"
        async for _, done in run():
            reason = done or reason
        choice = ({"index": 0, "message": {"role": "assistant", "content": text.text}, "logprobs": None,
                   "finish_reason": reason} if chat else
                  {"index": 0, "text": text.text, "logprobs": None, "finish_reason": reason})
        return JSONResponse({**base, "object": kind, "choices": [choice], "usage": usage()})

    def chunk(delta: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            body: dict[str, Any] = ({"role": "assistant", "content": ""} if first else
                                    {} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": body, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        return _sse({**base, "object": kind + (".chunk" if chat else ""), "choices": [choice]})

    async def events_stream() -> AsyncIterator[str]:
        if chat:
            yield chunk(None, None, first=True)
        try:
            async for delta, reason in run():
                if delta:
                    yield chunk(delta, None)
                if reason is not None:
                    yield chunk(None, reason)
        except RequestError as e:           # the headers are sent: the error travels as an event
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": e.status}})
        if include_usage:
            yield _sse({**base, "object": kind + (".chunk" if chat else ""), "choices": [], "usage": usage()})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events_stream(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})


def _sse(document: dict[str, Any]) -> str:
    return f"data: {json.dumps(document, ensure_ascii=False)}\n\n"
