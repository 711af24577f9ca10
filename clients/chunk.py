"""The one client-side type of a model response: every transport (gRPC, SSE, the bridge's
frames) yields Chunks, and the terminal chat, the bridge and the benchmark consume them.
"""

from __future__ import annotations

from dataclasses import dataclass

from streaming_backend.wire import INTERNAL, TIMING_KEYS, ServerTiming


class ChunkTiming(ServerTiming):
    """wire.ServerTiming that also reads as a mapping of its fields (`dict(timing)`).

    Transitional: code written for the former dict form (the bridge's trace) keeps working; new
    code reads the attributes. Remove once no reader treats a Chunk's timing as a dict.
    """

    def keys(self) -> tuple[str, ...]:
        """The field names, as a mapping's keys."""
        return TIMING_KEYS

    def __getitem__(self, key: str) -> int:
        if key not in TIMING_KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __eq__(self, other: object) -> bool:
        """Equal to a ServerTiming with the same stamps (the subclass adds no state)."""
        if not isinstance(other, ServerTiming):
            return NotImplemented
        return all(self[k] == getattr(other, k) for k in TIMING_KEYS)

    __hash__ = ServerTiming.__hash__


def parse_timing(value) -> ChunkTiming | None:
    """A Chunk's timing from the TIMING output's text (or its decoded object); None if absent."""
    return ChunkTiming.from_json(value)


@dataclass(frozen=True)
class Chunk:
    """One response of a generation, as the client received it."""

    text: str
    num_output_tokens: int | None  # the server's count for this response, when it sent one
    num_input_tokens: int | None
    output_ids: tuple[int, ...] | None
    finish_reason: str | None
    timing: ServerTiming | None  # the server's stamps of this response (return_timing)
    final: bool
    request_id: str
    received_ns: int  # time.monotonic_ns() when the response reached this process

    @property
    def tokens(self) -> int:
        """Tokens this response carries: the server's count, else 1 if it has text, else 0."""
        if self.num_output_tokens is not None:
            return self.num_output_tokens
        return 1 if self.text else 0


class GenerationError(Exception):
    """A generation failed; `code` is a category (wire.ERROR_CODES), the message the server's."""

    def __init__(self, message: str, code: str = INTERNAL.code) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
