"""The one client-side type of a model response: every transport (gRPC, SSE) yields Chunks, and
the terminal chat, the bridge and the benchmark consume them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """One response of a generation, as the client received it."""

    text: str
    num_output_tokens: int | None
    num_input_tokens: int | None
    output_ids: tuple[int, ...] | None
    finish_reason: str | None
    timing: Mapping[str, int] | None
    final: bool
    request_id: str
    received_ns: int  # time.monotonic_ns() when the response reached this process
