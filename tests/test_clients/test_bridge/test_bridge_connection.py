"""Tests of clients/bridge/connection.py: one websocket's messages and generations, without
Triton and against a real tritonserver."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import time
import types

import pytest
from bridge_support import (
    active_streams,
    bridge_to,
    collect,
    frame,
    http_get,
    next_frame,
    running_bridge,
    tokens_generated,
    wait_idle_engine,
    ws_url,
)
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from clients.bridge import HEALTH_PATH
from clients.bridge.config import BridgeConfig
from clients.bridge.connection import Connection
from clients.bridge.frames import error_frame

# ---------------------------------------------------------------- without Triton


async def test_malformed_frames_get_errors_and_connection_survives():
    """Bad frames each get an error frame addressed as well as possible; the socket stays open."""
    async with running_bridge() as bridge, connect(ws_url(bridge)) as ws:
        await ws.send(b"\x00binary")
        assert (await next_frame(ws))["code"] == "bad_frame"
        await ws.send("{oops")
        assert (await next_frame(ws)) | {"message": ""} == error_frame(None, "bad_frame", "")
        await ws.send(frame(type="dance", id="d1"))
        assert (await next_frame(ws))["id"] == "d1"
        await ws.send(frame(type="generate", id="p1", prompt="hi", params={"nope": 1}))
        got = await next_frame(ws)
        assert (got["id"], got["code"]) == ("p1", "bad_params") and "allowed" in got["message"]
        await ws.send(frame(type="generate", id="t1", prompt="hi"))
        got = await next_frame(ws)
        assert (got["id"], got["code"]) == ("t1", "unavailable")
        assert "not ready" in got["message"]


async def test_lone_surrogate_frames_get_one_error_each():
    """Frames whose text is not Unicode get invalid_request (id null when the id is the bad
    text), the auth check included, and the connection goes on."""
    async with running_bridge(token="s3cret") as bridge:
        async with connect(ws_url(bridge, "?token=s3cret")) as ws:
            await ws.send(frame(type="generate", id="a", prompt="\ud800"))
            assert await next_frame(ws) | {"message": ""} == error_frame("a", "invalid_request", "")
            await ws.send(frame(type="cancel", id="\udc00"))
            assert (await next_frame(ws))["id"] is None
            await ws.send(frame(type="generate", id="b", prompt="fine"))
            assert (await next_frame(ws))["code"] == "unavailable"  # Triton is down here
        async with connect(ws_url(bridge)) as ws:  # an unauthenticated client is still dropped
            await ws.send(frame(type="auth", token="\ud800"))
            assert (await next_frame(ws))["code"] == "invalid_request"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 1008


async def test_oversized_frame_closes_with_1009():
    """A frame over max_frame_bytes closes the connection with 1009 (message too big)."""
    async with running_bridge(max_frame_bytes=1024) as bridge, connect(ws_url(bridge)) as ws:
        await ws.send(frame(type="generate", id="a", prompt="x" * 2000))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 1009


async def test_idle_connection_closed():
    """A connection with no messages and no generations is closed after idle_timeout_s."""
    async with running_bridge(idle_timeout_s=0.5) as bridge, connect(ws_url(bridge)) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "idle timeout")


class _RecordingSocket:
    """A websocket whose client takes every frame at once (send never waits)."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.transport = types.SimpleNamespace(get_extra_info=lambda name: None)

    async def send(self, text: str) -> None:
        self.sent.append(text)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 bounds each send with wait_for")
async def test_a_burst_of_queued_frames_goes_out_in_one_pass():
    """Frames queued together (24 streams' tokens arriving at once) are all sent in one pass of
    the send loop, not one per trip through the event loop; otherwise 24 producers outrun the one
    sender and a client reading at full speed is dropped as "too slow" (seen in CI)."""
    ws = _RecordingSocket()
    connection = Connection(types.SimpleNamespace(cfg=BridgeConfig()), ws, 1, authed=True)
    for i in range(200):
        connection.post({"type": "token", "id": f"g{i % 24}", "text": "x"})
    sender = asyncio.create_task(connection.send_loop())
    try:
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(ws.sent) == 200
        assert not connection.overflow.is_set()
    finally:
        sender.cancel()


def _silent_websocket(port: int) -> socket.socket:
    """A websocket handshake on a raw socket, after which this client never answers a ping."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"
    )
    assert sock.recv(4096).startswith(b"HTTP/1.1 101")
    return sock


def _until_closed(sock: socket.socket) -> int:
    """Read (pings, a close frame) until the server closes the TCP connection; ping count."""
    pings = 0
    while data := sock.recv(4096):
        pings += data.count(b"\x89\x00")  # an unmasked ping frame with an empty payload
    return pings


async def test_a_client_that_does_not_answer_pings_is_disconnected():
    """Pings every ping_interval_s; a client whose pong does not come within half of it is
    disconnected (a half-open TCP connection is noticed), and only then."""
    async with running_bridge(ping_interval_s=0.6) as bridge:
        sock = await asyncio.to_thread(_silent_websocket, bridge.port)
        started = time.monotonic()
        with sock:
            pings = await asyncio.to_thread(_until_closed, sock)
        took = time.monotonic() - started
        assert pings == 1
        assert 0.85 <= took < 5.0  # the ping after 0.6 s, then 0.3 s for its pong
        await asyncio.wait_for(_no_connections(bridge), 5)


async def test_a_client_that_answers_pings_stays_connected():
    """A client whose library answers each ping keeps its connection over many intervals."""
    async with running_bridge(ping_interval_s=0.2) as bridge:
        async with connect(ws_url(bridge), ping_interval=None) as ws:
            await asyncio.sleep(1.5)  # about seven pings, each answered by the client library
            await ws.send(frame(type="generate", id="g", prompt="hi"))  # no Triton: an error
            assert json.loads(await asyncio.wait_for(ws.recv(), 5))["code"] == "unavailable"


async def _no_connections(bridge) -> None:
    while bridge.connections:
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------- against the real tritonserver


@pytest.mark.server
async def test_streaming_tokens_then_done(triton_server):
    """Tokens arrive one frame per response with a running count, then one done with usage."""
    async with bridge_to(triton_server) as bridge, connect(ws_url(bridge)) as ws:
        messages = [{"role": "user", "content": "Say hello 👋 in 中文"}]
        params = {"max_tokens": 12, "seed": 3, "ignore_eos": True}
        await ws.send(frame(type="generate", id="g", messages=messages, params=params))
        frames = (await collect(ws, {"g"}))["g"]
    tokens, done = frames[:-1], frames[-1]
    assert len(tokens) >= 2 and all(f["type"] == "token" for f in tokens)
    assert [f["n"] for f in tokens] == sorted(f["n"] for f in tokens)
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == tokens[-1]["n"] == 12
    assert done["usage"]["prompt_tokens"] > 0
    assert done["timing"]["server"]["first_token_ms"] > 0
    assert done["timing"]["bridge"]["first_frame_ms"] >= done["timing"]["server"]["first_token_ms"]
    assert "\ufffd" not in "".join(f["text"] for f in tokens)


@pytest.mark.server
async def test_tool_role_reaches_the_model(triton_server):
    """A conversation with a `tool` message (a role of the wire contract) is answered."""
    messages = [
        {"role": "user", "content": "What is the weather?"},
        {"role": "tool", "content": '{"temperature_c": 21}'},
    ]
    async with bridge_to(triton_server) as bridge, connect(ws_url(bridge)) as ws:
        params = {"max_tokens": 3, "ignore_eos": True}
        await ws.send(frame(type="generate", id="t", messages=messages, params=params))
        done = (await collect(ws, {"t"}))["t"][-1]
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 3


@pytest.mark.server
async def test_two_concurrent_generations_on_one_connection(triton_server):
    """Two generations on one socket both stream to the end, each under its own id."""
    async with bridge_to(triton_server) as bridge, connect(ws_url(bridge)) as ws:
        for gen_id in ("a", "b"):
            params = {"max_tokens": 24, "ignore_eos": True, "seed": 1}
            await ws.send(frame(type="generate", id=gen_id, prompt="Once upon", params=params))
        frames = await collect(ws, {"a", "b"})
    for gen_id in ("a", "b"):
        assert frames[gen_id][-1]["type"] == "done"
        assert frames[gen_id][-1]["usage"]["completion_tokens"] == 24
    # Same seed, same prompt: the same text, whatever the interleaving.
    assert "".join(f.get("text", "") for f in frames["a"]) == "".join(
        f.get("text", "") for f in frames["b"]
    )


@pytest.mark.server
async def test_cancel_message_stops_generation_and_frees_slot(paced_server):
    """cancel ends that generation with done(cancelled); the server stops generating it (its
    token counter stays far below max_tokens), the slot frees; the socket and id stay usable."""
    long_tokens = 200  # 4 s at PACED_TOKEN_MS per step; a cancel takes effect within a few steps
    before = tokens_generated(paced_server)
    async with bridge_to(paced_server) as bridge, connect(ws_url(bridge)) as ws:
        long = {"max_tokens": long_tokens, "ignore_eos": True}
        await ws.send(frame(type="generate", id="long", prompt="Tell a story", params=long))
        first = await next_frame(ws)
        assert (first["id"], first["type"]) == ("long", "token")
        await ws.send(frame(type="cancel", id="long"))
        await ws.send(frame(type="cancel", id="never-started"))  # ignored
        frames = (await collect(ws, {"long"}))["long"]
        done = frames[-1]
        assert [f["type"] for f in frames].count("done") == 1
        assert done["type"] == "done" and done["finish_reason"] == "cancelled"
        await wait_idle_engine(paced_server)
        generated = tokens_generated(paced_server) - before
        assert done["usage"]["completion_tokens"] <= generated < long_tokens // 2, generated
        # The connection and the id are usable again.
        short = {"max_tokens": 4, "ignore_eos": True}
        await ws.send(frame(type="generate", id="long", prompt="Again", params=short))
        assert (await collect(ws, {"long"}))["long"][-1]["usage"]["completion_tokens"] == 4


@pytest.mark.server
async def test_socket_close_mid_stream_frees_engine_slots(paced_server):
    """Closing the websocket cancels its generations upstream: active streams back to 0."""
    long_tokens = 200
    before = tokens_generated(paced_server)
    async with bridge_to(paced_server) as bridge:
        async with connect(ws_url(bridge)) as ws:
            long = {"max_tokens": long_tokens, "ignore_eos": True}
            for gen_id in ("a", "b"):
                await ws.send(frame(type="generate", id=gen_id, prompt="Story", params=long))
            await next_frame(ws)
            assert await asyncio.to_thread(active_streams, paced_server) >= 1
        freed_in = await wait_idle_engine(paced_server)
        status, _, body = await http_get(bridge, HEALTH_PATH)
        assert json.loads(body)["generations"] == 0
    assert freed_in < 5
    generated = tokens_generated(paced_server) - before
    assert generated < long_tokens, generated  # stopped, not run to the end (2 x 200)


@pytest.mark.server
async def test_duplicate_id_and_cap(triton_server):
    """A running id cannot be reused; past max_concurrent a generation is refused; others go on."""
    async with bridge_to(triton_server, max_concurrent=2) as bridge, connect(ws_url(bridge)) as ws:
        params = {"max_tokens": 40, "ignore_eos": True}
        await ws.send(frame(type="generate", id="a", prompt="One", params=params))
        await ws.send(frame(type="generate", id="a", prompt="Two", params=params))
        await ws.send(frame(type="generate", id="b", prompt="Three", params=params))
        await ws.send(frame(type="generate", id="c", prompt="Four", params=params))
        frames = await collect(ws, {"a", "b", "c"})
    errors = [f for fs in frames.values() for f in fs if f["type"] == "error"]
    # frames of different ids interleave in any order: compare the set of errors
    assert sorted((e["id"], e["code"]) for e in errors) == [
        ("a", "duplicate_id"),
        ("c", "too_many"),
    ]
    assert frames["a"][-1]["type"] == frames["b"][-1]["type"] == "done"


@pytest.mark.server
async def test_bad_params_get_the_servers_message(triton_server):
    """A value the model refuses comes back as that id's error; a parallel generation completes."""
    async with bridge_to(triton_server) as bridge, connect(ws_url(bridge)) as ws:
        ok = {"max_tokens": 16, "ignore_eos": True}
        await ws.send(frame(type="generate", id="ok", prompt="Fine", params=ok))
        await ws.send(frame(type="generate", id="bad", prompt="Hm", params={"top_p": 2}))
        await ws.send(frame(type="generate", id="neg", prompt="Hm", params={"temperature": -1}))
        frames = await collect(ws, {"ok", "bad", "neg"})
    bad, neg = frames["bad"][-1], frames["neg"][-1]
    assert (bad["type"], bad["code"]) == ("error", "invalid_request") and "top_p" in bad["message"]
    assert neg["code"] == "invalid_request" and "temperature" in neg["message"]
    assert frames["ok"][-1]["type"] == "done"


@pytest.mark.server
async def test_lone_surrogate_in_a_generation_gets_exactly_one_error(triton_server):
    """A generate whose content holds "\\ud800" (valid JSON, not encodable) gets one
    invalid_request error and nothing else; a generation beside it completes."""
    messages = [{"role": "user", "content": "hi \ud800 there"}]
    async with bridge_to(triton_server) as bridge, connect(ws_url(bridge)) as ws:
        await ws.send(frame(type="generate", id="bad", messages=messages))
        await ws.send(frame(type="generate", id="ok", prompt="Fine", params={"max_tokens": 4}))
        frames = await collect(ws, {"bad", "ok"})
        assert frames["bad"] == [frames["bad"][0]] and frames["bad"][0]["type"] == "error"
        assert frames["bad"][0]["code"] == "invalid_request"
        assert "messages[0].content" in frames["bad"][0]["message"]
        assert frames["ok"][-1]["type"] == "done"
        assert bridge.health()["generations"] == 0


@pytest.mark.server
async def test_unexpected_exception_ends_the_generation_with_internal_error(
    triton_server, monkeypatch, caplog
):
    """A bug while relaying (injected into the bridge's own relay step) ends that generation
    with one `internal` error and a log line, cancels it upstream, and spares the others."""
    relay = Connection.relay

    def failing_relay(self, gen_id, chunk, trace):
        if gen_id == "boom":
            raise RuntimeError("injected fault")
        return relay(self, gen_id, chunk, trace)

    monkeypatch.setattr(Connection, "relay", failing_relay)
    params = {"max_tokens": 40, "ignore_eos": True}
    with caplog.at_level(logging.ERROR, logger="tokenstream.bridge"):
        async with bridge_to(triton_server) as bridge, connect(ws_url(bridge)) as ws:
            await ws.send(frame(type="generate", id="boom", prompt="Go", params=params))
            await ws.send(frame(type="generate", id="ok", prompt="Go", params=params))
            frames = await collect(ws, {"boom", "ok"})
            await wait_idle_engine(triton_server)
            assert bridge.health()["generations"] == 0
    assert len(frames["boom"]) == 1
    assert frames["boom"][0] | {"message": ""} == error_frame("boom", "internal", "")
    assert frames["boom"][0]["message"].startswith("internal error: ")
    assert frames["ok"][-1]["type"] == "done"
    assert frames["ok"][-1]["usage"]["completion_tokens"] == 40
    logged = [r for r in caplog.records if r.name == "tokenstream.bridge"]
    assert any("boom" in r.getMessage() and r.exc_info for r in logged)


@pytest.mark.server
async def test_slow_reader_disconnected(paced_server):
    """A client that stops reading is dropped once its queue fills; its streams are cancelled."""
    tight = dict(send_queue=8, socket_send_buffer=4096, send_timeout_s=2.0, max_concurrent=8)
    long_tokens = 200
    before = tokens_generated(paced_server)
    async with bridge_to(paced_server, **tight) as bridge:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        sock.connect(("127.0.0.1", bridge.port))
        # max_queue=1: the client library stops reading the socket as soon as a frame waits.
        ws = await connect(ws_url(bridge), sock=sock, max_queue=1)
        try:
            long = {"max_tokens": long_tokens, "ignore_eos": True}
            for i in range(8):
                await ws.send(frame(type="generate", id=f"g{i}", prompt="Go", params=long))
            deadline = time.monotonic() + 60
            while bridge.connections:
                assert time.monotonic() < deadline, "the slow reader was never disconnected"
                await asyncio.sleep(0.1)
            await wait_idle_engine(paced_server)
            generated = tokens_generated(paced_server) - before
            assert generated < 8 * long_tokens, generated  # cancelled, not finished
        finally:
            ws.transport.abort()
