"""Bench transports' parsing and the runner's scheduling, with fake transports (no server); the
event-stream transports against a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
from aiohttp import web

from clients.bench.prompts import Sampling, load_prompts, synthetic_prompts
from clients.bench.runner import Level, Workload, run_level, warm_up
from clients.bench.summary import RequestRecord
from clients.bench.transports import (
    OpenAITransport,
    Prompt,
    SseTransport,
    bridge_generate,
    generate_request,
)
from clients.bridge.ws_client import BridgeConnection, bridge_request, done_timing, frame_chunk
from clients.library.chunk import Chunk, GenerationError

MS = 1_000_000
TIMING = {
    "clock": "monotonic",
    "received_ns": 10,
    "queued_ns": 20,
    "prefill_start_ns": 30,
    "emitted_ns": 40,
    "wall_minus_monotonic_ns": 7,
}


def test_bench_requests_stream_with_counts_and_timing():
    """The bench asks for a stream, every count and the server timing; chats go as messages."""
    request = generate_request(Prompt(text="hi"), {"max_tokens": 4})
    assert request.prompt == "hi" and request.stream and request.sampling == {"max_tokens": 4}
    assert request.return_timing and request.return_num_output_tokens
    chat = generate_request(Prompt(messages=({"role": "user", "content": "hi"},)), {})
    assert chat.prompt is None and chat.messages[0]["content"] == "hi"


def test_bridge_frames_become_chunks():
    """token frames count tokens through `n`; the done frame ends the request and has timing."""
    a = frame_chunk({"type": "token", "text": "a", "n": 1}, 0, 100 * MS)
    bc = frame_chunk({"type": "token", "text": "bc", "n": 3}, 1, 150 * MS)
    done = {
        "type": "done",
        "finish_reason": "length",
        "usage": {"prompt_tokens": 5, "completion_tokens": 4},
        "timing": {"server": TIMING, "bridge_ms": 0.2},
    }
    last = frame_chunk(done, 3, 160 * MS)
    assert [(c.text, c.tokens, c.final) for c in (a, bc, last)] == [
        ("a", 1, False),
        ("bc", 2, False),
        ("", 1, True),
    ]
    assert last.finish_reason == "length" and last.num_input_tokens == 5
    assert done_timing(done).prefill_start_ns == 30
    assert frame_chunk({"type": "pong"}, 0, 1) is None


def test_bridge_error_and_cancel_codes():
    """An error frame raises with the code in front; a cancel code becomes `cancelled`."""
    with pytest.raises(GenerationError) as info:
        frame_chunk({"type": "error", "code": "bad_params", "message": "x"}, 0, 1)
    assert (info.value.code, info.value.message) == ("bad_params", "bad_params: x")
    with pytest.raises(GenerationError) as info:
        frame_chunk({"type": "error", "code": "cancelled", "message": "stop"}, 0, 1)
    assert info.value.code == "cancelled"


def test_bridge_request_shapes():
    """Chats go as `messages`, text as `prompt`, settings as `params`."""
    m = bridge_request("7", None, ({"role": "user", "content": "hi"},), {"seed": 1})
    assert m == {
        "type": "generate",
        "id": "7",
        "params": {"seed": 1},
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert bridge_request("8", "hi", None, {})["prompt"] == "hi"


class FakeSocket:
    """Enough of a websockets connection: frames pushed by the test, sends recorded."""

    def __init__(self):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.sent: list[dict] = []

    def __aiter__(self):
        return self

    async def __anext__(self):
        frame = await self.inbox.get()
        if frame is None:
            raise StopAsyncIteration
        return frame

    async def send(self, frame: str) -> None:
        self.sent.append(json.loads(frame))

    async def close(self) -> None:
        self.inbox.put_nowait(None)


async def test_bridge_connection_routes_interleaved_generations():
    """Two generations on one socket get their own frames; a closed socket fails the rest."""
    ws = FakeSocket()
    conn = BridgeConnection(ws)
    a, b, c = (RequestRecord(index=i) for i in range(3))
    tasks = [
        asyncio.create_task(bridge_generate(conn, r, Prompt(text="hi"), {})) for r in (a, b, c)
    ]
    while len(ws.sent) < 3:
        await asyncio.sleep(0)
    ida, idb, _ = (m["id"] for m in ws.sent)
    for frame in (
        {"type": "token", "id": idb, "text": "B", "n": 1},
        {"type": "token", "id": ida, "text": "A", "n": 1},
        {"type": "done", "id": ida, "finish_reason": "length", "usage": {"completion_tokens": 1}},
        {"type": "done", "id": idb, "finish_reason": "stop", "usage": {"completion_tokens": 1}},
    ):
        ws.inbox.put_nowait(json.dumps(frame))
    await asyncio.gather(tasks[0], tasks[1])
    assert (a.finish_reason, b.finish_reason) == ("length", "stop")
    assert [ch.text for ch in a.chunks] == ["A", ""] and a.output_tokens() == 1
    assert a.status == b.status == "ok"
    await conn.close()
    await tasks[2]
    assert c.status == "error" and "closed" in c.error


async def test_a_silent_generation_fails_unavailable_and_is_cancelled():
    """A generation that gets no frame within the idle timeout ends `unavailable` (not a hang),
    the bridge is asked to cancel it, and the connection serves the next one."""
    ws = FakeSocket()
    conn = BridgeConnection(ws, idle_timeout_s=0.2)
    silent, next_one = RequestRecord(index=0), RequestRecord(index=1)
    async with asyncio.timeout(10):  # without the idle timeout this would wait forever
        await bridge_generate(conn, silent, Prompt(text="hi"), {})
    assert silent.status == "error" and "no response from the server for 0.2 s" in silent.error
    assert ws.sent[-1] == {"type": "cancel", "id": ws.sent[0]["id"]}
    task = asyncio.create_task(bridge_generate(conn, next_one, Prompt(text="hi"), {}))
    while len(ws.sent) < 3:
        await asyncio.sleep(0)
    done = {"type": "done", "id": ws.sent[2]["id"], "usage": {"completion_tokens": 0}}
    ws.inbox.put_nowait(json.dumps(done))
    await task
    assert next_one.status == "ok"
    await conn.close()


class FakeTransport:
    """Answers every request with 3 tokens; tracks how many requests are in flight."""

    name = "fake"

    def __init__(self, fail: set[int] = frozenset(), hang: set[int] = frozenset()):
        self.fail, self.hang = fail, hang
        self.in_flight = self.max_in_flight = 0
        self.started: list[float] = []
        self.opened: list[int] = []
        self.cancelled: list[int] = []

    async def open(self, slots):
        self.opened.append(slots)

    async def generate(self, rec, prompt, params):
        self.started.append(time.monotonic())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            rec.sent_ns = time.monotonic_ns()
            if rec.index in self.fail:
                raise ConnectionResetError("peer went away")
            if rec.index in self.hang:
                await asyncio.Event().wait()
            for _ in range(3):
                await asyncio.sleep(0.001)
                rec.chunks.append(Chunk.delta("x", 1, time.monotonic_ns()))
        except asyncio.CancelledError:
            self.cancelled.append(rec.index)
            raise
        finally:
            self.in_flight -= 1

    async def close(self):
        pass


def workload(requests: int = 12, **kw) -> Workload:
    return Workload([Prompt(text="hi")], Sampling(output_tokens=3), requests=requests, **kw)


async def test_closed_loop_keeps_exactly_c_in_flight():
    """Concurrency c means at most c requests at once, all requests sent once."""
    t = FakeTransport()
    records = await run_level(t, workload(), Level(concurrency=4), progress=False)
    assert [r.index for r in records] == list(range(12))
    assert t.max_in_flight == 4 and t.opened == [4]
    assert all(r.status == "ok" and r.output_tokens() == 3 for r in records)


async def test_failures_and_timeouts_are_figures_not_crashes():
    """A raising request is an error, a hanging one times out and is cancelled upstream."""
    t = FakeTransport(fail={2}, hang={5})
    wl = workload(8, request_timeout_s=0.2)
    records = await run_level(t, wl, Level(concurrency=2), progress=False)
    by_index = {r.index: r for r in records}
    assert "ConnectionResetError" in by_index[2].error
    assert "no final response within 0.2 s" in by_index[5].error and t.cancelled == [5]
    assert sum(r.status == "ok" for r in records) == 6


async def test_open_loop_follows_the_rate():
    """A constant request rate never starts request i before i / rate (a loaded machine may
    start it later, and then the next one sooner: only the schedule's lower bound is exact)."""
    t = FakeTransport()
    begin = time.monotonic()
    await run_level(t, workload(5), Level(request_rate=100.0), progress=False)
    assert len(t.started) == 5
    early = [begin + i * 0.01 - t.started[i] for i in range(5)]
    assert max(early) <= 0.001, early  # asyncio may wake a timer up to its clock resolution early


async def test_duration_stops_sending():
    """With a duration and no request count, sending stops at the deadline."""
    t = FakeTransport()
    wl = Workload([Prompt(text="hi")], Sampling(), requests=None, duration_s=0.05)
    records = await run_level(t, wl, Level(concurrency=2), progress=False)
    assert 2 <= len(records) and all(r.status == "ok" for r in records)


async def test_warm_up_is_not_measured():
    """Warm-up requests go out but return nothing."""
    t = FakeTransport()
    assert await warm_up(t, workload(), 3, 16) is None
    assert len(t.started) == 3 and t.max_in_flight == 3


def test_sampling_fixed_and_free_lengths():
    """Fixed output length pins min and max tokens and ignores EOS; seeds differ per request."""
    fixed = Sampling(output_tokens=32, temperature=0.7, seed=5)
    assert fixed.params(2) == {
        "max_tokens": 32,
        "min_tokens": 32,
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": 7,
    }
    assert Sampling(max_tokens=64).params(0) == {"max_tokens": 64}


def test_extra_params_are_sent_as_given_over_the_rest():
    """--extra-params keys go into every request as given, and win over the bench's own."""
    ban_eos = {"logit_bias": {"2": -100.0}, "max_tokens": 10}
    assert Sampling(max_tokens=64, extra=ban_eos).params(3) == ban_eos


def test_prompt_files_and_synthetic_prompts(tmp_path):
    """JSONL chats and plain prompts load; synthetic prompts are seeded and sized."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n\n{"prompt": "hello"}\n')
    prompts = load_prompts(f)
    assert prompts[0].messages[0]["content"] == "hi" and prompts[1].text == "hello"
    a, b = synthetic_prompts(16, 3, seed=1), synthetic_prompts(16, 3, seed=1)
    assert a == b and len(a[0].text.split()) == 16


@contextlib.asynccontextmanager
async def http_server(routes: dict[str, web.Response]):
    """A real aiohttp server on a free loopback port answering each path with its response
    (GET and POST alike); yields its base URL."""
    from streaming_backend.launcher import free_port

    async def answer(request: web.Request) -> web.Response:
        return routes[request.path]

    app = web.Application()
    for path in routes:
        app.router.add_route("*", path, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def sse(*events: dict) -> web.Response:
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in events)
    return web.Response(text=body, content_type="text/event-stream")


GENERATE = "/v2/models/chat/generate_stream"
READY = "/v2/models/chat/ready"


async def test_an_event_stream_transport_records_each_event_and_a_stream_without_one():
    """Over one session: the SSE transport checks readiness once, records each event's Chunk
    after stamping sent_ns, and a stream that ends with no event is an error of its own."""
    event = {"text_output": "hi", "num_output_tokens": 1, "finish_reason": "stop"}
    async with http_server({READY: web.Response(), GENERATE: sse(event)}) as url:
        transport = SseTransport(url)
        await transport.open(slots=4)
        rec = RequestRecord(index=3)
        before = time.monotonic_ns()
        await transport.generate(rec, Prompt(text="x"), {})
        assert rec.error is None and [c.text for c in rec.chunks] == ["hi"]
        assert before <= rec.sent_ns <= rec.chunks[0].received_ns
        assert rec.chunks[0].request_id == "3" and rec.chunks[0].final
        await transport.close()
        assert transport.session is None
    async with http_server({READY: web.Response(), GENERATE: sse()}) as url:
        transport = SseTransport(url)
        await transport.open(slots=1)
        rec = RequestRecord(index=0)
        await transport.generate(rec, Prompt(text="x"), {})
        assert rec.error == "event stream ended without a response" and not rec.chunks
        await transport.close()


async def test_each_event_stream_transport_fails_its_check_once_and_clearly():
    """SSE: a model that is not ready; OpenAI: a model the API does not list; each at open."""
    async with http_server({READY: web.Response(status=503)}) as url:
        transport = SseTransport(url)
        with pytest.raises(ConnectionError, match=r"model not ready \(HTTP 503\)"):
            await transport.open(slots=1)
        await transport.close()
    async with http_server({"/v1/models": web.json_response({"data": []})}) as url:
        transport = OpenAITransport(url, model="chat")
        with pytest.raises(ConnectionError, match="HTTP 200, no model 'chat'"):
            await transport.open(slots=1)
        await transport.close()
