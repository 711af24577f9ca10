"""Speculative decoding's drafts, taken from the context (n-gram / prompt lookup), and how
long each stream's drafts are (a draft model's too: steps/draft_model.py).

A stream's newest tokens are looked up in its own context (its prompt and its answer so far);
the tokens that followed their latest earlier occurrence are proposed as its next tokens. The
steps verify them as rows of the running batch (steps/slots.py) and the engine keeps a drafted
token only while it equals the token plain decoding chooses at its position, so drafts change
how fast an answer comes, never the answer.

Each stream's `Drafter` adapts its draft length to how many of its recent drafts were accepted,
and stops drafting for a while (longer each time) once its drafts stop paying: a verified draft
costs its rows in the step whether it is accepted or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# --speculative; auto: what measured faster (docs/configuration.md); draft: a draft model's
# drafts (steps/draft_model.py, --draft-model)
MODES = ("auto", "off", "ngram", "draft")

NGRAM_SIZES = (3, 2)  # the suffix lengths looked up, longest first: a 1-token match guesses badly
FIRST_DRAFT = 4  # tokens drafted at first; then as acceptance says, within [1, MAX_DRAFT]
MAX_DRAFT = 8
# A stream whose recent drafts were accepted less than this fraction of the time stops drafting
# for PAUSE_STEPS steps, twice as long each time it happens again (at most MAX_PAUSE_STEPS)
PAYING_RATE = 0.25
PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 256
RATE_WEIGHT = 0.3  # the weight of the latest draft in the acceptance rate's moving average
# At most this many decoding rows draft in one step: beyond it the batch already reads the
# weights for many tokens, and verifying drafts would only add rows (a full batch: none)
MAX_DRAFTING_ROWS = 4


class NgramIndex:
    """Where each n-gram of a growing token sequence last occurred, with a token after it."""

    def __init__(self, sizes: Sequence[int] = NGRAM_SIZES):
        self.sizes = tuple(sorted(sizes, reverse=True))
        self.tokens: list[int] = []
        # per size: n-gram -> the index of the token that followed its latest occurrence
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens, indexing the n-grams that now have a token after them."""
        for token in tokens:
            at = len(self.tokens)
            for n, after in self._after.items():
                if at >= n:
                    after[tuple(self.tokens[at - n : at])] = at
            self.tokens.append(token)

    def propose(self, count: int) -> list[int]:
        """`count` tokens that followed the latest earlier occurrence of the sequence's longest
        indexed suffix; [] when no suffix occurred before. Where that continuation reaches the
        end of the sequence (the suffix recurs every p = end - at tokens: a loop, a repeated
        line), it goes on around the same p tokens, as the text would if it kept repeating:
        a loop's drafts are as long as any, not p tokens."""
        if count <= 0:
            return []
        end = len(self.tokens)
        for n, after in self._after.items():
            if end < n:
                continue
            at = after.get(tuple(self.tokens[end - n :]))
            if at is not None:
                period = end - at
                return [self.tokens[at + i % period] for i in range(count)]
        return []


@dataclass
class DraftCounts:
    """Drafted and accepted tokens, summed (for /status and the metrics)."""

    drafted: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        """accepted / drafted (0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0


class Drafter:
    """One stream's drafts: how many tokens to draft (learnt from what was accepted) and, from
    the context, which (`propose`); a draft model's drafter asks `budget` and tells `drafted`."""

    def __init__(self, counts: DraftCounts, from_context: bool = True):
        self.counts = counts  # shared by the streams of one engine
        self.index = NgramIndex() if from_context else None  # None: a draft model drafts
        self.length = FIRST_DRAFT
        self.rate = 1.0  # moving average of the accepted fraction of its drafts
        self.pause = 0  # steps left without drafts
        self._pauses = 0  # times it paused: each pause is twice the last
        self._last: list[int] = []  # the latest draft, until its outcome is seen
        self._seen = 0  # context tokens when it was proposed

    def propose(self, prompt: Sequence[int], output: Sequence[int], room: int) -> list[int]:
        """The next draft of a stream whose context is `prompt` then `output`, at most `room`
        tokens; [] while paused or when nothing matches."""
        count = self.budget(prompt, output, room)
        draft = self.index.propose(count) if count else []
        self.drafted(draft, output)
        return draft

    def budget(self, prompt: Sequence[int], output: Sequence[int], room: int) -> int:
        """How many tokens to draft now, at most `room` (0 while paused); the outcome of the
        last draft is scored first."""
        self.observe(prompt, output)
        if self.pause:
            self.pause -= 1
            return 0
        return max(0, min(self.length, room))

    def drafted(self, draft: Sequence[int], output: Sequence[int]) -> None:
        """The draft proposed after `output`, scored when the next tokens are seen."""
        self._last, self._seen = list(draft), len(output)

    def observe(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Index the tokens added since the last proposal; score the last draft by them."""
        if self.index is not None:
            known = len(self.index.tokens)
            if known < len(prompt):
                self.index.extend(prompt[known:])
                known = len(prompt)
            self.index.extend(output[known - len(prompt) :])
        if not self._last:
            return
        accepted = 0
        for drafted, token in zip(self._last, output[self._seen :]):
            if drafted != token:
                break
            accepted += 1
        self.counts.drafted += len(self._last)
        self.counts.accepted += accepted
        self._adapt(len(self._last), accepted)
        self._last = []

    def _adapt(self, drafted: int, accepted: int) -> None:
        """Longer drafts after a wholly accepted one, shorter after a rejection; a pause once
        the acceptance rate falls below PAYING_RATE."""
        if accepted == drafted:
            self.length = min(MAX_DRAFT, self.length + 2)
        else:
            self.length = max(1, accepted + 1)
        self.rate += RATE_WEIGHT * (accepted / drafted - self.rate)
        if self.rate < PAYING_RATE:
            self.pause = min(MAX_PAUSE_STEPS, PAUSE_STEPS << self._pauses)
            self._pauses += 1
            self.rate = PAYING_RATE * 2  # after the pause it gets a few drafts to show itself


def resolve_mode(mode: str, device: str) -> str:
    """What `--speculative` runs on a device kind: off, ngram or draft (auto: AUTO's choice)."""
    if mode not in MODES:
        raise ValueError(f"speculative must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "auto":
        return AUTO.get(device, "off")
    return mode


# auto's choice per device kind: what measured faster (docs/configuration.md, 2026-12-05: the
# default model on a 2-core Intel Xeon, scripts/speculation_bench.py); off where nothing measured
AUTO: dict[str, str] = {"cpu": "ngram"}
