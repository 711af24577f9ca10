"""The one definition of each latency and throughput figure, as pure functions over a request's
send time and the Chunks that came back (CLOCK_MONOTONIC ns). The benchmark, the engine
benchmark, the terminal chat and the bridge all use these.

Definitions follow NVIDIA genai-perf / AIPerf, so our figures equal theirs on the same requests:
- TTFT = first response - request sent (whatever the response carries, as genai-perf); no
  other interval is called TTFT
- time to first text = first response with printable text - request sent (ours: the
  detokeniser holds back a partial character or a possible stop string, so it can come later;
  it is what a person sees, and the terminal chat shows it beside the TTFT)
- request latency = last response - request sent
- output tokens = sum of the responses' token counts (Chunk.tokens), never a count of chunks
- inter-token latency (ITL) = (request latency - TTFT) / (output tokens - 1); none below 2 tokens
- span = last response of any request - first request sent; throughput = count / span
- percentiles interpolate linearly between ranks (numpy.percentile's default, as genai-perf)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from clients.library.chunk import Chunk

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000


def first_text(chunks: Sequence[Chunk]) -> Chunk | None:
    """The first response carrying printable text."""
    return next((c for c in chunks if c.text), None)


def first_token(chunks: Sequence[Chunk]) -> Chunk | None:
    """The first response carrying a token, with or without text."""
    return next((c for c in chunks if c.tokens > 0), None)


def ttft_ns(sent_ns: int, chunks: Sequence[Chunk]) -> int | None:
    """Time to first token: first response - request sent; None without a response."""
    return chunks[0].received_ns - sent_ns if chunks else None


def time_to_first_text_ns(sent_ns: int, chunks: Sequence[Chunk]) -> int | None:
    """First response with printable text - request sent; None when no text came."""
    first = first_text(chunks)
    return None if first is None else first.received_ns - sent_ns


def request_latency_ns(sent_ns: int, chunks: Sequence[Chunk]) -> int | None:
    """Last response - request sent."""
    return chunks[-1].received_ns - sent_ns if chunks else None


def output_tokens(chunks: Iterable[Chunk]) -> int:
    """Sum of the responses' token counts."""
    return sum(c.tokens for c in chunks)


def itl_ns(sent_ns: int, chunks: Sequence[Chunk]) -> float | None:
    """Inter-token latency: (latency - TTFT) / (output tokens - 1); None below 2 tokens."""
    n = output_tokens(chunks)
    if not chunks or n < 2:
        return None
    return (chunks[-1].received_ns - chunks[0].received_ns) / (n - 1)


def server_itl_ns(chunks: Sequence[Chunk]) -> float | None:
    """The same ITL on the server's emitted stamps (no network jitter); None without them."""
    first, n = first_token(chunks), output_tokens(chunks)
    last = chunks[-1] if chunks else None
    if first is None or last is None or n < 2 or first.timing is None or last.timing is None:
        return None
    return (last.timing.emitted_ns - first.timing.emitted_ns) / (n - 1)


def decode_rate(chunks: Sequence[Chunk]) -> float | None:
    """Tokens per second after the first token's response: 1 / ITL; None below 2 tokens."""
    itl = itl_ns(0, chunks)
    return None if not itl else NS_PER_S / itl


def span_ns(requests: Iterable[tuple[int, Sequence[Chunk]]]) -> int | None:
    """Of (sent_ns, chunks) per request: last response of any request - first request sent,
    over the requests that got a response; None when none did. Throughputs divide by it."""
    answered = [(sent, chunks) for sent, chunks in requests if chunks]
    if not answered:
        return None
    last = max(chunks[-1].received_ns for _, chunks in answered)
    return last - min(sent for sent, _ in answered)


def throughput(count: float, span_ns: int | None) -> float | None:
    """count per second over span_ns; None when the span is empty."""
    if not span_ns or span_ns <= 0:
        return None
    return count * NS_PER_S / span_ns


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear-interpolation percentile (numpy.percentile's default) of already sorted values."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = p / 100 * (len(sorted_values) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


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
