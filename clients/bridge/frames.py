"""Bridge -> client: the outgoing frames (clients/bridge/protocol.py names their words), and the
timing trace that the `done` frame reports.

No I/O here. Every span of `timing.bridge` and `timing.server` is computed in this file, from the
definitions of clients/library/metrics.py where one exists (TTFT, time to first text).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from clients.bridge import protocol as p
from clients.library import metrics
from clients.library.chunk import Chunk
from streaming_backend.wire import FINISH_REASON, TIMING, ServerTiming


def error_frame(gen_id: str | None, code: str, message: str) -> dict[str, Any]:
    """An error message for one generation (or the connection when gen_id is None)."""
    return {p.TYPE: p.ERROR, p.ID: gen_id, p.CODE: code, p.MESSAGE: message}


def token_frame(gen_id: str, text: str, n: int) -> dict[str, Any]:
    """A text delta; n = output tokens of this generation so far."""
    return {p.TYPE: p.TOKEN, p.ID: gen_id, p.TEXT: text, p.COUNT: n}


@dataclass
class Trace:
    """What the bridge saw of one generation; monotonic ns, the server's clock where 'server'."""

    accepted_ns: int  # the generate frame was parsed
    upstream_ns: int = 0  # the request went to Triton
    # the first response, the first with a token and the first with text (at most three chunks):
    # clients/library/metrics.py reads the same TTFT and time to first text here as in every
    # response
    head: list[Chunk] = field(default_factory=list)
    first_out_ns: int | None = None  # the first token frame was queued for the client
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    relay_ns_total: int = 0  # summed chunk-received -> frame-queued time
    frames: int = 0

    def observe(self, chunk: Chunk) -> None:
        """Account one response from Triton, relayed or not."""
        if self.prompt_tokens is None and chunk.num_input_tokens is not None:
            self.prompt_tokens = chunk.num_input_tokens
        needed = not self.head
        needed |= chunk.tokens > 0 and metrics.first_token(self.head) is None
        needed |= bool(chunk.text) and metrics.first_text(self.head) is None
        if needed:
            self.head.append(chunk)

    def relayed(self, chunk: Chunk, out_ns: int) -> None:
        """Account a chunk whose token frame was queued at out_ns."""
        if self.first_out_ns is None:
            self.first_out_ns = out_ns
        self.completion_tokens += chunk.tokens
        self.relay_ns_total += out_ns - chunk.received_ns
        self.frames += 1

    @property
    def first_token(self) -> Chunk | None:
        """The first response carrying a token."""
        return metrics.first_token(self.head)


def done_frame(gen_id: str, finish_reason: str, trace: Trace, now_ns: int) -> dict[str, Any]:
    """The `done` message: finish reason, token usage, server and bridge timings in ms."""
    return {
        p.TYPE: p.DONE,
        p.ID: gen_id,
        FINISH_REASON: finish_reason,
        p.USAGE: {
            p.PROMPT_TOKENS: trace.prompt_tokens,
            p.COMPLETION_TOKENS: trace.completion_tokens,
        },
        TIMING: {p.SERVER: _server_timing(trace), p.BRIDGE: _bridge_timing(trace, now_ns)},
    }


def _ms(later: int | None, earlier: int | None) -> float | None:
    return None if later is None or earlier is None else round((later - earlier) / 1e6, 3)


def _span_ms(span_ns: float | None) -> float | None:
    return None if span_ns is None else round(span_ns / 1e6, 3)


def _server_timing(trace: Trace) -> dict[str, Any]:
    """The first token's server stamps (raw ns, the server's clock) and the spans between."""
    first = trace.first_token
    t = None if first is None else first.timing
    if t is None:
        return dict.fromkeys(p.SERVER_SPANS)
    spans = {
        p.QUEUE_MS: _ms(t.prefill_start_ns, t.queued_ns),
        p.PREFILL_MS: _ms(t.emitted_ns, t.prefill_start_ns),
        p.FIRST_TOKEN_MS: _ms(t.emitted_ns, t.received_ns),
    }
    return spans | asdict(t)  # the raw stamps ride along for benchmarks


def _bridge_timing(trace: Trace, now_ns: int) -> dict[str, float | None]:
    first = trace.first_token
    t = None if first is None else first.timing
    # Server stamp -> bridge receipt, via wall clock so it also holds across machines.
    known = t is not None and t.wall_minus_monotonic_ns != 0  # 0: an older server sent none
    emitted_wall = t.emitted_ns + t.wall_minus_monotonic_ns if known else None
    first_wall = None if first is None else first.received_ns + ServerTiming.wall_offset_ns()
    relay_mean = round(trace.relay_ns_total / trace.frames / 1e6, 3) if trace.frames else None
    sent, head = trace.upstream_ns, trace.head  # no head: nothing came from Triton
    return {
        p.FIRST_FRAME_MS: _ms(trace.first_out_ns, trace.accepted_ns),
        p.UPSTREAM_TTFT_MS: _span_ms(metrics.ttft_ns(sent, head)),
        p.UPSTREAM_FIRST_TEXT_MS: _span_ms(metrics.time_to_first_text_ns(sent, head)),
        p.SERVER_TO_BRIDGE_MS: _ms(first_wall, emitted_wall),
        p.RELAY_MEAN_MS: relay_mean,
        p.TOTAL_MS: _ms(now_ns, trace.accepted_ns),
    }
