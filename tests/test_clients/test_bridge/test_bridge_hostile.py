"""The bridge's frame parser against hostile frames the chaos suite found crashing a handler."""

from __future__ import annotations

import pytest

from clients.bridge.messages import ProtocolError, parse_message


def test_deep_json_frame_is_a_bad_frame():
    """A frame nested 100,000 deep is answered `bad_frame`; it does not kill the connection."""
    with pytest.raises(ProtocolError) as refused:
        parse_message("[" * 100_000 + "]" * 100_000)
    assert refused.value.code == "bad_frame"
