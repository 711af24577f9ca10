"""An OpenAI-compatible streaming API (the bridge's /v1) -> Chunks.

A chat (messages) goes to /v1/chat/completions, plain text to /v1/completions, both with
`stream: true` and `stream_options.include_usage`. Each event with text becomes a Chunk of one
token (the API sends one event per model response); the closing usage event becomes the final
Chunk, carrying the prompt's token count and whatever the model counted beyond the events, so a
request's output tokens are the model's own count, as on the other transports. A stream that
receives nothing for `idle_timeout_s` fails with `unavailable`, as on the other transports.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping

from clients.library.chunk import (
    DEFAULT_IDLE_TIMEOUT_S,
    Chunk,
    GenerationError,
    within_idle_timeout,
)
from clients.library.request import GenerateRequest
from streaming_backend.wire import CHAT_MODEL, ERROR_CODES, error_code

API_PATH = "/v1"
DONE = b"[DONE]"


def endpoint_url(base_url: str, request: GenerateRequest) -> str:
    """The endpoint of a request: chat completions for messages, completions for a prompt."""
    path = "chat/completions" if request.messages is not None else "completions"
    return f"{base_url.rstrip('/')}{API_PATH}/{path}"


def request_body(request: GenerateRequest, model: str = CHAT_MODEL) -> dict:
    """The JSON body: the prompt, its sampling keys under the same names, streamed with usage."""
    if request.input_ids is not None:
        raise ValueError("token-id prompts go to /v1/completions as a list; not used here")
    if request.messages is not None:
        prompt = {"messages": list(request.messages)}
    else:
        prompt = {"prompt": request.prompt}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    return {"model": model, **prompt, **dict(request.sampling), **stream}


def event_chunk(event: Mapping, tokens_so_far: int, received_ns: int) -> Chunk | None:
    """A Chunk from one event; None for one without text or usage; an error raises.

    Usage normally rides on a last event of its own (no choices); some servers (transformers
    serve) put it on the event with the finish reason instead. Either way the model's count
    wins over one token per event with text: tokens that decode to no text yet (part of a
    character) send no event of their own."""
    if "error" in event:
        raise _error(event["error"], None)
    request_id = str(event.get("id", ""))
    usage = event.get("usage") or {}
    counted = int(usage.get("completion_tokens", tokens_so_far))
    choices = event.get("choices") or []
    if choices:
        choice = choices[0]
        text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        reason = choice.get("finish_reason")
        if not text and reason is None and not usage:
            return None  # e.g. the role event that opens a chat stream
        tokens = max(counted - tokens_so_far, 1 if text else 0)
        if reason is None:
            return Chunk.delta(text, tokens, received_ns, request_id=request_id)
        return Chunk.delta(
            text, tokens, received_ns, request_id=request_id, finish_reason=reason,
            num_input_tokens=usage.get("prompt_tokens"), final=bool(usage),
        )  # fmt: skip
    if not usage:
        return None
    rest = max(counted - tokens_so_far, 0)
    prompt_tokens = usage.get("prompt_tokens")
    # the usage event is the last one: request latency ends here
    return Chunk.last(rest, received_ns, prompt_tokens=prompt_tokens, request_id=request_id)


def _error(error: object, status: int | None) -> GenerationError:
    """A GenerationError from OpenAI's error object (the bridge's code is a wire category)."""
    if not isinstance(error, Mapping):
        return GenerationError(str(error), error_code(str(error)))
    message, code = str(error.get("message", "")), error.get("code")
    if code not in ERROR_CODES:
        code = error_code(message, "UNAVAILABLE" if status in (429, 503) else None)
    return GenerationError(message, code)


async def generate(
    session,
    base_url: str,
    request: GenerateRequest,
    model: str = CHAT_MODEL,
    api_key=None,
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
) -> AsyncIterator[Chunk]:
    """POST one streamed request on an aiohttp session; yield a Chunk per event as it arrives;
    GenerationError (`unavailable`) once nothing arrives for `idle_timeout_s` (None: no limit)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    url, body = endpoint_url(base_url, request), request_body(request, model)
    posted = session.post(url, json=body, headers=headers)
    async with await within_idle_timeout(posted, idle_timeout_s) as resp:
        if resp.status != 200:
            text = await resp.text()
            try:
                error = json.loads(text)["error"]
            except (ValueError, KeyError, TypeError):
                error = f"HTTP {resp.status}: {text.strip()}"
            raise _error(error, resp.status)
        tokens = 0
        while line := await within_idle_timeout(resp.content.readline(), idle_timeout_s):
            received_ns = time.monotonic_ns()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == DONE:
                return
            chunk = event_chunk(json.loads(payload), tokens, received_ns)
            if chunk is not None:
                tokens += chunk.tokens
                yield chunk
