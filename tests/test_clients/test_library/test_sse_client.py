"""Triton's generate_stream events -> Chunks (clients/library/sse_client.py), without a server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest
from aiohttp import web

from clients.library.chunk import GenerationError
from clients.library.request import GenerateRequest
from clients.library.sse_client import (
    event_chunk,
    generate,
    generate_stream_url,
    parse_sse_line,
    refusal_message,
    request_body,
)
from streaming_backend import wire
from streaming_backend.sampling import request_keys
from streaming_backend.wire import ServerTiming

TIMING = ServerTiming(1, 2, 3, 4, 5)


def test_sse_lines():
    """Only `data:` lines carry events; blank lines and comments are skipped."""
    assert parse_sse_line(b'data: {"text_output": "a"}\n') == {"text_output": "a"}
    assert parse_sse_line(b"\n") is None and parse_sse_line(b": keep-alive\n") is None
    assert parse_sse_line(b"data:\n") is None


def test_event_with_every_output_becomes_a_chunk():
    """Each output maps onto the Chunk; one-element outputs come as scalars or lists."""
    event = {
        wire.TEXT_OUTPUT: "好🙂",
        wire.NUM_OUTPUT_TOKENS: 2,
        wire.NUM_INPUT_TOKENS: [7],
        wire.OUTPUT_IDS: [11, 12],
        wire.FINISH_REASON: "length",
        wire.TIMING: TIMING.to_json(),
        wire.SYSTEM_FINGERPRINT: "fp_0123456789ab",
    }
    c = event_chunk(event, received_ns=42, request_id="r")
    assert (c.text, c.num_output_tokens, c.num_input_tokens, c.output_ids) == (
        "好🙂",
        2,
        7,
        (11, 12),
    )
    assert c.finish_reason == "length" and c.final and c.received_ns == 42
    assert c.timing == TIMING and c.tokens == 2
    assert c.system_fingerprint == "fp_0123456789ab"


def test_event_without_outputs_is_an_empty_chunk():
    """Outputs the request did not ask for are None; without a count, text is one token."""
    c = event_chunk({wire.TEXT_OUTPUT: "a"}, 1)
    assert c.num_output_tokens is None and c.timing is None and not c.final
    assert c.system_fingerprint is None
    assert c.tokens == 1 and event_chunk({}, 1).tokens == 0
    assert event_chunk({wire.OUTPUT_IDS: 9}, 1).output_ids == (9,)


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("invalid request: top_p must be in (0, 1]", "invalid_request"),
        ("overloaded: queue is full", "overloaded"),
        ("something else", "internal"),
    ],
)
def test_error_event_raises_with_the_servers_category(message, code):
    """An error event raises GenerationError carrying the server's message and its category."""
    with pytest.raises(GenerationError) as info:
        event_chunk({"error": message}, 1)
    assert (info.value.message, info.value.code) == (message, code)


def test_request_body_uses_the_wire_names():
    """The JSON body holds the same inputs as the gRPC tensors, by wire name."""
    body = request_body(GenerateRequest(prompt="hi", sampling={request_keys.MAX_TOKENS: 4}))
    assert body[wire.TEXT_INPUT] == "hi" and body[wire.STREAM] is True
    assert json.loads(body[wire.SAMPLING_PARAMETERS]) == {request_keys.MAX_TOKENS: 4}
    assert set(body) <= set(wire.INPUT_NAMES)
    ids = request_body(GenerateRequest(input_ids=(1, 2)))
    assert ids[wire.INPUT_IDS] == [1, 2] and json.dumps(ids)


def test_endpoint():
    assert (
        generate_stream_url("http://h:8000/", "chat")
        == "http://h:8000/v2/models/chat/generate_stream"
    )


# ---- a server that stops sending -------------------------------------------------------------


@contextlib.asynccontextmanager
async def stalling_server(events_before_stall: int, headers: bool = True):
    """A real local HTTP server whose generate_stream sends `events_before_stall` events (and
    its headers, unless `headers` is False), then nothing more, keeping the connection open."""
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        if not headers:
            await release.wait()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(events_before_stall):
            event = {wire.TEXT_OUTPUT: f"t{i}", wire.NUM_OUTPUT_TOKENS: 1}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await release.wait()  # the stall: the connection stays open, silent
        return response

    app = web.Application()
    app.router.add_post("/v2/models/chat/generate_stream", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield generate_stream_url(f"http://127.0.0.1:{port}")
    finally:
        release.set()
        await runner.cleanup()


@pytest.mark.parametrize(("events", "headers"), [(2, True), (0, True), (0, False)])
async def test_a_stream_that_goes_silent_fails_after_the_idle_timeout(events, headers):
    """Mid-stream (after 2 events), after the headers only, or before any headers: once nothing
    arrives for idle_timeout_s the generation raises `unavailable` with a clear message, not
    retryable by failover, instead of waiting forever."""
    got = []
    async with stalling_server(events, headers) as url, aiohttp.ClientSession() as session:
        started = time.monotonic()
        with pytest.raises(GenerationError) as failed:
            async for chunk in generate(session, url, GenerateRequest(prompt="hi"), "r", 0.5):
                got.append(chunk.text)
        took = time.monotonic() - started
    assert got == [f"t{i}" for i in range(events)]
    assert failed.value.code == wire.UNAVAILABLE.code
    assert "no response from the server for 0.5 s" in failed.value.message
    assert not failed.value.retryable
    assert 0.5 <= took < 5.0


@pytest.mark.parametrize(
    "body, message",
    [
        (b'data: {"error":"invalid request: sampling_parameters.x is bad"}\n\n',
         "invalid request: sampling_parameters.x is bad"),
        (b'{"error": "invalid request: bad"}', "invalid request: bad"),
        (b"<html>oops</html>", "HTTP 400: <html>oops</html>"),
        (b"data: [1]", 'HTTP 400: data: [1]'),
    ],
)  # fmt: skip
def test_a_refused_requests_message(body, message):
    """A refusal's body gives the model's own message, whether Triton wrote it as JSON or as
    generate_stream's one SSE event; anything else is kept with the HTTP status."""
    assert refusal_message(400, body) == message
