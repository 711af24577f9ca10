"""Tests of clients/library/openai_client.py: OpenAI events -> Chunks, request bodies, the idle
timeout (no Triton)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from clients.library.chunk import GenerationError
from clients.library.openai_client import endpoint_url, event_chunk, generate, request_body
from clients.library.request import GenerateRequest


def test_events_become_chunks_with_the_models_token_count():
    """Role event: nothing; text: one token each; usage: the final chunk with the rest."""
    role = {"id": "c", "choices": [{"delta": {"role": "assistant", "content": ""}}]}
    assert event_chunk(role, 0, 1) is None
    text = event_chunk({"id": "c", "choices": [{"delta": {"content": "Hi"}}]}, 0, 2)
    assert (text.text, text.tokens, text.final, text.received_ns) == ("Hi", 1, False, 2)
    done = event_chunk({"choices": [{"delta": {}, "finish_reason": "length"}]}, 1, 3)
    assert (done.tokens, done.finish_reason, done.final) == (0, "length", False)
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
    last = event_chunk(usage, 1, 4)
    assert (last.tokens, last.num_input_tokens, last.final) == (2, 7, True)
    completion = event_chunk({"choices": [{"text": "abc", "finish_reason": None}]}, 0, 5)
    assert completion.text == "abc"


def test_usage_on_the_finish_event_counts_tokens_that_sent_no_text():
    """transformers serve puts usage on the event with the finish reason: the model's count wins
    (16 tokens, 12 events with text: a character split over tokens sends no event), and that
    event ends the stream."""
    finish = {"choices": [{"delta": {}, "finish_reason": "length"}]}
    finish["usage"] = {"prompt_tokens": 9, "completion_tokens": 16}
    last = event_chunk(finish, 12, 6)
    assert (last.tokens, last.finish_reason, last.final, last.num_input_tokens) == (
        4,
        "length",
        True,
        9,
    )


def test_error_events_raise_with_the_category():
    """An error event (mid-stream) raises GenerationError with the bridge's category."""
    with pytest.raises(GenerationError) as info:
        event_chunk({"error": {"message": "overloaded: full", "code": "overloaded"}}, 0, 1)
    assert info.value.code == "overloaded"
    with pytest.raises(GenerationError) as info:
        event_chunk({"error": {"message": "invalid request: x", "code": None}}, 0, 1)
    assert info.value.code == "invalid_request"


def test_request_bodies_and_endpoints():
    """Messages go to chat completions, text to completions, streamed with usage."""
    chat = GenerateRequest(messages=[{"role": "user", "content": "hi"}], sampling={"seed": 1})
    text = GenerateRequest(prompt="Once", sampling={"max_tokens": 4})
    assert endpoint_url("http://h:8080/", chat) == "http://h:8080/v1/chat/completions"
    assert endpoint_url("http://h:8080", text) == "http://h:8080/v1/completions"
    body = request_body(chat)
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["seed"] == 1
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert request_body(text)["prompt"] == "Once" and request_body(text)["max_tokens"] == 4


async def test_a_stream_that_goes_silent_fails_after_the_idle_timeout():
    """A real local server sends one completion event, then nothing while the connection stays
    open: the generation raises `unavailable` after idle_timeout_s instead of hanging."""
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        event = {"choices": [{"text": "Hi", "finish_reason": None}]}
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await release.wait()  # the stall
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    got = []
    try:
        async with aiohttp.ClientSession() as session:
            started = time.monotonic()
            with pytest.raises(GenerationError) as failed:
                request = GenerateRequest(prompt="hi")
                async for chunk in generate(session, base_url, request, idle_timeout_s=0.5):
                    got.append(chunk.text)
            took = time.monotonic() - started
    finally:
        release.set()
        await runner.cleanup()
    assert got == ["Hi"]
    assert failed.value.code == "unavailable" and not failed.value.retryable
    assert "no response from the server for 0.5 s" in failed.value.message
    assert 0.5 <= took < 5.0
