"""How many prompt tokens a step prefills while other streams decode: sized in time, not tokens.

A prefill chunk delays every running stream by its own cost. A fixed token count costs a few
milliseconds on one machine and several decode steps on another (bf16 on a CPU without native
bf16, say), so `PrefillPacer` sizes the chunk to cost about one decode step of the running
batch. It keeps two moving averages from the steps the engine really runs, the seconds per
prefill token and the seconds per decode step, and starts from a calibration run at load. A
fixed `prefill_chunk_tokens` overrides it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

GRANULE = 16  # chunks are a multiple of this (few distinct shapes; no 1-token chunks)
SMOOTHING = 0.2  # weight of the newest observation in the moving averages
MIN_TIMED_TOKENS = 8  # smaller prefills are mostly fixed cost: they do not update the rate


@dataclass
class PrefillPacer:
    """The per-step prefill budget: about one decode step's time worth of prompt tokens."""

    fixed: int | None = None  # a set prefill_chunk_tokens: always this many
    ceiling: int = 4096  # never more than this (max_prefill_tokens)
    start: int = 64  # the budget until both rates are known
    seconds_per_token: float | None = None
    seconds_per_step: float | None = None

    def budget(self) -> int:
        """Prompt tokens the next step may prefill beside the running streams."""
        if self.fixed is not None:
            return self.fixed
        if self.seconds_per_token is None or self.seconds_per_step is None:
            return self.start
        tokens = self.seconds_per_step / self.seconds_per_token
        granules = max(1, int(tokens // GRANULE))
        return min(self.ceiling, granules * GRANULE)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of `tokens` prompt tokens took `seconds`."""
        if tokens >= MIN_TIMED_TOKENS and seconds > 0:
            self.seconds_per_token = _average(self.seconds_per_token, seconds / tokens)

    def observe_decode(self, seconds: float) -> None:
        """A decode step of the running batch took `seconds`."""
        if seconds > 0:
            self.seconds_per_step = _average(self.seconds_per_step, seconds)

    def describe(self) -> str:
        """One line for the log: how the budget is set now."""
        if self.fixed is not None:
            return f"prefill chunks of {self.fixed} tokens (fixed)"
        rates = ""
        if self.seconds_per_token is not None and self.seconds_per_step is not None:
            rates = (
                f": {self.seconds_per_token * 1e3:.3f} ms per prefill token, "
                f"{self.seconds_per_step * 1e3:.1f} ms per decode step"
            )
        return f"prefill chunks sized to one decode step, now {self.budget()} tokens{rates}"


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


def timed(run: Callable[[], object], sync: Callable[[], None]) -> tuple[object, float]:
    """(result, seconds) of `run()`, with the device's queued work included (`sync`)."""
    begin = time.perf_counter()
    result = run()
    sync()
    return result, time.perf_counter() - begin
