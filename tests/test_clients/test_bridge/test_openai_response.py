"""Tests of clients/bridge/openai_response.py: chunks -> OpenAI chunk objects and responses."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from clients.bridge.openai_errors import ApiError
from clients.bridge.openai_request import CHAT, COMPLETION
from clients.bridge.openai_response import (
    Answer,
    finish_chunk,
    models_list,
    role_chunk,
    sse,
    text_chunk,
    usage_chunk,
    whole_response,
)
from clients.library.chunk import Chunk


def chunk(text="", n=None, prompt=None, finish=None) -> Chunk:
    return Chunk(
        text=text,
        num_output_tokens=n,
        num_input_tokens=prompt,
        output_ids=None,
        finish_reason=finish,
        timing=None,
        final=finish is not None,
        request_id="r",
        received_ns=0,
    )


def test_chat_stream_chunks():
    """Role first, one delta per text, an empty delta with the finish reason, then usage."""
    answer = Answer(CHAT, "chat", include_usage=True)
    first = role_chunk(answer)
    assert first["object"] == "chat.completion.chunk" and first["id"].startswith("chatcmpl-")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None
    texts = [
        answer.add(c) for c in (chunk("Hel", 1, 9), chunk("", 1), chunk("lo", 1, None, "length"))
    ]
    assert texts == ["Hel", "", "lo"]
    assert text_chunk(answer, "lo")["choices"][0]["delta"] == {"content": "lo"}
    end = finish_chunk(answer)
    assert end["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    usage = usage_chunk(answer)
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    assert len({first["id"], end["id"], usage["id"]}) == 1


def test_whole_responses():
    """Non-streamed: the whole text, the finish reason, the model's token counts."""
    answer = Answer(CHAT, "chat")
    for c in (chunk("a", 1, 4), chunk("b", 1, None, "stop")):
        answer.add(c)
    body = whole_response(answer)
    assert body["object"] == "chat.completion" and "usage" in body
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert body["usage"]["completion_tokens"] == 2 and body["choices"][0]["finish_reason"] == "stop"
    text = Answer(COMPLETION, "chat")
    text.add(chunk("xyz", 3, 2, "length"))
    assert role_chunk(text) is None
    assert text_chunk(text, "x")["choices"][0]["text"] == "x"
    assert whole_response(text)["choices"][0]["text"] == "xyz"
    assert whole_response(text)["object"] == "text_completion"


@pytest.mark.parametrize("kind", [CHAT, COMPLETION])
def test_every_chunk_and_the_whole_answer_name_the_system_fingerprint(kind):
    """The model's system fingerprint is in every streamed chunk (role, text, finish, usage),
    in the whole response and in each further choice; null while the model named none."""
    answer = Answer(kind, "chat", include_usage=True)
    assert whole_response(answer)["system_fingerprint"] is None
    answer.add(replace(chunk("a", 1, 4), system_fingerprint="fp_0123456789ab"))
    answer.add(chunk("b", 1, None, "stop"))  # a response without it keeps the one known
    other = answer.choice(1)
    payloads = [text_chunk(answer, "a"), finish_chunk(answer), usage_chunk(answer)]
    payloads += [whole_response([answer, other]), text_chunk(other, "c")]
    payloads += [role_chunk(answer)] if kind == CHAT else []
    assert {p["system_fingerprint"] for p in payloads} == {"fp_0123456789ab"}


def test_engine_cancel_is_an_error_not_a_finish():
    """A generation the engine itself cancelled is reported as a 503 error, not a finish."""
    with pytest.raises(ApiError) as info:
        Answer(CHAT, "chat").add(chunk("", 0, None, "cancelled"))
    assert info.value.status == 503


def test_sse_framing_and_models():
    """One event is `data: <json>` and a blank line, UTF-8 as is; /v1/models lists one model."""
    event = sse({"t": "中文 👋"})
    assert event.endswith(b"\n\n") and json.loads(event[6:]) == {"t": "中文 👋"}
    assert models_list("chat", 1)["data"][0]["id"] == "chat"
