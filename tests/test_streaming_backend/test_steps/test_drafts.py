"""Drafts from the context: the latest earlier occurrence of the newest tokens proposes what
followed it; the draft length follows acceptance, and a stream whose drafts stop paying pauses."""

from __future__ import annotations

import pytest

from streaming_backend.steps import drafts
from streaming_backend.steps.drafts import DraftCounts, Drafter, NgramIndex


def _index(tokens) -> NgramIndex:
    index = NgramIndex()
    index.extend(tokens)
    return index


@pytest.mark.parametrize(
    "tokens, count, proposed",
    [
        ([1, 2, 3, 4, 5, 9, 2, 3], 3, [4, 5, 9]),  # "2 3" seen before: what followed it
        # past the end of the context, around the 5 tokens since "2 3" recurred
        ([1, 2, 3, 4, 5, 9, 2, 3], 10, [4, 5, 9, 2, 3, 4, 5, 9, 2, 3]),
        ([8, 1, 2, 1, 2], 5, [1, 2, 1, 2, 1]),  # a loop of two: drafts as long as asked
        ([7, 2, 3, 4, 8, 2, 3, 5, 1, 2, 3], 2, [5, 1]),  # the latest occurrence wins
        ([1, 2, 3, 4, 6, 2, 3, 5, 9, 2, 3, 4], 2, [6, 2]),  # the longest suffix first: "2 3 4"
        ([1, 2, 3, 4, 5], 3, []),  # no suffix occurred before
        ([5, 5], 4, []),  # one token alone is no match
        ([1, 2, 1, 2], 0, []),
    ],
)
def test_a_suffix_seen_before_proposes_what_followed_it(tokens, count, proposed):
    """The table: the newest 3 or 2 tokens looked up, longest first, latest occurrence; a
    continuation that reaches the end goes around again."""
    assert _index(tokens).propose(count) == proposed


def test_growing_the_index_gives_what_indexing_at_once_gives():
    """Extending token by token indexes the same n-grams as extending once."""
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 9, 2, 6, 5, 3, 1, 4]
    whole = _index(tokens)
    grown = NgramIndex()
    for token in tokens:
        grown.extend([token])
    assert grown.tokens == whole.tokens
    assert all(grown.propose(k) == whole.propose(k) for k in range(1, 8))


def _accept(drafter: Drafter, prompt, output, accepted: int) -> list[int]:
    """Propose, then extend `output` with the first `accepted` drafted tokens and a wrong one
    (or all and one more when accepted == len(draft))."""
    draft = drafter.propose(prompt, output, room=20)
    output.extend(draft[:accepted])
    output.append(-1)
    drafter.observe(prompt, output)
    return draft


def test_lengths_follow_acceptance_and_counts_add_up():
    """A wholly accepted draft lengthens the next by 2 (up to MAX_DRAFT); a rejected one
    shortens it to what was accepted plus one; drafted and accepted are counted."""
    counts = DraftCounts()
    drafter = Drafter(counts)
    prompt = list(range(100, 140)) * 2 + [100, 101]
    output: list[int] = []
    draft = _accept(drafter, prompt, output, accepted=4)
    assert len(draft) == drafts.FIRST_DRAFT
    assert drafter.length == drafts.FIRST_DRAFT + 2
    output.clear()  # the context grows by the prompt alone again: the same match
    drafter = Drafter(counts)
    draft = _accept(drafter, prompt, output, accepted=1)
    assert drafter.length == 2
    assert (counts.drafted, counts.accepted) == (8, 5)
    assert counts.rate == 5 / 8


def test_a_stream_whose_drafts_are_rejected_pauses_longer_each_time():
    """Drafts rejected at their first token bring the rate under PAYING_RATE: no drafts for
    PAUSE_STEPS proposals, then twice as many after the next such run. The context "A B x"
    with a new x each time: "A B" always matches, what followed it never comes again."""
    drafter = Drafter(DraftCounts())
    prompt = [1, 2, 500, 1, 2, 501]
    output: list[int] = []
    pauses = []
    for x in range(600, 660):
        for token in (1, 2, x):
            drafter.propose(prompt, output, room=20)
            pauses.append(drafter.pause)
            output.append(token)
    started = [p for before, p in zip([0, *pauses], pauses) if p > before]
    assert started[:2] == [drafts.PAUSE_STEPS - 1, 2 * drafts.PAUSE_STEPS - 1]
    assert drafter.counts.drafted > 0 and drafter.counts.accepted == 0


def test_room_bounds_the_draft():
    """A stream near its max_tokens or its slot's end drafts at most `room` tokens."""
    drafter = Drafter(DraftCounts())
    prompt = list(range(100, 120)) * 3
    assert len(drafter.propose(prompt, [], room=2)) == 2
    assert drafter.propose(prompt, [], room=0) == []
