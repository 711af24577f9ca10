"""Tests of clients/bridge/messages.py: client frames -> message values or ProtocolErrors."""

from __future__ import annotations

import pytest
from bridge_support import frame

from clients.bridge.messages import Auth, Cancel, Generate, ProtocolError, parse_message
from streaming_backend.sampling.request_keys import SAMPLING_KEYS
from streaming_backend.wire import ROLES


def test_parse_generate_with_messages_and_params():
    """A generate message becomes a request asking for timing, with the params as settings."""
    messages = [{"role": "user", "content": "你好 🙂"}]
    msg = parse_message(
        frame(type="generate", id="a", messages=messages, params={"top_p": "0.9", "stop": ["x"]})
    )
    assert isinstance(msg, Generate) and msg.gen_id == "a"
    assert list(msg.request.messages) == messages
    assert msg.request.sampling == {"top_p": "0.9", "stop": ["x"]}
    assert msg.request.return_timing and msg.request.stream


def test_every_role_and_sampling_key_is_accepted():
    """The bridge accepts what the model accepts: each wire role (tool too) and request key."""
    messages = [{"role": role, "content": "x"} for role in ROLES]
    params = {key: ["s"] if key == "stop" else 1 for key in SAMPLING_KEYS}
    msg = parse_message(frame(type="generate", id="a", messages=messages, params=params))
    assert [m["role"] for m in msg.request.messages] == list(ROLES)
    assert set(msg.request.sampling) == set(SAMPLING_KEYS)


def test_parse_cancel_and_auth():
    """Cancel and auth messages parse into their values."""
    assert parse_message(frame(type="cancel", id="a")) == Cancel("a")
    assert parse_message(frame(type="auth", token="t")) == Auth("t")


@pytest.mark.parametrize(
    ("raw", "code", "gen_id"),
    [
        (b"\x00\x01", "bad_frame", None),
        ("{not json", "bad_frame", None),
        ("[1, 2]", "bad_frame", None),
        (frame(type="shout", id="a"), "unknown_type", "a"),
        (frame(id="a"), "unknown_type", "a"),
        (frame(type="generate", prompt="hi"), "bad_frame", None),
        (frame(type="generate", id=7, prompt="hi"), "bad_frame", None),
        (frame(type="generate", id="x" * 129, prompt="hi"), "bad_frame", None),
        (frame(type="generate", id="a"), "bad_frame", "a"),
        (frame(type="generate", id="a", prompt=""), "bad_frame", "a"),
        (frame(type="generate", id="a", prompt="hi", messages=[]), "bad_frame", "a"),
        (
            frame(type="generate", id="a", messages=[{"role": "bot", "content": "x"}]),
            "bad_frame",
            "a",
        ),
        (frame(type="generate", id="a", messages=[{"role": "user"}]), "bad_frame", "a"),
        (frame(type="generate", id="a", prompt="hi", params=[]), "bad_params", "a"),
        (frame(type="generate", id="a", prompt="hi", params={"beam": 4}), "bad_params", "a"),
        (frame(type="generate", id="a", prompt="hi", params={"seed": {}}), "bad_params", "a"),
        (frame(type="generate", id="a", prompt="hi", params={"stop": [1]}), "bad_params", "a"),
        (frame(type="cancel"), "bad_frame", None),
        (frame(type="auth"), "bad_frame", None),
    ],
)
def test_parse_rejects_bad_frames(raw, code, gen_id):
    """Each malformed frame gives a ProtocolError with a code and, where usable, the id."""
    with pytest.raises(ProtocolError) as info:
        parse_message(raw)
    assert (info.value.code, info.value.gen_id) == (code, gen_id)
    assert info.value.message


@pytest.mark.parametrize(
    ("fields", "gen_id", "where"),
    [
        (dict(type="generate", id="a", prompt="hi \ud800"), "a", "prompt"),
        (
            dict(type="generate", id="a", messages=[{"role": "user", "content": "\udfff"}]),
            "a",
            "messages[0].content",
        ),
        (
            dict(type="generate", id="a", prompt="hi", params={"stop": ["ok", "\ud83d"]}),
            "a",
            "stop",
        ),
        (dict(type="generate", id="a\ud800", prompt="hi"), None, "id"),
        (dict(type="cancel", id="\ud800"), None, "id"),
        (dict(type="auth", token="\ud800"), None, "token"),
        ({"type": "generate", "id": "a", "prompt": "hi", "\ud800": 1}, "a", "key"),
    ],
)
def test_lone_surrogates_are_invalid_requests(fields, gen_id, where):
    """Text UTF-8 cannot encode (valid JSON, e.g. "\\ud800") is an invalid_request error."""
    raw = frame(**fields)
    assert "\\ud" in raw.lower()  # the JSON itself is plain ASCII and valid
    with pytest.raises(ProtocolError) as info:
        parse_message(raw)
    assert (info.value.code, info.value.gen_id) == ("invalid_request", gen_id)
    assert info.value.message.startswith("invalid request: ") and where in info.value.message
    info.value.message.encode("utf-8")  # the error itself can be sent
