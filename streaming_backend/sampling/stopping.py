"""Stopping: stop strings held back while they might still match, and the (done, reason) rule."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from streaming_backend.events import FinishReason


class StopStringMatcher:
    """Buffers text that could be the start of a stop string; cuts the text at a match."""

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(stops)
        self._pending = ""
        self.matched = False

    def feed(self, text: str) -> str:
        """Add new text; return what is safe to emit. After a match, `matched` is True."""
        if not self._stops:
            return text
        self._pending += text
        cut = _first_match(self._pending, self._stops)
        if cut is not None:
            self.matched = True
            out, self._pending = self._pending[:cut], ""
            return out
        hold = _longest_partial_suffix(self._pending, self._stops)
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out) :]
        return out

    def flush(self) -> str:
        """At the end of a stream: release text held back for a match that never came."""
        out, self._pending = self._pending, ""
        return out


def _first_match(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string in `text` begins, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _longest_partial_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def check_stop(
    token_id: int,
    num_output_tokens: int,
    total_tokens: int,
    *,
    max_tokens: int,
    context_length: int,
    eos_ids: Collection[int],
    ignore_eos: bool,
    stop_matched: bool,
) -> tuple[bool, FinishReason | None]:
    """Whether a stream is done after its latest token, and why."""
    if stop_matched:
        return True, FinishReason.STOP
    if token_id in eos_ids and not ignore_eos:
        return True, FinishReason.STOP
    if num_output_tokens >= max_tokens or total_tokens >= context_length:
        return True, FinishReason.LENGTH
    return False, None
