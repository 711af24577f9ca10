"""Token events: what the engine hands out, one per token, the last with a finish reason."""

from __future__ import annotations

from dataclasses import dataclass

from streaming_backend.errors import StreamingError
from streaming_backend.wire import FinishReason

__all__ = ["FinishReason", "LogprobDetail", "TokenEvent", "TokenLogprob"]


@dataclass(frozen=True)
class TokenEvent:
    """One step of one stream: new text and token ids; the last one carries the finish reason."""

    request_id: str
    text: str  # the new text (a delta); never ends in half a UTF-8 character
    token_ids: tuple[int, ...]  # token ids generated at this step (empty on a cancel/error final)
    num_output_tokens: int  # output tokens so far, this step's included
    num_input_tokens: int
    submitted_ns: int  # time.monotonic_ns() when the request was submitted
    scheduled_ns: int  # when its prefill started (0 if it never started)
    emitted_ns: int  # when this event's token existed
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not recomputed)
    logprobs: tuple[float, ...] | None = None  # log-probability of each of token_ids, when asked
    logprob_details: tuple[LogprobDetail, ...] | None = None  # texts and top_logprobs, when asked
    finish_reason: FinishReason | None = None
    error: StreamingError | None = None

    @property
    def final(self) -> bool:
        """True on the stream's last event."""
        return self.finish_reason is not None


@dataclass(frozen=True)
class TokenLogprob:
    """A token's text and log-probability (the text alone may be part of a character)."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class LogprobDetail:
    """One generated token with its most likely alternatives (top_logprobs), best first."""

    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()
