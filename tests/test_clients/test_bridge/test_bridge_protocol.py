"""The websocket protocol's vocabulary (clients/bridge/protocol.py): the bridge, the websocket
client and the chat page (clients/bridge/static/*.js) all speak it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from clients.bridge import protocol as p
from clients.bridge import ws_client
from clients.bridge.frames import Trace, done_frame, error_frame, token_frame
from clients.bridge.messages import Auth, Cancel, Generate, parse_message
from streaming_backend.wire import FINISH_REASON, TIMING

STATIC = Path(__file__).resolve().parents[3] / "clients" / "bridge" / "static"
STRING = r"""(?:"([^"\\]*)"|'([^'\\]*)')"""  # a JS string literal without escapes


def page_source() -> str:
    """Every script of the page, comments dropped (they may quote any word)."""
    text = "\n".join(path.read_text(encoding="utf-8") for path in sorted(STATIC.glob("*.js")))
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"(?m)^\s*//.*$|\s//\s.*$", "", text)


def literals(pattern: str, source: str) -> set[str]:
    """The string literal captured by `pattern` (which contains STRING), at every match."""
    return {a or b for a, b in re.findall(pattern, source)}


def sent_objects(source: str) -> list[str]:
    """The bodies of the object literals the page sends: `send(JSON.stringify({ ... }))`."""
    return re.findall(r"\.send\(\s*JSON\.stringify\(\s*\{(.*?)\}\s*\)", source, flags=re.S)


def test_the_page_sends_only_client_messages_with_known_fields():
    """Each message the page sends has a client type and only fields the bridge reads."""
    objects = sent_objects(page_source())
    types = {t for body in objects for t in literals(rf"\btype\s*:\s*{STRING}", body)}
    assert types and types <= set(p.CLIENT_TYPES), types
    fields = {f for body in objects for f in re.findall(r"(?:^|,)\s*(\w+)\s*(?=[:,]|$)", body)}
    assert fields and fields <= set(p.CLIENT_FIELDS), fields


def test_the_page_handles_every_frame_the_bridge_sends():
    """Each type the page compares a frame's type with is a bridge frame type, and every bridge
    frame type is among them (or a key of a handler table). (Other objects' types, such as the
    Markdown renderer's tokens, are not frames.)"""
    source = page_source()
    compared = literals(rf"\b(?:frame|message|msg|data)\.type\s*===?\s*{STRING}", source)
    compared |= literals(rf"\bcase\s+{STRING}\s*:", source)
    keys = set(re.findall(r"\b(\w+)\s*:", source)) | literals(rf"{STRING}\s*:", source)
    assert compared <= set(p.SERVER_TYPES), compared
    assert set(p.SERVER_TYPES) <= compared | keys


def test_the_page_reads_only_fields_the_bridge_sends():
    """Fields read off a frame, its timing.server and an error's code exist in the protocol."""
    source = page_source()
    read = set(re.findall(r"\bframe\.(\w+)", source))
    assert read <= set(p.SERVER_FIELDS), read
    spans = set(re.findall(r"\bserver\.(\w+)", source))
    assert spans <= set(p.SERVER_SPANS), spans
    codes = literals(rf"\.code\s*===?\s*{STRING}", source)
    assert codes <= set(p.ALL_ERROR_CODES), codes


def test_the_page_check_finds_the_words_it_looks_for():
    """The checks above read real JS: a page that sent an unknown type would be caught."""
    source = 'ws.send(JSON.stringify({ type: "shout", id: x, volume: 3 }));'
    (body,) = sent_objects(source)
    assert literals(rf"\btype\s*:\s*{STRING}", body) == {"shout"}
    assert set(re.findall(r"(?:^|,)\s*(\w+)\s*(?=[:,]|$)", body)) == {"type", "id", "volume"}


def test_the_websocket_client_and_the_bridge_agree():
    """What ws_client sends the bridge parses; what the bridge sends ws_client reads."""
    request = ws_client.bridge_request("g", None, [{"role": "user", "content": "hi"}], {})
    assert isinstance(parse_message(json.dumps(request)), Generate)
    assert parse_message('{"type": "cancel", "id": "g"}') == Cancel("g")
    assert parse_message('{"type": "auth", "token": "t"}') == Auth("t")
    chunk = ws_client.frame_chunk(token_frame("g", "hi", 2), 0, 5)
    assert (chunk.text, chunk.tokens, chunk.request_id) == ("hi", 2, "g")
    done = done_frame("g", "stop", Trace(accepted_ns=0), now_ns=1)
    last = ws_client.frame_chunk(done, 2, 6)
    assert last.final and last.finish_reason == "stop"
    with pytest.raises(ws_client.GenerationError, match="nope"):
        ws_client.frame_chunk(error_frame("g", p.BAD_FRAME, "nope"), 0, 7)


def test_frames_use_only_protocol_words():
    """Every key of the frames the bridge builds is a protocol field."""
    done = done_frame("g", "stop", Trace(accepted_ns=0), now_ns=1)
    for frame in (token_frame("g", "x", 1), error_frame(None, p.BAD_FRAME, "m"), done):
        assert set(frame) <= set(p.SERVER_FIELDS) and frame[p.TYPE] in p.SERVER_TYPES
    assert set(done[TIMING]) == {p.SERVER, p.BRIDGE} and FINISH_REASON in done
    assert list(done[TIMING][p.BRIDGE]) == list(p.BRIDGE_SPANS)
