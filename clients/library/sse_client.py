"""Triton's HTTP generate_stream endpoint (server-sent events) -> Chunks.

POST /v2/models/<model>/generate_stream takes the model's inputs as one JSON object (tensor name
-> value) and answers with one `data: {...}` event per response, each a JSON object of the
response's outputs (tensor name -> value; one-element outputs come as scalars), or
`data: {"error": "..."}`. The events carry no FINAL flag: the stream ending marks the end, and
the response holding a finish reason is the last one. genai-perf's profile export holds each
response's outputs in the same form, so `event_chunk` reads those too.

A stream that receives nothing (no headers, no line) for `idle_timeout_s` fails with the same
`unavailable` error as the gRPC client's (chunk.py's `idle_error`), not retried by failover.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping

from clients.library.chunk import (
    DEFAULT_IDLE_TIMEOUT_S,
    Chunk,
    GenerationError,
    parse_logprobs,
    parse_timing,
    within_idle_timeout,
)
from clients.library.request import GenerateRequest, request_inputs
from streaming_backend.wire import (
    CHAT_MODEL,
    FINISH_REASON,
    LOGPROBS,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    OUTPUT_IDS,
    SYSTEM_FINGERPRINT,
    TEXT_OUTPUT,
    TIMING,
    error_code,
)

ERROR_FIELD = "error"  # Triton's key of an error event


def generate_stream_url(base_url: str, model: str = CHAT_MODEL) -> str:
    """The generate_stream endpoint of `model` under an HTTP base URL."""
    return f"{base_url.rstrip('/')}/v2/models/{model}/generate_stream"


def request_body(request: GenerateRequest) -> dict:
    """The JSON body of one generate_stream request."""
    return {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in request_inputs(request).items()
    }


def parse_sse_line(line: bytes) -> dict | None:
    """The JSON object of an SSE `data:` line; None for other lines (blank, comments, ids)."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    return json.loads(payload) if payload else None


def refusal_message(status: int, body: bytes) -> str:
    """The model's message in a refused request's body: Triton answers {"error": "..."}, as
    JSON or, from generate_stream, as one SSE event (`data: {"error": ...}`); else the body."""
    text = body.strip()
    try:
        event = parse_sse_line(text) if text.startswith(b"data:") else json.loads(text)
        return str(event[ERROR_FIELD])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body.decode('utf-8', 'replace').strip()}"


def _int(value) -> int | None:
    if isinstance(value, list):  # an output of shape [1] may come as a one-element list
        value = value[0] if value else None
    return None if value is None else int(value)


def _ids(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    return tuple(int(t) for t in value) if isinstance(value, list) else (int(value),)


def event_chunk(event: Mapping, received_ns: int, request_id: str = "") -> Chunk:
    """One Chunk from one event's outputs; an error event raises GenerationError."""
    if ERROR_FIELD in event:
        message = str(event[ERROR_FIELD])
        raise GenerationError(message, error_code(message))
    finish_reason = event.get(FINISH_REASON) or None
    return Chunk(
        text=event.get(TEXT_OUTPUT) or "",
        num_output_tokens=_int(event.get(NUM_OUTPUT_TOKENS)),
        num_input_tokens=_int(event.get(NUM_INPUT_TOKENS)),
        output_ids=_ids(event.get(OUTPUT_IDS)),
        finish_reason=finish_reason,
        timing=parse_timing(event.get(TIMING)),
        final=finish_reason is not None,
        request_id=request_id,
        received_ns=received_ns,
        logprobs=parse_logprobs(event.get(LOGPROBS)),
        system_fingerprint=event.get(SYSTEM_FINGERPRINT) or None,
    )


async def generate(
    session,
    url: str,
    request: GenerateRequest,
    request_id: str = "",
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
) -> AsyncIterator[Chunk]:
    """POST one request on an aiohttp session and yield a Chunk per event as it arrives;
    GenerationError (`unavailable`) once nothing arrives for `idle_timeout_s` (None: no limit)."""
    response = await within_idle_timeout(
        session.post(url, json=request_body(request)), idle_timeout_s
    )
    async with response as resp:
        if resp.status != 200:
            message = refusal_message(resp.status, await resp.read())
            raise GenerationError(message, error_code(message))
        while line := await within_idle_timeout(resp.content.readline(), idle_timeout_s):
            received_ns = time.monotonic_ns()
            event = parse_sse_line(line)
            if event is not None:
                yield event_chunk(event, received_ns, request_id)
