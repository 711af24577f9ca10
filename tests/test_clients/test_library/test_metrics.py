"""The one definition of TTFT, ITL, latency, throughput and percentiles
(clients/library/metrics.py)."""

from __future__ import annotations

import numpy as np
import pytest

from clients.library import metrics as m
from clients.library.chunk import Chunk
from streaming_backend.wire import ServerTiming

MS = 1_000_000


def chunk(t_ms: float, tokens: int | None = 1, text: str = "x", emitted_ms=None) -> Chunk:
    """A response received at t_ms carrying `tokens` tokens and `text`."""
    timing = None
    if emitted_ms is not None:
        timing = ServerTiming(0, 0, 0, int(emitted_ms * MS))
    return Chunk.delta(text, tokens, int(t_ms * MS), request_id="r", timing=timing)


def ms(value):
    return None if value is None else value / MS


# (name, sent_ms, chunks, ttft, first text, latency, tokens, itl) in ms
CASES = [
    ("three tokens", 0, [chunk(10), chunk(15), chunk(20)], 10, 10, 20, 3, 5),
    ("one token: no ITL", 100, [chunk(130)], 30, 30, 30, 1, None),
    (
        "a first token without text counts for TTFT; text comes later",
        0,
        [chunk(10, text=""), chunk(16), chunk(22)],
        10,
        16,
        22,
        3,
        6,
    ),
    (
        "a request whose only token has no text (EOS) still has a TTFT",
        0,
        [chunk(12, text="")],
        12,
        None,
        12,
        1,
        None,
    ),
    (
        "tokens in one response are counted, not chunks",
        0,
        [chunk(10, 2), chunk(30, 3)],
        10,
        10,
        30,
        5,
        5,
    ),
    (
        "an empty final response ends the request",
        0,
        [chunk(10), chunk(20), chunk(25, 0, "")],
        10,
        10,
        25,
        2,
        15,
    ),
    ("no response", 0, [], None, None, None, 0, None),
]


@pytest.mark.parametrize(
    "name,sent,chunks,ttft,text,latency,tokens,itl", CASES, ids=[c[0] for c in CASES]
)
def test_definitions(name, sent, chunks, ttft, text, latency, tokens, itl):
    """Each figure matches genai-perf's definition on a hand-computed timeline."""
    sent_ns = sent * MS
    assert ms(m.ttft_ns(sent_ns, chunks)) == ttft
    assert ms(m.time_to_first_text_ns(sent_ns, chunks)) == text
    assert ms(m.request_latency_ns(sent_ns, chunks)) == latency
    assert m.output_tokens(chunks) == tokens
    assert ms(m.itl_ns(sent_ns, chunks)) == itl


def test_token_count_rule_without_server_counts():
    """Without the server's count, a response with text is one token and one without is none."""
    chunks = [chunk(1, None, "a"), chunk(2, None, ""), chunk(3, None, "bc")]
    assert m.output_tokens(chunks) == 2


def test_decode_rate_is_one_over_itl():
    """Tokens per second after the first response."""
    assert m.decode_rate([chunk(10), chunk(20), chunk(30)]) == pytest.approx(100.0)
    assert m.decode_rate([chunk(10)]) is None


def test_server_itl_uses_emitted_stamps():
    """Server-side ITL comes from the first token's and the last response's emitted stamps."""
    chunks = [chunk(11, emitted_ms=10), chunk(60, emitted_ms=59), chunk(70, emitted_ms=108)]
    assert m.server_itl_ns(chunks) == 49 * MS
    assert m.server_itl_ns([chunk(1), chunk(2)]) is None


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 101])
def test_percentile_matches_numpy(n):
    """Percentiles interpolate linearly between ranks, exactly as numpy.percentile (genai-perf)."""
    xs = sorted(np.random.default_rng(n).exponential(50.0, size=n).tolist())
    for p in (0, 1, 25, 50, 90, 95, 99, 100):
        assert m.percentile(xs, p) == pytest.approx(np.percentile(xs, p))


def test_percentile_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        m.percentile([], 50)


def test_stats_of_nothing_is_empty_not_zero():
    """No values give count 0 and None figures, never a fake 0 ms."""
    s = m.stats([None, None])
    assert s.count == 0 and s.avg is None and s.p99 is None


def test_stats_scale_and_single_value():
    """One value is its own avg, min, max and percentiles."""
    s = m.stats([5 * MS], MS)
    assert (s.count, s.avg, s.min, s.max, s.p50, s.p90, s.p99) == (1, 5, 5, 5, 5, 5, 5)


def test_throughput_of_an_empty_span_is_none():
    assert m.throughput(10, 2 * m.NS_PER_S) == 5.0
    assert m.throughput(10, 0) is None and m.throughput(10, None) is None


def test_span_runs_from_the_first_send_to_the_last_response_of_any_request():
    """The span starts at the earliest send and ends at the latest response, whichever requests
    they belong to; requests without a response are left out; none at all give None."""
    requests = [(5 * MS, [chunk(10), chunk(50)]), (0, [chunk(20), chunk(40)]), (-7 * MS, [])]
    assert m.span_ns(requests) == 50 * MS
    assert m.span_ns([(0, [])]) is None and m.span_ns([]) is None
