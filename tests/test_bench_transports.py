"""Bench transports' parsing and the runner's scheduling, with fake transports (no server)."""

from __future__ import annotations

import asyncio
import json
import time

from clients.bench.metrics import RequestRecord, Response, itl_ns, output_tokens, ttft_ns
from clients.bench.prompts import Sampling, load_prompts, synthetic_prompts
from clients.bench.runner import Level, Workload, run_level, warm_up
from clients.bench.transports import (
    BridgeConnection,
    Prompt,
    bridge_request,
    model_inputs,
    parse_sse_line,
    record_bridge_message,
    record_response,
)

MS = 1_000_000
TIMING = {
    "clock": "monotonic",
    "received_ns": 10,
    "queued_ns": 20,
    "prefill_start_ns": 30,
    "emitted_ns": 40,
    "wall_minus_monotonic_ns": 7,
}


def test_model_inputs_follow_the_interface():
    """Streaming, every return_* flag we need, settings as JSON; chats go as `messages`."""
    inputs = model_inputs(Prompt(text="hi"), {"max_tokens": 4})
    assert inputs["text_input"] == "hi" and inputs["stream"] is True
    assert json.loads(inputs["sampling_parameters"]) == {"max_tokens": 4}
    assert inputs["return_timing"] and inputs["return_num_output_tokens"]
    chat = model_inputs(Prompt(messages=({"role": "user", "content": "hi"},)), {})
    assert "text_input" not in chat and json.loads(chat["messages"])[0]["content"] == "hi"


def test_sse_lines():
    """Only `data:` lines carry events; blank lines and comments are skipped."""
    assert parse_sse_line(b'data: {"text_output": "a"}\n') == {"text_output": "a"}
    assert parse_sse_line(b"\n") is None and parse_sse_line(b": keep-alive\n") is None


def test_record_response_keeps_first_token_timing():
    """Server timing is the first token's (text or not); token counts come from the server."""
    rec = RequestRecord(index=0, sent_ns=0)
    record_response(rec, 4, text="", tokens=0, timing=TIMING | {"emitted_ns": 38})
    record_response(rec, 5, text="", tokens=1, timing=TIMING | {"emitted_ns": 39})
    record_response(rec, 6, text="x", tokens=2, timing=TIMING, input_tokens=9)
    record_response(rec, 7, text="y", tokens=1, timing=TIMING | {"emitted_ns": 99})
    assert rec.server_timing.emitted_ns == 39 and rec.prompt_tokens == 9
    assert output_tokens(rec) == 4 and [r.emitted_ns for r in rec.responses] == [38, 39, 40, 99]
    assert ttft_ns(rec) == 6


def test_bridge_messages_become_a_timeline():
    """token frames count tokens through `n`; the done frame ends the request and has timing."""
    rec = RequestRecord(index=0, sent_ns=0)
    assert not record_bridge_message(rec, 100 * MS, {"type": "token", "text": "a", "n": 1})
    assert not record_bridge_message(rec, 150 * MS, {"type": "token", "text": "bc", "n": 3})
    done = {
        "type": "done",
        "finish_reason": "length",
        "usage": {"prompt_tokens": 5, "completion_tokens": 4},
        "timing": {"server": TIMING, "bridge_ms": 0.2},
    }
    assert record_bridge_message(rec, 160 * MS, done)
    assert output_tokens(rec) == 4 and [r.tokens for r in rec.responses] == [1, 2, 1]
    assert ttft_ns(rec) == 100 * MS and itl_ns(rec) == 20 * MS
    assert rec.server_timing.prefill_start_ns == 30 and rec.prompt_tokens == 5
    assert rec.status == "ok"


def test_bridge_error_and_cancel_codes():
    """An error frame ends the request; a cancel code counts as a cancellation."""
    rec = RequestRecord(index=0)
    assert record_bridge_message(rec, 1, {"type": "error", "code": "bad_params", "message": "x"})
    assert rec.status == "error" and rec.error == "bad_params: x"
    rec = RequestRecord(index=1)
    record_bridge_message(rec, 1, {"type": "error", "code": "cancelled", "message": "stop"})
    assert rec.status == "cancelled"


def test_bridge_request_shapes():
    """Chats go as `messages`, text as `prompt`, settings as `params`."""
    m = bridge_request("7", Prompt(messages=({"role": "user", "content": "hi"},)), {"seed": 1})
    assert m == {
        "type": "generate",
        "id": "7",
        "params": {"seed": 1},
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert bridge_request("8", Prompt(text="hi"), {})["prompt"] == "hi"


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
    tasks = [asyncio.create_task(conn.generate(r, Prompt(text="hi"), {})) for r in (a, b, c)]
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
    await conn.close()
    await tasks[2]
    assert c.status == "error" and "closed" in c.error


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
                rec.responses.append(Response(time.monotonic_ns(), 1, 1))
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
    assert all(r.status == "ok" and output_tokens(r) == 3 for r in records)


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
    """A constant request rate spaces the starts by 1/rate."""
    t = FakeTransport()
    await run_level(t, workload(5), Level(request_rate=100.0), progress=False)
    gaps = [b - a for a, b in zip(t.started, t.started[1:], strict=False)]
    assert len(t.started) == 5 and min(gaps) > 0.008


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


def test_prompt_files_and_synthetic_prompts(tmp_path):
    """JSONL chats and plain prompts load; synthetic prompts are seeded and sized."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n\n{"prompt": "hello"}\n')
    prompts = load_prompts(f)
    assert prompts[0].messages[0]["content"] == "hi" and prompts[1].text == "hello"
    a, b = synthetic_prompts(16, 3, seed=1), synthetic_prompts(16, 3, seed=1)
    assert a == b and len(a[0].text.split()) == 16
