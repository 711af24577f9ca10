"""A level's records and summary (clients/bench/summary.py) on synthetic request timelines."""

from __future__ import annotations

from dataclasses import replace

import pytest

from clients.bench.summary import (
    BREAKDOWN_PARTS,
    ClockMap,
    RequestRecord,
    summarize,
    ttft_breakdown_ns,
)
from clients.library.chunk import Chunk
from streaming_backend.wire import ServerTiming

MS = 1_000_000
SAME = ClockMap(same_clock=True)


def rec(sent_ms, responses, finish_reason=None, timing=None, **kw) -> RequestRecord:
    """A record from (recv_ms, tokens, text) triples; the last carries finish_reason."""
    chunks = [Chunk.delta(text, n, int(t * MS), request_id="r") for t, n, text in responses]
    if chunks:
        chunks[0] = replace(chunks[0], timing=timing)
        chunks[-1] = replace(chunks[-1], finish_reason=finish_reason)
    return RequestRecord(index=0, sent_ns=int(sent_ms * MS), chunks=chunks, **kw)


@pytest.mark.parametrize(
    "record,status",
    [
        (rec(0, [(10, 1, "a")]), "ok"),
        (rec(0, [(10, 1, "")]), "ok"),  # one token without text (EOS) is a completed request
        (rec(0, [], error="invalid request: x"), "error"),
        (rec(0, [(10, 1, "a")], error="internal error"), "error"),
        (rec(0, [(10, 1, "a")], finish_reason="error"), "error"),
        (rec(0, [(10, 1, "a")], cancelled=True), "cancelled"),
        (rec(0, [(10, 1, "a"), (12, 1, "b")], finish_reason="cancelled"), "cancelled"),
        (rec(0, []), "error"),  # no response and no error
    ],
)
def test_status(record, status):
    assert record.status == status


def test_summary_counts_every_completed_request():
    """Every request with a response and no error counts, even one that ended after one token
    without text (genai-perf counts it; the former definition left it out of TTFT)."""
    records = [
        rec(0, [(100, 1, "a"), (200, 1, "b")]),
        rec(0, [(40, 1, "")]),  # ended after one token (EOS, no text)
        rec(0, [(60, 1, ""), (80, 1, "é")]),  # the first token held back half a character
    ]
    s = summarize(records, SAME)
    assert s["completed"] == 3 and s["ttft_ms"]["count"] == 3
    assert s["ttft_ms"]["avg"] == pytest.approx((100 + 40 + 60) / 3)
    assert s["time_to_first_text_ms"]["count"] == 2
    assert s["time_to_first_text_ms"]["avg"] == pytest.approx((100 + 80) / 2)
    assert s["itl_ms"]["count"] == 2  # below 2 tokens there is no ITL


def test_summary_counts_errors_and_cancellations_apart():
    """Only successful requests enter latency and throughput; the others are counted."""
    records = [
        rec(0, [(100, 1, "a"), (200, 1, "a")]),
        rec(50, [(150, 1, "a"), (250, 1, "a"), (350, 1, "a"), (450, 1, "a")]),
        rec(10, [], error="overloaded: queue full"),
        rec(20, [(900, 1, "a")], cancelled=True),
    ]
    s = summarize(records, SAME)
    assert (s["requests"], s["completed"], s["errors"], s["cancelled"]) == (4, 2, 1, 1)
    assert s["ttft_ms"]["avg"] == 100
    assert s["itl_ms"]["min"] == 100 and s["itl_ms"]["max"] == 100
    assert s["request_latency_ms"]["max"] == 400
    # duration: first sent (0) to last response (450) of the successful requests
    assert s["duration_s"] == pytest.approx(0.45)
    assert s["total_output_tokens"] == 6
    assert s["output_token_throughput"] == pytest.approx(6 / 0.45)
    assert s["request_throughput"] == pytest.approx(2 / 0.45)


def test_summary_of_zero_requests():
    """An empty level has counts of zero and no figures, without dividing by zero."""
    s = summarize([], SAME)
    assert s["requests"] == 0 and s["completed"] == 0
    assert s["ttft_ms"]["count"] == 0 and s["ttft_ms"]["avg"] is None
    assert s["duration_s"] is None and s["output_token_throughput"] is None


def test_summary_of_only_errors():
    """All-failed levels report no throughput rather than zero."""
    s = summarize([rec(0, [], error="x"), rec(1, [], error="y")], SAME)
    assert s["errors"] == 2 and s["request_throughput"] is None


def timed_record(clock_offset_ns: int = 0, first_text: str = "ab") -> RequestRecord:
    """Sent at 1000 ms; server: received 1002, queued 1003, prefill 1010, emitted 1300."""
    t = ServerTiming(
        received_ns=1002 * MS + clock_offset_ns,
        queued_ns=1003 * MS + clock_offset_ns,
        prefill_start_ns=1010 * MS + clock_offset_ns,
        emitted_ns=1300 * MS + clock_offset_ns,
        wall_minus_monotonic_ns=5_000 * MS - clock_offset_ns,
    )
    return rec(1000, [(1301, 1, first_text), (1351, 1, "cd")], timing=t)


def test_breakdown_on_one_clock_adds_up_to_ttft():
    """On a shared clock the five parts are exact and sum to the client's TTFT."""
    r = timed_record()
    b = ttft_breakdown_ns(r, SAME)
    assert {k: v / MS for k, v in b.items()} == {
        "to_server": 2,
        "admission": 1,
        "queue": 7,
        "prefill": 290,
        "to_client": 1,
    }
    assert sum(b[p] for p in BREAKDOWN_PARTS) == r.ttft_ns()


def test_held_back_first_token_still_ends_the_ttft():
    """A first token without text (half a character) ends the TTFT; the text comes apart."""
    r = timed_record(first_text="")
    b = ttft_breakdown_ns(r, SAME)
    assert r.ttft_ns() == 301 * MS and sum(b.values()) == r.ttft_ns()
    assert r.time_to_first_text_ns() == 351 * MS


def test_breakdown_across_clocks_goes_through_wall_time():
    """A server clock 7 s ahead is mapped back through wall_minus_monotonic_ns."""
    r = timed_record(clock_offset_ns=7_000 * MS)
    b = ttft_breakdown_ns(r, ClockMap(same_clock=False, client_wall_minus_monotonic_ns=5_000 * MS))
    assert b["to_server"] == 2 * MS and b["to_client"] == 1 * MS and b["prefill"] == 290 * MS


def test_breakdown_missing_without_server_timing():
    """Requests without the timing output have no breakdown."""
    assert ttft_breakdown_ns(rec(0, [(1, 1, "a")]), SAME) is None


def turn_record(conversation: int, turn: int, ttft_ms: float, prompt: int, cached: int, **kw):
    """Turn `turn` of a conversation: one token after ttft_ms, the server's prompt and cached
    token counts."""
    t = ServerTiming(1, 2, 3, 4, cached_tokens=cached)
    r = rec(0, [(ttft_ms, 1, "a")], timing=t, conversation=conversation, turn=turn, **kw)
    r.chunks[0] = replace(r.chunks[0], num_input_tokens=prompt)
    return r


def test_turn_summary_per_turn_index_and_over_the_later_turns():
    """TTFT (the project's percentile), prompt and cached tokens per turn; turns 5 on together;
    a failed turn is sent but not completed."""
    from clients.bench.summary import LATER_TURNS_FROM
    from clients.library.metrics import percentile

    assert LATER_TURNS_FROM == 5
    records = [
        turn_record(c, t, ttft_ms=10 * t + c, prompt=20 * t, cached=20 * (t - 1) - 2)
        for c in range(3)
        for t in range(1, 7)
    ]
    records.append(turn_record(3, 1, 999, 20, 0, error="overloaded: queue full"))
    mt = summarize(records, SAME)["multi_turn"]
    assert mt["turns"] == 6 and [t["turn"] for t in mt["per_turn"]] == [1, 2, 3, 4, 5, 6]
    first, second = mt["per_turn"][:2]
    assert (first["requests"], first["completed"], second["requests"]) == (4, 3, 3)
    assert first["ttft_ms"]["p50"] == pytest.approx(11) and second["ttft_ms"]["avg"] == 21
    assert second["input_tokens"]["avg"] == 40 and second["cached_tokens"]["avg"] == 18
    later = mt["later_turns"]
    assert (later["from_turn"], later["to_turn"], later["completed"]) == (5, 6, 6)
    ttfts = sorted(10 * t + c for c in range(3) for t in (5, 6))
    assert later["ttft_ms"]["p50"] == pytest.approx(percentile(ttfts, 50))
    assert later["ttft_ms"]["p90"] == pytest.approx(percentile(ttfts, 90))


def test_no_turn_figures_without_turns_nor_cached_tokens_without_timing():
    """A single-request level has no multi_turn block; a turn without server timing (openai)
    has no cached-token figure."""
    assert summarize([rec(0, [(10, 1, "a")])], SAME)["multi_turn"] is None
    r = rec(0, [(10, 1, "a")], turn=1, conversation=0)
    (t,) = summarize([r], SAME)["multi_turn"]["per_turn"]
    assert t["ttft_ms"]["count"] == 1 and t["cached_tokens"]["count"] == 0
    assert r.cached_tokens is None and r.text == "a"
