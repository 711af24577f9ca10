"""Tests of clients/openai_client.py: OpenAI events -> Chunks, request bodies (no server)."""

from __future__ import annotations

import pytest

from clients.chunk import GenerationError
from clients.openai_client import endpoint_url, event_chunk, request_body
from clients.request import GenerateRequest


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
