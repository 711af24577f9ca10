"""Benchmark metrics as pure functions over per-request timelines.

Definitions follow NVIDIA genai-perf / AIPerf:
- TTFT = first response with content - request sent
- request latency = last response - request sent
- inter-token latency (ITL) = (request latency - TTFT) / (output tokens - 1); none for 1 token
- output token throughput = total output tokens / (last response - first request sent)
- request throughput = completed requests / the same duration

Output tokens are the sum of the server's per-response `num_output_tokens`, never a count of
chunks. Only successful requests enter latency and throughput figures; errors and cancellations
are counted on their own. All client timestamps are CLOCK_MONOTONIC nanoseconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000

OK, ERROR, CANCELLED = "ok", "error", "cancelled"

# The parts of a TTFT, in timeline order; on one clock they add up to the TTFT exactly.
BREAKDOWN_PARTS = ("to_server", "admission", "queue", "prefill", "to_client", "held_back")
BREAKDOWN_HELP = {
    "to_server": "request sent -> server received (network, HTTP/gRPC front end, bridge)",
    "admission": "server received -> queued in the engine (model.py execute)",
    "queue": "queued -> prefill start (waiting for a batch slot)",
    "prefill": "prefill start -> first token emitted (prefill and first sampling step)",
    "to_client": "first token emitted -> client received (sender thread, network, bridge)",
    "held_back": "first token received -> first text received (part of a character held back)",
}


@dataclass(frozen=True)
class ServerTiming:
    """Server timestamps of one response (CLOCK_MONOTONIC ns of the server)."""

    received_ns: int
    queued_ns: int
    prefill_start_ns: int
    emitted_ns: int
    wall_minus_monotonic_ns: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> ServerTiming:
        """Build from the model's `timing` JSON object."""
        return cls(
            received_ns=int(d["received_ns"]),
            queued_ns=int(d["queued_ns"]),
            prefill_start_ns=int(d["prefill_start_ns"]),
            emitted_ns=int(d["emitted_ns"]),
            wall_minus_monotonic_ns=int(d.get("wall_minus_monotonic_ns", 0)),
        )


@dataclass
class Response:
    """One streamed response as the client saw it."""

    recv_ns: int
    tokens: int  # the server's num_output_tokens for this response
    chars: int  # length of its text delta; 0 means no content
    emitted_ns: int | None = None  # server's emitted_ns, when the transport carries it


@dataclass
class RequestRecord:
    """Timeline of one request: when it was sent and every response that came back."""

    index: int
    sent_ns: int = 0
    responses: list[Response] = field(default_factory=list)
    server_timing: ServerTiming | None = None  # timing of the first response with a token
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    cancelled: bool = False
    extra: dict | None = None  # transport-specific figures (e.g. the bridge's own timing)

    @property
    def status(self) -> str:
        """ok, error or cancelled."""
        if self.cancelled or self.finish_reason == "cancelled":
            return CANCELLED
        if self.error is not None or self.finish_reason == "error":
            return ERROR
        return OK if self.responses else ERROR


@dataclass(frozen=True)
class ClockMap:
    """Maps server CLOCK_MONOTONIC stamps onto the client's monotonic clock."""

    same_clock: bool
    client_wall_minus_monotonic_ns: int = 0

    def to_client(self, server_ns: int, server_wall_minus_monotonic_ns: int) -> int:
        """Server monotonic ns -> client monotonic ns (through wall time when clocks differ)."""
        if self.same_clock:
            return server_ns
        return server_ns + server_wall_minus_monotonic_ns - self.client_wall_minus_monotonic_ns


def first_content(r: RequestRecord) -> Response | None:
    """The first response carrying text, as genai-perf drops empty responses."""
    return next((x for x in r.responses if x.chars > 0), None)


def first_token(r: RequestRecord) -> Response | None:
    """The first response carrying a token, with or without text (falls back to content)."""
    return next((x for x in r.responses if x.tokens > 0), None) or first_content(r)


def ttft_ns(r: RequestRecord) -> int | None:
    """Time to first token: first response with content - request sent."""
    first = first_content(r)
    return None if first is None else first.recv_ns - r.sent_ns


def request_latency_ns(r: RequestRecord) -> int | None:
    """Last response - request sent."""
    return r.responses[-1].recv_ns - r.sent_ns if r.responses else None


def output_tokens(r: RequestRecord) -> int:
    """Sum of the server's per-response token counts."""
    return sum(x.tokens for x in r.responses)


def itl_ns(r: RequestRecord) -> float | None:
    """Inter-token latency: (latency - TTFT) / (output tokens - 1); none below 2 tokens."""
    ttft, latency, n = ttft_ns(r), request_latency_ns(r), output_tokens(r)
    if ttft is None or latency is None or n < 2:
        return None
    return (latency - ttft) / (n - 1)


def server_itl_ns(r: RequestRecord) -> float | None:
    """The same ITL measured on the server's emitted stamps (no network jitter)."""
    first, n = first_content(r), output_tokens(r)
    last = r.responses[-1] if r.responses else None
    if first is None or last is None or n < 2 or first.emitted_ns is None:
        return None
    if last.emitted_ns is None:
        return None
    return (last.emitted_ns - first.emitted_ns) / (n - 1)


def ttft_breakdown_ns(r: RequestRecord, clock: ClockMap) -> dict[str, int] | None:
    """Split a TTFT into BREAKDOWN_PARTS at the server stamps of the first token's response.

    The first token can arrive without text (half a UTF-8 character, held back by the
    detokeniser); the wait from it to the first text is `held_back`, so the parts still add up
    to the TTFT, which counts from the first response with text.
    """
    t, token, text = r.server_timing, first_token(r), first_content(r)
    if t is None or token is None or text is None:
        return None
    received = clock.to_client(t.received_ns, t.wall_minus_monotonic_ns)
    emitted = clock.to_client(t.emitted_ns, t.wall_minus_monotonic_ns)
    return {
        "to_server": received - r.sent_ns,
        "admission": t.queued_ns - t.received_ns,
        "queue": t.prefill_start_ns - t.queued_ns,
        "prefill": t.emitted_ns - t.prefill_start_ns,
        "to_client": token.recv_ns - emitted,
        "held_back": text.recv_ns - token.recv_ns,
    }


@dataclass(frozen=True)
class Stats:
    """avg/min/max/p50/p90/p99 of one metric; all None when there are no values."""

    count: int
    avg: float | None = None
    min: float | None = None
    max: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    def as_dict(self) -> dict:
        """JSON-ready mapping."""
        return {k: getattr(self, k) for k in ("count", "avg", "min", "max", "p50", "p90", "p99")}


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear-interpolation percentile (numpy's default method) of already sorted values."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = p / 100 * (len(sorted_values) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def stats(values: Iterable[float | None], scale: float = 1.0) -> Stats:
    """Stats of the non-None values, each divided by `scale` (e.g. NS_PER_MS)."""
    xs = sorted(v / scale for v in values if v is not None)
    if not xs:
        return Stats(count=0)
    return Stats(
        count=len(xs),
        avg=sum(xs) / len(xs),
        min=xs[0],
        max=xs[-1],
        p50=percentile(xs, 50),
        p90=percentile(xs, 90),
        p99=percentile(xs, 99),
    )


def duration_ns(records: Sequence[RequestRecord]) -> int | None:
    """Last response of any request - first request sent."""
    timed = [r for r in records if r.responses]
    if not timed:
        return None
    return max(r.responses[-1].recv_ns for r in timed) - min(r.sent_ns for r in timed)


def throughput(count: int, span_ns: int | None) -> float | None:
    """count per second over span_ns; None when the span is empty."""
    if not span_ns or span_ns <= 0:
        return None
    return count * NS_PER_S / span_ns


def summarize(records: Sequence[RequestRecord], clock: ClockMap) -> dict:
    """Every figure of one benchmark level: counts, latency stats in ms, throughputs."""
    ok = [r for r in records if r.status == OK]
    span = duration_ns(ok)
    total_out = sum(output_tokens(r) for r in ok)
    breakdowns = [b for b in (ttft_breakdown_ns(r, clock) for r in ok) if b is not None]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": sum(r.status == ERROR for r in records),
        "cancelled": sum(r.status == CANCELLED for r in records),
        "ttft_ms": stats((ttft_ns(r) for r in ok), NS_PER_MS).as_dict(),
        "itl_ms": stats((itl_ns(r) for r in ok), NS_PER_MS).as_dict(),
        "server_itl_ms": stats((server_itl_ns(r) for r in ok), NS_PER_MS).as_dict(),
        "request_latency_ms": stats((request_latency_ns(r) for r in ok), NS_PER_MS).as_dict(),
        "output_tokens": stats(output_tokens(r) for r in ok).as_dict(),
        "input_tokens": stats(r.prompt_tokens for r in ok).as_dict(),
        "ttft_breakdown_ms": {
            part: stats((b[part] for b in breakdowns), NS_PER_MS).as_dict()
            for part in BREAKDOWN_PARTS
        },
        "total_output_tokens": total_out,
        "duration_s": None if span is None else span / NS_PER_S,
        "output_token_throughput": throughput(total_out, span),
        "request_throughput": throughput(len(ok), span),
    }
