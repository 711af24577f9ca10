"""Prefix reuse across requests: which KV cache slots hold which tokens, and what to evict first.

A stream holds one slot of the slot KV cache for its life. When it ends, its slot is not emptied:
it stays as an idle entry that holds the keys and values of its prompt and answer. A new request
looks for the slot, idle or still live, whose tokens share the longest prefix with its prompt and
starts from there, so a chat turn that resends the conversation prefills only the new turn.
Idle entries leave least recently used first, when a request needs a slot and none is free.

Matching is token-exact over whole sequences (a radix lookup done by comparison: the slots are
few, tens, and each comparison is a C-speed slice compare), so "Hello" typed as text, as
messages through the chat template or as token ids hits the same entry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# Shorter shared prefixes are not worth a slot copy (and would evict a better idle entry).
MIN_REUSE_TOKENS = 16


@dataclass(frozen=True)
class Match:
    """The slot sharing the longest prefix with a prompt."""

    slot: int
    length: int  # tokens shared with the prompt (their KV is in the slot)
    idle: bool  # True: an ended stream's slot (take it over); False: a live one (copy from it)


class PrefixCache:
    """Idle slots and the tokens their KV holds, least recently used first."""

    def __init__(self, min_reuse: int = MIN_REUSE_TOKENS):
        self.min_reuse = min_reuse
        self._idle: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # slot -> its tokens

    def __len__(self) -> int:
        return len(self._idle)

    def keep(self, slot: int, tokens: Sequence[int]) -> None:
        """An ended stream's slot holds the KV of `tokens`: keep it as the newest idle entry."""
        self._idle[slot] = tuple(tokens)
        self._idle.move_to_end(slot)

    def take(self, slot: int) -> None:
        """Remove an idle entry: its slot is reused by a new stream."""
        del self._idle[slot]

    def evict(self) -> int:
        """Remove the least recently used idle entry; return its slot (IndexError when none)."""
        if not self._idle:
            raise IndexError("no idle prefix cache entry to evict")
        slot, _ = self._idle.popitem(last=False)
        return slot

    def best(
        self,
        prompt: Sequence[int],
        live: Iterable[tuple[int, Sequence[int]]],
        usable: Callable[[int, int], int] | None = None,
    ) -> Match | None:
        """The slot sharing the longest prefix with `prompt` (at least min_reuse), else None.

        `live` gives (slot, tokens whose KV is written) of running streams. `usable(slot,
        shared)` says how many of a slot's `shared` tokens a new stream can start from (the
        cache's rule: SlotCache.reusable); without it, all. An idle entry wins a tie: taking
        it over needs no copy.
        """
        best: Match | None = None
        prompt = tuple(prompt)
        candidates = [(slot, tokens, True) for slot, tokens in self._idle.items()]
        candidates += [(slot, tuple(tokens), False) for slot, tokens in live]
        for slot, tokens, idle in candidates:
            length = common_prefix(prompt, tokens)
            if usable is not None:
                length = usable(slot, length)
            if length >= self.min_reuse and (best is None or length > best.length):
                best = Match(slot, length, idle)
        return best


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token tuples (binary search on slices)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
