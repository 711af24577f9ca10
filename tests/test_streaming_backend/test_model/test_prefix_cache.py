"""The prefix cache's bookkeeping: longest shared prefix, idle entries least recently used first."""

from __future__ import annotations

import pytest

from streaming_backend.model.prefix_cache import Match, PrefixCache, common_prefix


@pytest.mark.parametrize(
    "a, b, length",
    [
        ((), (), 0),
        ((1, 2, 3), (), 0),
        ((1, 2, 3), (1, 2, 3), 3),
        ((1, 2, 3), (1, 2, 3, 4), 3),
        ((1, 2, 3, 4), (1, 2, 9, 4), 2),
        ((5,), (6,), 0),
        (tuple(range(1000)), tuple(range(999)) + (7,), 999),
        (tuple(range(1000)), (0, 1) + tuple(range(5, 1000)), 2),
    ],
)
def test_common_prefix(a, b, length):
    """The length of the longest common prefix, whatever the lengths and where they differ."""
    assert common_prefix(a, b) == length == common_prefix(b, a)


def test_best_match_is_the_longest_shared_prefix():
    """Of idle and live slots, the one sharing most tokens wins; below min_reuse nothing does."""
    cache = PrefixCache(min_reuse=3)
    cache.keep(0, [1, 2, 3, 4])
    cache.keep(1, [1, 2, 3, 4, 5, 6])
    prompt = [1, 2, 3, 4, 5, 9]
    assert cache.best(prompt, live=[]) == Match(slot=1, length=5, idle=True)
    assert cache.best(prompt, live=[(7, [1, 2, 3, 4, 5, 9, 9])]) == Match(7, 6, idle=False)
    assert cache.best([1, 2, 8], live=[]) is None  # 2 shared tokens < min_reuse


def test_what_a_slot_can_give_decides_the_match():
    """`usable` (the KV cache's rule: a ring may have overwritten a prefix's window) cuts what a
    slot offers; the longest usable prefix wins, and one cut below min_reuse counts for nothing."""
    cache = PrefixCache(min_reuse=3)
    cache.keep(0, [1, 2, 3, 4, 5, 6])
    cache.keep(1, [1, 2, 3, 4])
    prompt = [1, 2, 3, 4, 5, 9]
    ring_gone = {0: 0}  # slot 0 can give nothing
    usable = lambda slot, shared: ring_gone.get(slot, shared)  # noqa: E731
    assert cache.best(prompt, live=[], usable=usable) == Match(slot=1, length=4, idle=True)
    assert cache.best(prompt, live=[], usable=lambda slot, shared: 2) is None


def test_an_idle_entry_wins_a_tie():
    """Taking over an idle slot needs no copy: it is preferred to an equally long live one."""
    cache = PrefixCache(min_reuse=1)
    cache.keep(3, [1, 2, 3])
    assert cache.best([1, 2, 3, 4], live=[(0, [1, 2, 3])]) == Match(3, 3, idle=True)


def test_idle_entries_leave_least_recently_used_first():
    """evict() returns the oldest kept slot; keeping a slot again makes it the newest."""
    cache = PrefixCache()
    for slot in (4, 5, 6):
        cache.keep(slot, [slot])
    cache.keep(4, [4, 4])  # used again
    assert [cache.evict(), cache.evict(), cache.evict()] == [5, 6, 4]
    with pytest.raises(IndexError):
        cache.evict()


def test_a_taken_entry_is_no_longer_matched():
    """take() removes an idle entry (a new stream now owns that slot)."""
    cache = PrefixCache(min_reuse=1)
    cache.keep(2, [1, 2, 3])
    cache.take(2)
    assert len(cache) == 0 and cache.best([1, 2, 3], live=[]) is None
