"""Metric definitions of clients.bench.metrics on synthetic request timelines."""

from __future__ import annotations

import numpy as np
import pytest

from clients.bench.metrics import (
    BREAKDOWN_PARTS,
    ClockMap,
    RequestRecord,
    Response,
    ServerTiming,
    itl_ns,
    output_tokens,
    percentile,
    request_latency_ns,
    server_itl_ns,
    stats,
    summarize,
    ttft_breakdown_ns,
    ttft_ns,
)

MS = 1_000_000
SAME = ClockMap(same_clock=True)


def rec(sent_ms, responses, **kw) -> RequestRecord:
    """A record from (recv_ms, tokens, chars) triples."""
    rs = [Response(recv_ns=int(t * MS), tokens=n, chars=c) for t, n, c in responses]
    return RequestRecord(index=0, sent_ns=int(sent_ms * MS), responses=rs, **kw)


# (name, record, ttft_ms, latency_ms, tokens, itl_ms, status)
CASES = [
    ("three tokens", rec(0, [(10, 1, 3), (15, 1, 2), (20, 1, 4)]), 10, 20, 3, 5, "ok"),
    ("one token: no ITL", rec(100, [(130, 1, 5)]), 30, 30, 1, None, "ok"),
    (
        "empty first response does not count for TTFT but its token does",
        rec(0, [(10, 1, 0), (16, 1, 2), (22, 1, 1)]),
        16,
        22,
        3,
        3,
        "ok",
    ),
    (
        "several tokens in one response are counted, not the chunks",
        rec(0, [(10, 2, 4), (30, 3, 6)]),
        10,
        30,
        5,
        5,
        "ok",
    ),
    (
        "empty final response ends the request",
        rec(0, [(10, 1, 1), (20, 1, 1), (25, 0, 0)]),
        10,
        25,
        2,
        15,
        "ok",
    ),
    (
        "error before any response",
        rec(0, [], error="invalid request: x"),
        None,
        None,
        0,
        None,
        "error",
    ),
    ("error mid-stream", rec(0, [(10, 1, 1)], error="internal error"), 10, 10, 1, None, "error"),
    ("finish_reason error", rec(0, [(10, 1, 1)], finish_reason="error"), 10, 10, 1, None, "error"),
    ("cancelled by the client", rec(0, [(10, 1, 1)], cancelled=True), 10, 10, 1, None, "cancelled"),
    (
        "cancelled by the server",
        rec(0, [(10, 1, 1), (12, 1, 1)], finish_reason="cancelled"),
        10,
        12,
        2,
        2,
        "cancelled",
    ),
    ("no response and no error is an error", rec(0, []), None, None, 0, None, "error"),
]


@pytest.mark.parametrize(
    "name,record,ttft,latency,tokens,itl,status", CASES, ids=[c[0] for c in CASES]
)
def test_record_metrics(name, record, ttft, latency, tokens, itl, status):
    """Each definition matches genai-perf's on a hand-computed timeline."""
    as_ms = lambda v: None if v is None else v / MS  # noqa: E731
    assert as_ms(ttft_ns(record)) == ttft
    assert as_ms(request_latency_ns(record)) == latency
    assert output_tokens(record) == tokens
    assert as_ms(itl_ns(record)) == itl
    assert record.status == status


def test_percentile_matches_numpy_linear():
    """Percentiles use numpy's default linear interpolation."""
    xs = sorted([3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0])
    for p in (0, 1, 50, 90, 99, 100):
        assert percentile(xs, p) == pytest.approx(np.percentile(xs, p))


def test_stats_of_nothing_is_empty_not_zero():
    """No values give count 0 and None figures, never a fake 0 ms."""
    s = stats([None, None])
    assert s.count == 0 and s.avg is None and s.p99 is None


def test_stats_scale_and_single_value():
    """One value is its own avg, min, max and percentiles."""
    s = stats([5 * MS], MS)
    assert (s.count, s.avg, s.min, s.max, s.p50, s.p90, s.p99) == (1, 5, 5, 5, 5, 5, 5)


def test_summary_counts_errors_and_cancellations_apart():
    """Only successful requests enter latency and throughput; the others are counted."""
    records = [
        rec(0, [(100, 1, 1), (200, 1, 1)]),
        rec(50, [(150, 1, 1), (250, 1, 1), (350, 1, 1), (450, 1, 1)]),
        rec(10, [], error="overloaded: queue full"),
        rec(20, [(900, 1, 1)], cancelled=True),
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


def timed_record(clock_offset_ns: int = 0) -> RequestRecord:
    """Sent at 1000 ms; server: received 1002, queued 1003, prefill 1010, emitted 1300."""
    t = ServerTiming(
        received_ns=1002 * MS + clock_offset_ns,
        queued_ns=1003 * MS + clock_offset_ns,
        prefill_start_ns=1010 * MS + clock_offset_ns,
        emitted_ns=1300 * MS + clock_offset_ns,
        wall_minus_monotonic_ns=5_000 * MS - clock_offset_ns,
    )
    r = rec(1000, [(1301, 1, 2), (1351, 1, 2)], server_timing=t)
    r.responses[0].emitted_ns = t.emitted_ns
    r.responses[1].emitted_ns = t.emitted_ns + 49 * MS
    return r


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
        "held_back": 0,
    }
    assert sum(b[p] for p in BREAKDOWN_PARTS) == ttft_ns(r)


def test_breakdown_splits_off_a_held_back_first_token():
    """A first token without text (half a character): TTFT waits for text; parts add up."""
    r = timed_record()
    r.responses[0].chars = 0  # the 1301 ms response carried a token but no text yet
    b = ttft_breakdown_ns(r, SAME)
    assert b["to_client"] == 1 * MS and b["held_back"] == 50 * MS
    assert ttft_ns(r) == 351 * MS and sum(b.values()) == ttft_ns(r)


def test_breakdown_across_clocks_goes_through_wall_time():
    """A server clock 7 s ahead is mapped back through wall_minus_monotonic_ns."""
    r = timed_record(clock_offset_ns=7_000 * MS)
    b = ttft_breakdown_ns(r, ClockMap(same_clock=False, client_wall_minus_monotonic_ns=5_000 * MS))
    assert b["to_server"] == 2 * MS and b["to_client"] == 1 * MS and b["prefill"] == 290 * MS


def test_breakdown_missing_without_server_timing():
    """Requests without the timing output have no breakdown."""
    assert ttft_breakdown_ns(rec(0, [(1, 1, 1)]), SAME) is None


def test_server_itl_uses_emitted_stamps():
    """Server-side ITL comes from the first and last emitted stamps."""
    assert server_itl_ns(timed_record()) == 49 * MS
    assert server_itl_ns(rec(0, [(1, 1, 1), (2, 1, 1)])) is None
