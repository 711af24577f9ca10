"""Stop strings across token boundaries, and the (done, reason) rule as a table."""

import pytest

from streaming_backend.events import FinishReason
from streaming_backend.sampling.stopping import StopStringMatcher, check_stop


def _run(stops, pieces):
    matcher = StopStringMatcher(stops)
    out = []
    for piece in pieces:
        out.append(matcher.feed(piece))
        if matcher.matched:
            return out, True
    out.append(matcher.flush())
    return out, False


@pytest.mark.parametrize(
    "stops, pieces, emitted, matched",
    [
        ((), ["a", "b"], ["a", "b", ""], False),
        (("END",), ["hello ", "E", "N", "D", "tail"], ["hello ", "", "", ""], True),
        (("END",), ["hello E", "ND"], ["hello ", ""], True),
        (("END",), ["x EN", "d"], ["x ", "ENd", ""], False),  # a false start is released
        (("END",), ["abc"], ["abc", ""], False),
        (("\n\n",), ["line\n", "\nnext"], ["line", ""], True),
        (("ab", "b c"), ["xa", "b c"], ["x", ""], True),  # earliest match wins: "ab"
        (("###",), ["# ", "##", " ok"], ["# ", "", "## ok", ""], False),
        (("停止",), ["好的", "停", "止了"], ["好的", "", ""], True),
        (("🌊",), ["sea ", "🌊", "!"], ["sea ", ""], True),
    ],
)
def test_stop_string_matcher(stops, pieces, emitted, matched):
    """Text that might begin a stop string is held back; a match cuts the text before it."""
    assert _run(stops, pieces) == (emitted, matched)


def test_text_after_the_stop_in_the_same_piece_is_dropped():
    """Only the text before the stop string is emitted."""
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("keep STOP drop") == "keep " and matcher.matched


EOS = {2}


@pytest.mark.parametrize(
    "token, n_out, total, max_tokens, ignore_eos, stop_matched, expected",
    [
        (5, 1, 10, 8, False, False, (False, None)),
        (2, 1, 10, 8, False, False, (True, FinishReason.STOP)),
        (2, 1, 10, 8, True, False, (False, None)),  # ignore_eos goes on
        (5, 8, 10, 8, False, False, (True, FinishReason.LENGTH)),
        (2, 8, 10, 8, True, False, (True, FinishReason.LENGTH)),
        (5, 3, 64, 8, False, False, (True, FinishReason.LENGTH)),  # context full
        (5, 3, 10, 8, False, True, (True, FinishReason.STOP)),
        (2, 8, 10, 8, False, False, (True, FinishReason.STOP)),  # EOS beats length
    ],
)
def test_check_stop(token, n_out, total, max_tokens, ignore_eos, stop_matched, expected):
    """(done, reason) for EOS, max_tokens, the context and stop strings."""
    assert (
        check_stop(
            token,
            n_out,
            total,
            max_tokens=max_tokens,
            context_length=64,
            eos_ids=EOS,
            ignore_eos=ignore_eos,
            stop_matched=stop_matched,
        )
        == expected
    )
