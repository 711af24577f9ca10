"""The client-side response type (clients/library/chunk.py): its token-count rule and timing."""

from __future__ import annotations

import pytest

from clients.library.chunk import Chunk, parse_timing
from streaming_backend.wire import ServerTiming


def chunk(text: str, n: int | None) -> Chunk:
    return Chunk.delta(text, n, 0, request_id="r")


@pytest.mark.parametrize(
    ("text", "n", "tokens"),
    [("a", 3, 3), ("", 1, 1), ("", 0, 0), ("ab", None, 1), ("", None, 0)],
)
def test_token_count_rule(text, n, tokens):
    """The server's count when it sent one; else a response with text is one token."""
    assert chunk(text, n).tokens == tokens


def test_timing_parses_to_the_wire_record():
    """A chunk's timing is the wire.ServerTiming the server sent; absent timing is None."""
    t = parse_timing(ServerTiming(1, 2, 3, 4, 5).to_json())
    assert t == ServerTiming(1, 2, 3, 4, 5)
    assert parse_timing(None) is None and parse_timing("") is None
