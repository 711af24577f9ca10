"""The client-side response type (clients/chunk.py): its token-count rule and timing."""

from __future__ import annotations

import pytest

from clients.chunk import Chunk, parse_timing
from streaming_backend.wire import TIMING_KEYS, ServerTiming


def chunk(text: str, n: int | None) -> Chunk:
    return Chunk(text, n, None, None, None, None, False, "r", 0)


@pytest.mark.parametrize(
    ("text", "n", "tokens"),
    [("a", 3, 3), ("", 1, 1), ("", 0, 0), ("ab", None, 1), ("", None, 0)],
)
def test_token_count_rule(text, n, tokens):
    """The server's count when it sent one; else a response with text is one token."""
    assert chunk(text, n).tokens == tokens


def test_timing_parses_to_the_wire_record_and_reads_as_a_mapping():
    """A chunk's timing is a wire.ServerTiming that also reads as a dict of its fields."""
    t = parse_timing(ServerTiming(1, 2, 3, 4, 5).to_json())
    assert isinstance(t, ServerTiming) and (t.received_ns, t.emitted_ns) == (1, 4)
    assert dict(t) == dict(zip(TIMING_KEYS, (1, 2, 3, 4, 5), strict=True))
    assert t["queued_ns"] == 2
    with pytest.raises(KeyError):
        t["clock"]
    assert parse_timing(None) is None and parse_timing("") is None
