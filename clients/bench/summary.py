"""A benchmark level's records and their summary: each request's send time and Chunks, the TTFT
breakdown from the server's stamps, and every figure of one level (definitions:
clients/library/metrics.py), per turn index too when the level ran multi-turn conversations.

Every request that got a response and no error counts (as genai-perf); errors and cancellations
are counted on their own. All client timestamps are CLOCK_MONOTONIC nanoseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from clients.library import metrics as m
from clients.library.chunk import Chunk
from streaming_backend.wire import FinishReason, ServerTiming

OK, ERROR, CANCELLED = "ok", "error", "cancelled"

# The parts of a TTFT, in timeline order; on one clock they add up to the TTFT exactly.
BREAKDOWN_PARTS = ("to_server", "admission", "queue", "prefill", "to_client")
BREAKDOWN_HELP = {
    "to_server": "request sent -> server received (network, HTTP/gRPC front end, bridge)",
    "admission": "server received -> queued in the engine (model.py execute)",
    "queue": "queued -> prefill start (waiting for a batch slot)",
    "prefill": "prefill start -> first token emitted (prefill and first sampling step)",
    "to_client": "first token emitted -> client received (sender thread, network, bridge)",
}


@dataclass
class RequestRecord:
    """Timeline of one request: when it was sent and every response that came back."""

    index: int
    sent_ns: int = 0
    chunks: list[Chunk] = field(default_factory=list)
    first_token_timing: ServerTiming | None = None  # when the transport gives it apart (ws)
    error: str | None = None
    cancelled: bool = False
    extra: dict | None = None  # transport-specific figures (e.g. the bridge's own timing)
    conversation: int | None = None  # multi-turn: which conversation, from 0
    turn: int | None = None  # multi-turn: which turn of it, from 1

    @property
    def server_timing(self) -> ServerTiming | None:
        """The server's stamps of the first token's response."""
        if self.first_token_timing is not None:
            return self.first_token_timing
        first = m.first_token(self.chunks)
        return None if first is None else first.timing

    @property
    def prompt_tokens(self) -> int | None:
        """The server's count of prompt tokens, from the first response that has it."""
        counts = (c.num_input_tokens for c in self.chunks if c.num_input_tokens is not None)
        return next(counts, None)

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the server reused from its prefix cache; None without server timing."""
        t = self.server_timing
        return None if t is None else t.cached_tokens

    @property
    def text(self) -> str:
        """The answer: every response's text in order."""
        return "".join(c.text for c in self.chunks)

    @property
    def finish_reason(self) -> str | None:
        """The last finish reason a response carried."""
        return next((c.finish_reason for c in reversed(self.chunks) if c.finish_reason), None)

    @property
    def status(self) -> str:
        """ok, error or cancelled."""
        if self.cancelled or self.finish_reason == FinishReason.CANCELLED.value:
            return CANCELLED
        if self.error is not None or self.finish_reason == FinishReason.ERROR.value:
            return ERROR
        return OK if self.chunks else ERROR

    # the metrics of clients/library/metrics.py on this request
    def ttft_ns(self) -> int | None:
        """Time to first token (first response)."""
        return m.ttft_ns(self.sent_ns, self.chunks)

    def time_to_first_text_ns(self) -> int | None:
        """Time to the first printable text."""
        return m.time_to_first_text_ns(self.sent_ns, self.chunks)

    def request_latency_ns(self) -> int | None:
        """Last response - request sent."""
        return m.request_latency_ns(self.sent_ns, self.chunks)

    def itl_ns(self) -> float | None:
        """Inter-token latency."""
        return m.itl_ns(self.sent_ns, self.chunks)

    def output_tokens(self) -> int:
        """Output tokens."""
        return m.output_tokens(self.chunks)


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


def ttft_breakdown_ns(r: RequestRecord, clock: ClockMap) -> dict[str, int] | None:
    """Split a TTFT into BREAKDOWN_PARTS at the server stamps of the first token's response.

    The TTFT ends at the first response; the first token's response is that one whenever the
    request produced a token, so the parts add up to the TTFT.
    """
    t, token = r.server_timing, m.first_token(r.chunks)
    if t is None or token is None:
        return None
    received = clock.to_client(t.received_ns, t.wall_minus_monotonic_ns)
    emitted = clock.to_client(t.emitted_ns, t.wall_minus_monotonic_ns)
    return {
        "to_server": received - r.sent_ns,
        "admission": t.queued_ns - t.received_ns,
        "queue": t.prefill_start_ns - t.queued_ns,
        "prefill": t.emitted_ns - t.prefill_start_ns,
        "to_client": token.received_ns - emitted,
    }


def summarize(records: Sequence[RequestRecord], clock: ClockMap) -> dict:
    """Every figure of one benchmark level: counts, latency stats in ms, throughputs."""
    ok = [r for r in records if r.status == OK]
    span = m.span_ns((r.sent_ns, r.chunks) for r in ok)
    total_out = sum(r.output_tokens() for r in ok)
    breakdowns = [b for b in (ttft_breakdown_ns(r, clock) for r in ok) if b is not None]
    ms = m.NS_PER_MS
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": sum(r.status == ERROR for r in records),
        "cancelled": sum(r.status == CANCELLED for r in records),
        "ttft_ms": m.stats((r.ttft_ns() for r in ok), ms).as_dict(),
        "time_to_first_text_ms": m.stats((r.time_to_first_text_ns() for r in ok), ms).as_dict(),
        "itl_ms": m.stats((r.itl_ns() for r in ok), ms).as_dict(),
        "server_itl_ms": m.stats((m.server_itl_ns(r.chunks) for r in ok), ms).as_dict(),
        "request_latency_ms": m.stats((r.request_latency_ns() for r in ok), ms).as_dict(),
        "output_tokens": m.stats(r.output_tokens() for r in ok).as_dict(),
        "input_tokens": m.stats(r.prompt_tokens for r in ok).as_dict(),
        "ttft_breakdown_ms": {
            part: m.stats((b[part] for b in breakdowns), ms).as_dict() for part in BREAKDOWN_PARTS
        },
        "total_output_tokens": total_out,
        "duration_s": None if span is None else span / m.NS_PER_S,
        "output_token_throughput": m.throughput(total_out, span),
        "request_throughput": m.throughput(len(ok), span),
        "multi_turn": turn_summary(records),
    }


# Turns from this one on are the "later turns" of a multi-turn run: by then most of a prompt is
# history (earlier turns and answers), which a prefix cache can reuse (issue 12: turns 5-10).
LATER_TURNS_FROM = 5


def turn_figures(records: Sequence[RequestRecord]) -> dict:
    """Counts, TTFT (ms), prompt tokens and cached prompt tokens of some turns' requests."""
    ok = [r for r in records if r.status == OK]
    return {
        "requests": len(records),
        "completed": len(ok),
        "ttft_ms": m.stats((r.ttft_ns() for r in ok), m.NS_PER_MS).as_dict(),
        "input_tokens": m.stats(r.prompt_tokens for r in ok).as_dict(),
        "cached_tokens": m.stats(r.cached_tokens for r in ok).as_dict(),
    }


def turn_summary(records: Sequence[RequestRecord]) -> dict | None:
    """A multi-turn level's figures per turn index, and over its later turns; None for a level
    without turns."""
    turns = sorted({r.turn for r in records if r.turn is not None})
    if not turns:
        return None
    later = [r for r in records if r.turn is not None and r.turn >= LATER_TURNS_FROM]
    per_turn = [{"turn": t} | turn_figures([r for r in records if r.turn == t]) for t in turns]
    span = {"from_turn": LATER_TURNS_FROM, "to_turn": turns[-1]}
    return {"turns": turns[-1], "per_turn": per_turn, "later_turns": span | turn_figures(later)}
