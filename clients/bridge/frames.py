"""Bridge -> client: the outgoing frames, and the timing trace that the `done` frame reports.

No I/O here. Every span of `timing.bridge` and `timing.server` is computed in this file, so the
TTFT arithmetic of the bridge lives in one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from clients.chunk import Chunk
from streaming_backend.wire import ServerTiming


def error_frame(gen_id: str | None, code: str, message: str) -> dict[str, Any]:
    """An error message for one generation (or the connection when gen_id is None)."""
    return {"type": "error", "id": gen_id, "code": code, "message": message}


def token_frame(gen_id: str, text: str, n: int) -> dict[str, Any]:
    """A text delta; n = output tokens of this generation so far."""
    return {"type": "token", "id": gen_id, "text": text, "n": n}


@dataclass
class Trace:
    """What the bridge saw of one generation; monotonic ns, the server's clock where 'server'."""

    accepted_ns: int  # the generate frame was parsed
    upstream_ns: int = 0  # the request went to Triton
    first_chunk_ns: int | None = None
    first_out_ns: int | None = None  # the first token frame was queued for the client
    server_first: ServerTiming | None = None  # `timing` of the first response with tokens
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    relay_ns_total: int = 0  # summed chunk-received -> frame-queued time
    frames: int = 0

    def observe(self, chunk: Chunk, out_ns: int) -> None:
        """Account one chunk whose token frame was queued at out_ns."""
        tokens = chunk.tokens
        self.observe_prompt(chunk)
        if self.first_chunk_ns is None and tokens:
            self.first_chunk_ns, self.first_out_ns = chunk.received_ns, out_ns
            self.server_first = chunk.timing
        self.completion_tokens += tokens
        self.relay_ns_total += out_ns - chunk.received_ns
        self.frames += 1

    def observe_prompt(self, chunk: Chunk) -> None:
        """Keep the prompt's token count from the first response that carries it."""
        if chunk.num_input_tokens is not None and self.prompt_tokens is None:
            self.prompt_tokens = chunk.num_input_tokens


def done_frame(gen_id: str, finish_reason: str, trace: Trace, now_ns: int) -> dict[str, Any]:
    """The `done` message: finish reason, token usage, server and bridge timings in ms."""
    return {
        "type": "done",
        "id": gen_id,
        "finish_reason": finish_reason,
        "usage": {
            "prompt_tokens": trace.prompt_tokens,
            "completion_tokens": trace.completion_tokens,
        },
        "timing": {"server": _server_timing(trace), "bridge": _bridge_timing(trace, now_ns)},
    }


def _ms(later: int | None, earlier: int | None) -> float | None:
    return None if later is None or earlier is None else round((later - earlier) / 1e6, 3)


def _server_timing(trace: Trace) -> dict[str, Any]:
    """The first token's server stamps (raw ns, the server's clock) and the spans between."""
    t = trace.server_first
    if t is None:
        return {"queue_ms": None, "prefill_ms": None, "first_token_ms": None}
    spans = {
        "queue_ms": _ms(t.prefill_start_ns, t.queued_ns),
        "prefill_ms": _ms(t.emitted_ns, t.prefill_start_ns),
        "first_token_ms": _ms(t.emitted_ns, t.received_ns),
    }
    return spans | asdict(t)  # the raw stamps ride along for benchmarks


def _bridge_timing(trace: Trace, now_ns: int) -> dict[str, float | None]:
    t = trace.server_first
    # Server stamp -> bridge receipt, via wall clock so it also holds across machines.
    known = t is not None and t.wall_minus_monotonic_ns != 0  # 0: an older server sent none
    emitted_wall = t.emitted_ns + t.wall_minus_monotonic_ns if known else None
    first_wall = None
    if trace.first_chunk_ns is not None:
        first_wall = trace.first_chunk_ns + ServerTiming.wall_offset_ns()
    relay_mean = round(trace.relay_ns_total / trace.frames / 1e6, 3) if trace.frames else None
    return {
        "ttft_ms": _ms(trace.first_out_ns, trace.accepted_ns),
        "upstream_ttft_ms": _ms(trace.first_chunk_ns, trace.upstream_ns),
        "server_to_bridge_ms": _ms(first_wall, emitted_wall),
        "relay_mean_ms": relay_mean,
        "total_ms": _ms(now_ns, trace.accepted_ns),
    }
