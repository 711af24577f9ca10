"""The one client-side type of a model response: every transport (gRPC, SSE, the bridge's
frames) yields Chunks, and the terminal chat, the bridge and the benchmark consume them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from clients.library.aio import within
from streaming_backend.wire import INTERNAL, UNAVAILABLE, ServerTiming

# A generation that receives nothing for this long ends with an `unavailable` error instead of
# waiting forever (a server that lost the stream without closing it). Long enough for a request
# that queues behind a full engine on a CPU; callers with tighter needs pass their own. Every
# transport's client uses it (grpc_client, sse_client) and the bridge's upstream.
DEFAULT_IDLE_TIMEOUT_S = 120.0


def parse_logprobs(value) -> tuple[dict, ...] | None:
    """A Chunk's logprobs from the LOGPROBS output's JSON text (or its decoded list)."""
    if value is None or value == "" or value == b"":
        return None
    entries = json.loads(value) if isinstance(value, (str, bytes)) else value
    return tuple(entries)


def parse_timing(value) -> ServerTiming | None:
    """A Chunk's timing from the TIMING output's text (or its decoded object); None if absent."""
    return ServerTiming.from_json(value)


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """One response of a generation, as the client received it.

    Built with named arguments (a transport that reads every output tensor names them all), or
    through `delta` (text and its token count) and `last` (a closing response with counts only).
    """

    text: str = ""
    num_output_tokens: int | None = None  # the server's count for this response, when it sent one
    num_input_tokens: int | None = None
    output_ids: tuple[int, ...] | None = None
    finish_reason: str | None = None
    timing: ServerTiming | None = None  # the server's stamps of this response (return_timing)
    final: bool = False
    request_id: str = ""
    received_ns: int  # time.monotonic_ns() when the response reached this process
    # return_logprobs: per token {"token_id", "logprob", "token", "top_logprobs"?} (wire.LOGPROBS)
    logprobs: tuple[dict, ...] | None = None
    system_fingerprint: str | None = None  # return_system_fingerprint: the server's numerics

    @classmethod
    def delta(
        cls,
        text: str,
        tokens: int | None,
        received_ns: int,
        *,
        request_id: str = "",
        finish_reason: str | None = None,
        timing: ServerTiming | None = None,
        num_input_tokens: int | None = None,
        final: bool = False,
    ) -> Chunk:
        """A streamed response: new text and the tokens it took (None: the server sent no count)."""
        return cls(
            text=text,
            num_output_tokens=tokens,
            num_input_tokens=num_input_tokens,
            finish_reason=finish_reason,
            timing=timing,
            final=final,
            request_id=request_id,
            received_ns=received_ns,
        )

    @classmethod
    def last(
        cls,
        tokens: int,
        received_ns: int,
        *,
        prompt_tokens: int | None = None,
        finish_reason: str | None = None,
        request_id: str = "",
    ) -> Chunk:
        """The closing response of a transport that ends with counts only (the bridge's `done`
        frame, OpenAI's usage event): no text, the tokens not yet counted, final."""
        return cls(
            num_output_tokens=tokens,
            num_input_tokens=prompt_tokens,
            finish_reason=finish_reason,
            final=True,
            request_id=request_id,
            received_ns=received_ns,
        )

    @property
    def tokens(self) -> int:
        """Tokens this response carries: the server's count, else 1 if it has text, else 0."""
        if self.num_output_tokens is not None:
            return self.num_output_tokens
        return 1 if self.text else 0


class GenerationError(Exception):
    """A generation failed; `code` is a category (wire.ERROR_CODES), the message the server's."""

    def __init__(self, message: str, code: str = INTERNAL.code, retryable: bool = True) -> None:
        """`retryable` False: failover must not retry it (e.g. an idle timeout: the request may
        still be queued on a busy server, and a retry would only add to its load)."""
        super().__init__(message)
        self.message = message
        self.code = code
        self.retryable = retryable


def idle_error(seconds: float) -> GenerationError:
    """The error of a generation that received nothing for `seconds`."""
    text = f"{UNAVAILABLE.prefix}: no response from the server for {seconds:g} s; gave up"
    return GenerationError(text, UNAVAILABLE.code, retryable=False)


async def within_idle_timeout(awaitable, idle_timeout_s: float | None):
    """Await one step of a stream (its headers, its next line) for at most `idle_timeout_s`
    (None: no limit); idle_error when nothing came in time."""
    try:
        return await within(awaitable, idle_timeout_s)
    except TimeoutError:
        raise idle_error(idle_timeout_s) from None
