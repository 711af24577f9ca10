"""Tests of clients/bridge/openai_request.py and openai_errors.py: OpenAI bodies -> ApiRequest
or an ApiError, without a server."""

from __future__ import annotations

import pytest

from clients.bridge.openai_errors import ApiError, from_generation_error
from clients.bridge.openai_request import (
    CHAT,
    CHAT_KEYS,
    COMPLETION,
    COMPLETION_KEYS,
    SAMPLING_SAME_NAME,
    parse_chat,
    parse_completion,
)
from streaming_backend.sampling.request_keys import NUMBER, REQUEST_KEYS, ROWS

MODEL = "chat"


def chat(**fields):
    """A chat body with one user message, plus `fields`."""
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def refusal(parse, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, MODEL)
    return info.value


def test_chat_body_becomes_a_generate_request():
    """Messages, sampling keys, benchmark extras and stop reach the model under its own keys."""
    body = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": "ok"},
            {"role": "tool", "content": "{}"},
        ],
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop="END",
        n=1,
        frequency_penalty=0,
        presence_penalty=0.0,
        logprobs=False,
        ignore_eos=True,
        min_tokens=2,
        top_k=5,
        repetition_penalty=1.1,
        user="someone",
    )
    parsed = parse_chat(body, MODEL)
    assert (parsed.kind, parsed.model, parsed.stream, parsed.include_usage) == (
        CHAT,
        MODEL,
        True,
        True,
    )
    assert list(parsed.request.messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "{}"},
    ]
    assert parsed.request.sampling == {
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "top_k": 5,
        "min_tokens": 2,
        "ignore_eos": True,
        "repetition_penalty": 1.1,
        "max_tokens": 7,
        "stop": ["END"],
    }


@pytest.mark.parametrize("row", REQUEST_KEYS, ids=lambda row: row.key)
def test_every_request_key_has_its_openai_name(row):
    """Both endpoints take each request key: by OpenAI's own name where the table gives one,
    else by the key itself."""
    name = row.openai or row.key
    assert name in CHAT_KEYS and name in COMPLETION_KEYS


@pytest.mark.parametrize("key", SAMPLING_SAME_NAME)
def test_keys_of_the_same_name_pass_as_they_are(key):
    """A request key that OpenAI spells the same reaches the model as given (the model checks
    it); a value that is not a scalar is refused here."""
    value = 0.5 if ROWS[key].kind is NUMBER else 1
    completion = {"model": MODEL, "prompt": "Once", key: value}
    assert parse_chat(chat(**{key: value}), MODEL).request.sampling == {key: value}
    assert parse_completion(completion, MODEL).request.sampling == {key: value}
    assert refusal(parse_chat, chat(**{key: [value]})).param == key


def test_defaults_send_no_sampling_and_no_stream():
    """A minimal body streams nothing, asks no usage chunk and leaves the model's defaults."""
    parsed = parse_chat(chat(), MODEL)
    assert (parsed.stream, parsed.include_usage, parsed.request.sampling) == (False, False, {})


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        (chat(model="gpt-4o"), "model", 404),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model", 400),
        (chat(n=0), "n", 400),
        (chat(n=17), "n", 400),
        (chat(logprobs="yes"), "logprobs", 400),
        (chat(top_logprobs=3), "top_logprobs", 400),
        (chat(logprobs=True, top_logprobs=50), "top_logprobs", 400),
        (chat(frequency_penalty=0.5), "frequency_penalty", 400),
        (chat(presence_penalty=1), "presence_penalty", 400),
        (chat(tools=[{"type": "function"}]), "tools[0].function", 400),
        (chat(response_format={"type": "xml"}), "response_format", 400),
        (chat(response_format={"type": "json_schema", "json_schema": {}}), "response_format", 400),
        (chat(tool_choice="required"), "tool_choice", 400),
        (chat(tools=[TOOL], tool_choice="sometimes"), "tool_choice", 400),
        (
            chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
            400,
        ),
        (chat(tools=[TOOL, TOOL]), "tools", 400),
        (chat(tools=[TOOL], parallel_tool_calls="no"), "parallel_tool_calls", 400),
        (
            chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
            "response_format",
            400,
        ),
        (chat(guided_regex="a", response_format={"type": "json_object"}), "guided_regex", 400),
        (chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages[0]", 400),
        (chat(bogus=1), "bogus", 400),
        (chat(stream_options={"include_usage": True}), "stream_options", 400),
        (chat(stop=["a", 1]), "stop", 400),
        (chat(max_tokens=3, max_completion_tokens=4), "max_tokens", 400),
        (chat(messages=[]), "messages", 400),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", 400),
        (chat(messages=[{"role": "user", "content": "x", "age": 3}]), "messages[0].age", 400),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content[0]",
            400,
        ),
        (chat(stream="yes"), "stream", 400),
    ],
)
def test_chat_refusals_name_the_parameter(body, param, status):
    """What cannot be honoured is refused with OpenAI's error object naming the parameter."""
    error = refusal(parse_chat, body)
    assert (error.status, error.param) == (status, param)
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_completion_prompts():
    """A string, a batch of one, or token ids; the same sampling keys as chat."""
    parsed = parse_completion({"model": MODEL, "prompt": "Once", "max_tokens": 4}, MODEL)
    assert (parsed.kind, parsed.request.prompt, parsed.request.sampling) == (
        COMPLETION,
        "Once",
        {"max_tokens": 4},
    )
    assert parse_completion({"model": MODEL, "prompt": ["Once"]}, MODEL).request.prompt == "Once"
    ids = parse_completion({"model": MODEL, "prompt": [1, 2, 3]}, MODEL).request.input_ids
    assert ids == (1, 2, 3)
    for bad in ("", ["a", "b"], [1, "a"], None, 5):
        assert refusal(parse_completion, {"model": MODEL, "prompt": bad}).param == "prompt"
    assert refusal(parse_completion, {"model": MODEL, "prompt": "x", "echo": True}).param == "echo"
    bad_logprobs = {"model": MODEL, "prompt": "x", "logprobs": 21}
    assert refusal(parse_completion, bad_logprobs).param == "logprobs"


@pytest.mark.parametrize(
    ("code", "message", "status", "param", "retry"),
    [
        (
            "invalid_request",
            "invalid request: sampling_parameters.top_p must be in (0, 1], got 2",
            400,
            "top_p",
            None,
        ),
        (
            "invalid_request",
            "invalid request: tools[3].function.parameters is not a valid JSON schema: ...",
            400,
            "tools[3].function.parameters",
            None,
        ),
        ("overloaded", "overloaded: the queue is full", 429, None, "1"),
        ("unavailable", "unavailable: Stream removed", 503, None, "1"),
        ("internal", "internal error: boom", 500, None, None),
        ("something-new", "?", 500, None, None),
    ],
)
def test_generation_errors_map_to_status(code, message, status, param, retry):
    """The engine's error categories map to OpenAI statuses; its message is kept verbatim."""
    error = from_generation_error(code, message)
    assert (error.status, error.param, error.message) == (status, param, message)
    assert error.headers().get("Retry-After") == retry
