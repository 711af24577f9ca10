"""Tests of clients/bridge/frames.py: outgoing frames and the timing trace."""

from __future__ import annotations

import pytest

from clients.bridge.frames import Trace, done_frame, error_frame, token_frame
from clients.bridge.protocol import BRIDGE_SPANS
from clients.library.chunk import Chunk
from streaming_backend.wire import ServerTiming


def _chunk(text, n, t_ns, timing=None, n_in=None, reason=None, final=False) -> Chunk:
    return Chunk.delta(
        text, n, t_ns, request_id="r", finish_reason=reason, timing=timing, num_input_tokens=n_in
    )


def test_done_frame_usage_and_timing():
    """done carries usage summed from per-response counts and server/bridge spans in ms."""
    server = ServerTiming(
        received_ns=1_000_000,
        queued_ns=2_000_000,
        prefill_start_ns=3_000_000,
        emitted_ns=7_000_000,
        wall_minus_monotonic_ns=ServerTiming.wall_offset_ns(),
    )
    trace = Trace(accepted_ns=0, upstream_ns=1_000_000)
    relayed = [
        (_chunk("", 1, 9_000_000, timing=server, n_in=5), 9_500_000),  # text held back
        (_chunk("b", 2, 10_000_000), 10_500_000),
        (_chunk("c", 1, 11_000_000), 11_500_000),
    ]
    for chunk, out_ns in relayed:
        trace.observe(chunk)
        trace.relayed(chunk, out_ns)
    assert len(trace.head) == 2  # the first response (the first token) and the first text
    frame = done_frame("g", "length", trace, now_ns=20_000_000)
    assert frame["type"] == "done" and frame["finish_reason"] == "length"
    assert frame["usage"] == {"prompt_tokens": 5, "completion_tokens": 4}
    s, b = frame["timing"]["server"], frame["timing"]["bridge"]
    assert (s["queue_ms"], s["prefill_ms"], s["first_token_ms"]) == (1.0, 4.0, 6.0)
    assert s["prefill_start_ns"] == 3_000_000  # raw stamps ride along for benchmarks
    assert (b["first_frame_ms"], b["total_ms"]) == (9.5, 20.0)
    assert (b["upstream_ttft_ms"], b["upstream_time_to_first_text_ms"]) == (8.0, 9.0)
    assert b["relay_mean_ms"] == 0.5
    assert b["server_to_bridge_ms"] == pytest.approx(2.0, abs=0.5)
    assert list(b) == list(BRIDGE_SPANS)


def test_the_upstream_ttft_is_the_first_response_even_without_a_token():
    """A response with neither text nor token (the prompt count alone) starts the TTFT, as in
    clients/library/metrics.py; the server's stamps come from the first response with a token."""
    server = ServerTiming(1, 2, 3, 4)
    trace = Trace(accepted_ns=0, upstream_ns=0)
    for chunk in (_chunk("", 0, 2_000_000, n_in=5), _chunk("a", 1, 3_000_000, timing=server)):
        trace.observe(chunk)
    frame = done_frame("g", "stop", trace, now_ns=4_000_000)
    bridge, server_timing = frame["timing"]["bridge"], frame["timing"]["server"]
    assert bridge["upstream_ttft_ms"] == 2.0 and bridge["upstream_time_to_first_text_ms"] == 3.0
    assert server_timing["emitted_ns"] == 4 and frame["usage"]["prompt_tokens"] == 5


def test_done_frame_without_tokens_or_server_timing():
    """A generation cancelled before its first token still gets a complete done frame."""
    frame = done_frame("g", "cancelled", Trace(accepted_ns=0), now_ns=3_000_000)
    assert frame["usage"] == {"prompt_tokens": None, "completion_tokens": 0}
    assert frame["timing"]["server"] == {
        "queue_ms": None,
        "prefill_ms": None,
        "first_token_ms": None,
    }
    bridge = frame["timing"]["bridge"]
    assert bridge["first_frame_ms"] is None and bridge["upstream_ttft_ms"] is None
    assert bridge["relay_mean_ms"] is None
    assert bridge["total_ms"] == 3.0


def test_token_and_error_frames():
    """Token frames carry the delta and the running count; errors an id (or None) and a code."""
    assert token_frame("g", "hi", 3) == {"type": "token", "id": "g", "text": "hi", "n": 3}
    assert error_frame(None, "bad_frame", "m") == {
        "type": "error",
        "id": None,
        "code": "bad_frame",
        "message": "m",
    }
