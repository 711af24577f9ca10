"""Tests of clients/bridge.py: protocol values, HTTP side, and the bridge against real servers."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from contextlib import asynccontextmanager

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from clients import bridge as br
from clients.chunk import Chunk

# ---------------------------------------------------------------- protocol values


def _frame(**fields) -> str:
    return json.dumps(fields)


def test_parse_generate_with_messages_and_params():
    """A generate message becomes a request asking for timing, with the params as settings."""
    messages = [{"role": "user", "content": "你好 🙂"}]
    msg = br.parse_message(
        _frame(type="generate", id="a", messages=messages, params={"top_p": "0.9", "stop": ["x"]})
    )
    assert isinstance(msg, br.Generate) and msg.gen_id == "a"
    assert list(msg.request.messages) == messages
    assert msg.request.sampling == {"top_p": "0.9", "stop": ["x"]}
    assert msg.request.return_timing and msg.request.stream


def test_parse_cancel_and_auth():
    """Cancel and auth messages parse into their values."""
    assert br.parse_message(_frame(type="cancel", id="a")) == br.Cancel("a")
    assert br.parse_message(_frame(type="auth", token="t")) == br.Auth("t")


@pytest.mark.parametrize(
    ("raw", "code", "gen_id"),
    [
        (b"\x00\x01", "bad_frame", None),
        ("{not json", "bad_frame", None),
        ("[1, 2]", "bad_frame", None),
        (_frame(type="shout", id="a"), "unknown_type", "a"),
        (_frame(id="a"), "unknown_type", "a"),
        (_frame(type="generate", prompt="hi"), "bad_frame", None),
        (_frame(type="generate", id=7, prompt="hi"), "bad_frame", None),
        (_frame(type="generate", id="x" * 129, prompt="hi"), "bad_frame", None),
        (_frame(type="generate", id="a"), "bad_frame", "a"),
        (_frame(type="generate", id="a", prompt=""), "bad_frame", "a"),
        (_frame(type="generate", id="a", prompt="hi", messages=[]), "bad_frame", "a"),
        (
            _frame(type="generate", id="a", messages=[{"role": "bot", "content": "x"}]),
            "bad_frame",
            "a",
        ),
        (_frame(type="generate", id="a", messages=[{"role": "user"}]), "bad_frame", "a"),
        (_frame(type="generate", id="a", prompt="hi", params=[]), "bad_params", "a"),
        (_frame(type="generate", id="a", prompt="hi", params={"beam": 4}), "bad_params", "a"),
        (_frame(type="generate", id="a", prompt="hi", params={"seed": {}}), "bad_params", "a"),
        (_frame(type="generate", id="a", prompt="hi", params={"stop": [1]}), "bad_params", "a"),
        (_frame(type="cancel"), "bad_frame", None),
        (_frame(type="auth"), "bad_frame", None),
    ],
)
def test_parse_rejects_bad_frames(raw, code, gen_id):
    """Each malformed frame gives a ProtocolError with a code and, where usable, the id."""
    with pytest.raises(br.ProtocolError) as info:
        br.parse_message(raw)
    assert (info.value.code, info.value.gen_id) == (code, gen_id)
    assert info.value.message


def _chunk(text, n, t_ns, timing=None, n_in=None, reason=None, final=False) -> Chunk:
    return Chunk(text, n, n_in, None, reason, timing, final, "r", t_ns)


def test_done_frame_usage_and_timing():
    """done carries usage summed from per-response counts and server/bridge spans in ms."""
    server = {
        "clock": "monotonic",
        "received_ns": 1_000_000,
        "queued_ns": 2_000_000,
        "prefill_start_ns": 3_000_000,
        "emitted_ns": 7_000_000,
        "wall_minus_monotonic_ns": time.time_ns() - time.monotonic_ns(),
    }
    trace = br.Trace(accepted_ns=0, upstream_ns=1_000_000)
    trace.observe(_chunk("a", 1, 9_000_000, timing=server, n_in=5), out_ns=9_500_000)
    trace.observe(_chunk("b", 2, 10_000_000), out_ns=10_500_000)
    frame = br.done_frame("g", "length", trace, now_ns=20_000_000)
    assert frame["type"] == "done" and frame["finish_reason"] == "length"
    assert frame["usage"] == {"prompt_tokens": 5, "completion_tokens": 3}
    s, b = frame["timing"]["server"], frame["timing"]["bridge"]
    assert (s["queue_ms"], s["prefill_ms"], s["first_token_ms"]) == (1.0, 4.0, 6.0)
    assert s["prefill_start_ns"] == 3_000_000  # raw stamps ride along for benchmarks
    assert (b["ttft_ms"], b["upstream_ttft_ms"], b["total_ms"]) == (9.5, 8.0, 20.0)
    assert b["relay_mean_ms"] == 0.5
    assert b["server_to_bridge_ms"] == pytest.approx(2.0, abs=0.5)


@pytest.mark.parametrize(
    ("origin", "host", "origins", "ok"),
    [
        (None, "127.0.0.1:8080", (), True),
        ("http://127.0.0.1:8080", "127.0.0.1:8080", (), True),
        ("http://LOCALHOST:8080", "localhost:8080", (), True),
        ("http://evil.example", "127.0.0.1:8080", (), False),
        ("http://127.0.0.1:9999", "127.0.0.1:8080", (), False),
        ("https://app.example", "127.0.0.1:8080", ("https://app.example",), True),
        ("http://127.0.0.1:8080", "127.0.0.1:8080", ("https://app.example",), False),
        ("http://anything", "127.0.0.1:8080", ("*",), True),
    ],
)
def test_origin_allow_list(origin, host, origins, ok):
    """Same origin by default; an explicit list replaces it; '*' allows any."""
    assert br.origin_allowed(origin, host, origins) is ok


# ---------------------------------------------------------------- a bridge without Triton


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAST = dict(port=0, health_interval_s=0.2, close_timeout_s=1.0)


@asynccontextmanager
async def running_bridge(**overrides):
    """A Bridge on a free port; Triton defaults to an address where nothing listens."""
    cfg = br.BridgeConfig(**{"triton_url": f"127.0.0.1:{free_port()}", **FAST, **overrides})
    async with br.Bridge(cfg) as bridge:
        yield bridge


def ws_url(bridge: br.Bridge, query: str = "") -> str:
    return f"ws://127.0.0.1:{bridge.port}{br.WS_PATH}{query}"


async def http_get(bridge: br.Bridge, path: str, headers=None) -> tuple[int, dict, bytes]:
    """GET from the bridge in a thread (the bridge runs on this test's event loop)."""

    def get():
        request = urllib.request.Request(
            f"http://127.0.0.1:{bridge.port}{path}", headers=headers or {}
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=10) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    return await asyncio.to_thread(get)


async def next_frame(ws, timeout: float = 30.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def test_page_static_files_and_404():
    """/ serves the chat page with a CSP; its scripts and styles load; other paths are 404."""
    async with running_bridge() as bridge:
        status, headers, body = await http_get(bridge, "/")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert (
            b'src="app.js"' in body and "default-src 'self'" in headers["Content-Security-Policy"]
        )
        assert (await http_get(bridge, "/app.js"))[1]["Content-Type"].startswith("text/javascript")
        assert (await http_get(bridge, "/style.css"))[0] == 200
        assert (await http_get(bridge, "/v2/repository/index"))[0] == 404  # no model control
        assert (await http_get(bridge, "/../pyproject.toml"))[0] == 404


async def test_healthz_not_ready_without_triton():
    """/healthz answers 503 and says so while Triton is unreachable."""
    async with running_bridge() as bridge:
        status, _, body = await http_get(bridge, br.HEALTH_PATH)
        assert status == 503 and json.loads(body)["ready"] is False


async def test_foreign_host_header_refused():
    """A loopback bridge refuses Host names other than loopback ones (DNS rebinding)."""
    async with running_bridge() as bridge:
        status, _, _ = await http_get(bridge, "/", headers={"Host": f"evil.example:{bridge.port}"})
        assert status == 403


async def test_origin_rejected():
    """A browser Origin other than the page's own is refused at the handshake."""
    async with running_bridge() as bridge:
        with pytest.raises(InvalidStatus) as info:
            async with connect(ws_url(bridge), origin="http://evil.example"):
                pass
        assert info.value.response.status_code == 403
        async with connect(ws_url(bridge), origin=f"http://127.0.0.1:{bridge.port}") as ws:
            await ws.send(_frame(type="cancel", id="nothing"))  # same origin is welcome


async def test_token_required_when_set():
    """With a token: wrong token 401; none -> must auth first; query, header, message all work."""
    async with running_bridge(token="s3cret", auth_timeout_s=1.0) as bridge:
        with pytest.raises(InvalidStatus) as info:
            async with connect(ws_url(bridge, "?token=wrong")):
                pass
        assert info.value.response.status_code == 401

        async with connect(ws_url(bridge)) as ws:  # no token: the first message must be auth
            await ws.send(_frame(type="generate", id="a", prompt="hi"))
            frame = await next_frame(ws)
            assert frame["code"] == "unauthorized"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 1008

        async with connect(ws_url(bridge)) as ws:  # nothing sent: closed at the auth deadline
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10)
            assert closed.value.rcvd.reason == "authentication timeout"

        for kwargs, first in [
            ({"uri": ws_url(bridge, "?token=s3cret")}, None),
            (
                {"uri": ws_url(bridge), "additional_headers": {"Authorization": "Bearer s3cret"}},
                None,
            ),
            ({"uri": ws_url(bridge)}, _frame(type="auth", token="s3cret")),
        ]:
            async with connect(**kwargs) as ws:
                if first:
                    await ws.send(first)
                await ws.send(_frame(type="generate", id="a", prompt="hi"))
                frame = await next_frame(ws)  # past auth: Triton is down in this test
                assert (frame["id"], frame["code"]) == ("a", "unavailable")


async def test_malformed_frames_get_errors_and_connection_survives():
    """Bad frames each get an error frame addressed as well as possible; the socket stays open."""
    async with running_bridge() as bridge, connect(ws_url(bridge)) as ws:
        await ws.send(b"\x00binary")
        assert (await next_frame(ws))["code"] == "bad_frame"
        await ws.send("{oops")
        assert (await next_frame(ws)) | {"message": ""} == br.error_frame(None, "bad_frame", "")
        await ws.send(_frame(type="dance", id="d1"))
        assert (await next_frame(ws))["id"] == "d1"
        await ws.send(_frame(type="generate", id="p1", prompt="hi", params={"nope": 1}))
        frame = await next_frame(ws)
        assert (frame["id"], frame["code"]) == ("p1", "bad_params") and "allowed" in frame[
            "message"
        ]
        await ws.send(_frame(type="generate", id="t1", prompt="hi"))
        frame = await next_frame(ws)
        assert (frame["id"], frame["code"]) == ("t1", "unavailable")
        assert "not ready" in frame["message"]


async def test_oversized_frame_closes_with_1009():
    """A frame over max_frame_bytes closes the connection with 1009 (message too big)."""
    async with running_bridge(max_frame_bytes=1024) as bridge, connect(ws_url(bridge)) as ws:
        await ws.send(_frame(type="generate", id="a", prompt="x" * 2000))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 1009


async def test_idle_connection_closed():
    """A connection with no messages and no generations is closed after idle_timeout_s."""
    async with running_bridge(idle_timeout_s=0.5) as bridge, connect(ws_url(bridge)) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "idle timeout")


async def test_serve_bridge_stops_on_event():
    """serve_bridge returns once its stop event is set."""
    cfg = br.BridgeConfig(triton_url=f"127.0.0.1:{free_port()}", **{**FAST, "port": free_port()})
    stop = asyncio.Event()
    task = asyncio.create_task(br.serve_bridge(cfg, stop))
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.wait_for(task, 10)


# ---------------------------------------------------------------- against the real tritonserver


def metric(server, name: str) -> float:
    """One of the model's metrics on Triton's metrics port, summed over its label sets."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    values = re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert values, f"the model exports no {name}"
    return sum(float(v) for v in values)


def active_streams(server) -> float:
    """The model's active-streams gauge."""
    return metric(server, "tokenstream_active_streams")


def tokens_generated(server) -> float:
    """The model's output-token counter."""
    return metric(server, "tokenstream_generation_tokens_total")


async def wait_idle_engine(server, timeout: float = 10.0) -> float:
    """Seconds until the active-streams gauge reads 0 (fails after `timeout`)."""
    start = time.monotonic()
    while (value := await asyncio.to_thread(active_streams, server)) != 0:
        assert time.monotonic() - start < timeout, f"active streams stuck at {value}"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def collect(ws, ids: set[str], timeout: float = 120.0) -> dict[str, list[dict]]:
    """Frames by id until every id in `ids` got its done or error."""
    frames: dict[str, list[dict]] = {i: [] for i in ids}
    open_ids = set(ids)
    while open_ids:
        frame = await next_frame(ws, timeout)
        frames[frame["id"]].append(frame)
        if frame["type"] in ("done", "error"):
            open_ids.discard(frame["id"])
    return frames


@asynccontextmanager
async def bridge_to(server, **overrides):
    async with running_bridge(triton_url=server.grpc_url, **overrides) as bridge:
        yield bridge


@pytest.mark.server
async def test_streaming_tokens_then_done(triton_server):
    """Tokens arrive one frame per response with a running count, then one done with usage."""
    async with bridge_to(triton_server) as bridge, connect(ws_url(bridge)) as ws:
        messages = [{"role": "user", "content": "Say hello 👋 in 中文"}]
        params = {"max_tokens": 12, "seed": 3, "ignore_eos": True}
        await ws.send(_frame(type="generate", id="g", messages=messages, params=params))
        frames = (await collect(ws, {"g"}))["g"]
    tokens, done = frames[:-1], frames[-1]
    assert len(tokens) >= 2 and all(f["type"] == "token" for f in tokens)
    assert [f["n"] for f in tokens] == sorted(f["n"] for f in tokens)
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == tokens[-1]["n"] == 12
    assert done["usage"]["prompt_tokens"] > 0
    assert done["timing"]["server"]["first_token_ms"] > 0
    assert done["timing"]["bridge"]["ttft_ms"] >= done["timing"]["server"]["first_token_ms"]
    assert "\ufffd" not in "".join(f["text"] for f in tokens)


@pytest.mark.server
async def test_two_concurrent_generations_on_one_connection(triton_server):
    """Two generations on one socket both stream to the end, each under its own id."""
    async with bridge_to(triton_server) as bridge, connect(ws_url(bridge)) as ws:
        for gen_id in ("a", "b"):
            params = {"max_tokens": 24, "ignore_eos": True, "seed": 1}
            await ws.send(_frame(type="generate", id=gen_id, prompt="Once upon", params=params))
        frames = await collect(ws, {"a", "b"})
    for gen_id in ("a", "b"):
        assert frames[gen_id][-1]["type"] == "done"
        assert frames[gen_id][-1]["usage"]["completion_tokens"] == 24
    # Same seed, same prompt: the same text, whatever the interleaving.
    assert "".join(f.get("text", "") for f in frames["a"]) == "".join(
        f.get("text", "") for f in frames["b"]
    )


@pytest.mark.server
async def test_cancel_message_stops_generation_and_frees_slot(triton_server):
    """cancel ends that generation with done(cancelled); the engine slot frees; others go on."""
    async with bridge_to(triton_server) as bridge, connect(ws_url(bridge)) as ws:
        long = {"max_tokens": 200, "ignore_eos": True}
        await ws.send(_frame(type="generate", id="long", prompt="Tell a story", params=long))
        first = await next_frame(ws)
        assert (first["id"], first["type"]) == ("long", "token")
        await ws.send(_frame(type="cancel", id="long"))
        await ws.send(_frame(type="cancel", id="never-started"))  # ignored
        frames = (await collect(ws, {"long"}))["long"]
        done = frames[-1]
        assert done["type"] == "done" and done["finish_reason"] == "cancelled"
        assert done["usage"]["completion_tokens"] < 200
        await wait_idle_engine(triton_server)
        # The connection and the id are usable again.
        short = {"max_tokens": 4, "ignore_eos": True}
        await ws.send(_frame(type="generate", id="long", prompt="Again", params=short))
        assert (await collect(ws, {"long"}))["long"][-1]["usage"]["completion_tokens"] == 4


@pytest.mark.server
async def test_socket_close_mid_stream_frees_engine_slots(triton_server):
    """Closing the websocket cancels its generations upstream: active streams back to 0."""
    before = tokens_generated(triton_server)
    async with bridge_to(triton_server) as bridge:
        async with connect(ws_url(bridge)) as ws:
            long = {"max_tokens": 220, "ignore_eos": True}
            for gen_id in ("a", "b"):
                await ws.send(_frame(type="generate", id=gen_id, prompt="Story", params=long))
            await next_frame(ws)
            assert await asyncio.to_thread(active_streams, triton_server) >= 1
        freed_in = await wait_idle_engine(triton_server)
        status, _, body = await http_get(bridge, br.HEALTH_PATH)
        assert json.loads(body)["generations"] == 0
    assert freed_in < 5
    assert tokens_generated(triton_server) - before < 2 * 220  # stopped, not run to the end


@pytest.mark.server
async def test_duplicate_id_and_cap(triton_server):
    """A running id cannot be reused; past max_concurrent a generation is refused; others go on."""
    async with bridge_to(triton_server, max_concurrent=2) as bridge, connect(ws_url(bridge)) as ws:
        params = {"max_tokens": 40, "ignore_eos": True}
        await ws.send(_frame(type="generate", id="a", prompt="One", params=params))
        await ws.send(_frame(type="generate", id="a", prompt="Two", params=params))
        await ws.send(_frame(type="generate", id="b", prompt="Three", params=params))
        await ws.send(_frame(type="generate", id="c", prompt="Four", params=params))
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
        await ws.send(_frame(type="generate", id="ok", prompt="Fine", params=ok))
        await ws.send(_frame(type="generate", id="bad", prompt="Hm", params={"top_p": 2}))
        await ws.send(_frame(type="generate", id="neg", prompt="Hm", params={"temperature": -1}))
        frames = await collect(ws, {"ok", "bad", "neg"})
    bad, neg = frames["bad"][-1], frames["neg"][-1]
    assert (bad["type"], bad["code"]) == ("error", "invalid_request") and "top_p" in bad["message"]
    assert neg["code"] == "invalid_request" and "temperature" in neg["message"]
    assert frames["ok"][-1]["type"] == "done"


@pytest.mark.server
async def test_slow_reader_disconnected(triton_server):
    """A client that stops reading is dropped once its queue fills; its streams are cancelled."""
    tight = dict(send_queue=8, socket_send_buffer=4096, send_timeout_s=2.0, max_concurrent=8)
    before = tokens_generated(triton_server)
    async with bridge_to(triton_server, **tight) as bridge:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        sock.connect(("127.0.0.1", bridge.port))
        # max_queue=1: the client library stops reading the socket as soon as a frame waits.
        ws = await connect(ws_url(bridge), sock=sock, max_queue=1)
        try:
            long = {"max_tokens": 240, "ignore_eos": True}
            for i in range(8):
                await ws.send(_frame(type="generate", id=f"g{i}", prompt="Go", params=long))
            deadline = time.monotonic() + 60
            while bridge.connections:
                assert time.monotonic() < deadline, "the slow reader was never disconnected"
                await asyncio.sleep(0.1)
            await wait_idle_engine(triton_server)
            assert tokens_generated(triton_server) - before < 8 * 240  # cancelled, not finished
        finally:
            ws.transport.abort()


async def wait_health(bridge: br.Bridge, ready: bool, timeout: float = 30.0) -> float:
    """Seconds until /healthz says `ready` (fails after `timeout`)."""
    start = time.monotonic()
    while True:
        status, _, body = await http_get(bridge, br.HEALTH_PATH)
        if json.loads(body)["ready"] is ready and (status == 200) is ready:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"/healthz stuck at {status} {body!r}"
        await asyncio.sleep(0.1)


@pytest.mark.server
async def test_triton_restarted_under_the_bridge(tiny_model_dir):
    """Triton dies mid-stream: an error frame, /healthz 503; back on its port: the socket works."""
    from streaming_backend.launcher import ServerConfig, TritonServer, free_port

    config = ServerConfig(
        model=str(tiny_model_dir),
        models=("chat",),  # not the dialogue_model
        dtype="float32",
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )
    first = TritonServer(config, on_log=None).start()
    second = None
    try:
        await asyncio.to_thread(first.wait_ready)
        async with bridge_to(first) as bridge, connect(ws_url(bridge), ping_interval=None) as ws:
            params = {"max_tokens": 220, "ignore_eos": True}
            await ws.send(_frame(type="generate", id="a", prompt="Before", params=params))
            await next_frame(ws)
            os.kill(first.pid, signal.SIGKILL)  # a crash, with "a" still streaming
            end = (await collect(ws, {"a"}, timeout=30))["a"][-1]
            assert (end["type"], end["code"]) == ("error", "unavailable")
            await asyncio.to_thread(first.stop)  # reaps the stub and the shm region
            await wait_health(bridge, ready=False)
            await ws.send(_frame(type="generate", id="b", prompt="During", params=params))
            err = (await collect(ws, {"b"}))["b"][-1]
            assert (err["type"], err["code"]) == ("error", "unavailable")
            assert "not ready" in err["message"]

            second = TritonServer(config, on_log=None).start()
            await asyncio.to_thread(second.wait_ready)
            back_in = await wait_health(bridge, ready=True)
            short = {"max_tokens": 4, "ignore_eos": True}
            await ws.send(_frame(type="generate", id="c", prompt="After", params=short))
            assert (await collect(ws, {"c"}))["c"][-1]["usage"]["completion_tokens"] == 4
        assert back_in < 10
    finally:
        first.stop()
        if second is not None:
            second.stop()


async def test_port_taken_fails_cleanly():
    """A bridge whose port is taken raises OSError and leaves no task running."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = br.BridgeConfig(triton_url=f"127.0.0.1:{free_port()}", port=taken.getsockname()[1])
        before = len(asyncio.all_tasks())
        with pytest.raises(OSError):
            async with br.Bridge(cfg):
                pass
        assert len(asyncio.all_tasks()) == before
