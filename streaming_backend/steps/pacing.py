"""How many prompt tokens a step prefills while other streams decode: sized in time, not tokens.

A prefill chunk delays every running stream by its own cost. A fixed token count costs a few
milliseconds on one machine and several decode steps on another (bf16 on a CPU without native
bf16, say), so `PrefillPacer` sizes the chunk so that its tokens cost about one decode step of
the running batch. A prefill pass costs a fixed part (every layer's weights read once, a few
hundred small operations) plus a part per token; only the per-token part grows with the chunk,
so the budget is one decode step divided by the per-token cost: the slope of the prefill time
over its token count, fitted over the recent prefills (exponentially weighted least squares)
after a calibration at load with two chunk sizes. Dividing by the average cost per token
instead would count the fixed part against every token and shrink the chunks until prompts
barely advance (measured: 16-token chunks and 0.56x the throughput of 64-token ones). The decode
step's time is a moving average of the steps the engine runs. A fixed `prefill_chunk_tokens`
overrides all this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

GRANULE = 16  # chunks are a multiple of this (few distinct shapes; no 1-token chunks)
SMOOTHING = 0.2  # weight of the newest decode step in its moving average
FORGET = 0.05  # weight of the newest prefill in the fit of its per-token cost
MIN_SPREAD = 8.0  # tokens: the fit needs prefills of different sizes to tell slope from fixed cost


@dataclass
class PrefillPacer:
    """The per-step prefill budget: about one decode step's time worth of prompt tokens."""

    fixed: int | None = None  # a set prefill_chunk_tokens: always this many
    ceiling: int = 4096  # never more than this (max_prefill_tokens)
    start: int = 64  # the budget until both costs are known
    seconds_per_token: float | None = None  # the marginal cost of a prefill token (the slope)
    seconds_per_step: float | None = None
    # exponentially weighted sums over recent prefills (tokens x, seconds y) for the slope
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def budget(self) -> int:
        """Prompt tokens the next step may prefill beside the running streams."""
        if self.fixed is not None:
            return self.fixed
        if self.seconds_per_token is None or self.seconds_per_step is None:
            return self.start
        tokens = self.seconds_per_step / self.seconds_per_token
        granules = max(1, int(tokens / GRANULE + 1e-6))  # 79.9999 tokens of rounding: 80
        return min(self.ceiling, granules * GRANULE)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of `tokens` prompt tokens took `seconds`: refit the per-token cost."""
        if tokens < 1 or seconds <= 0:
            return
        keep = 1 - FORGET
        self._w = keep * self._w + 1
        self._x = keep * self._x + tokens
        self._y = keep * self._y + seconds
        self._xx = keep * self._xx + tokens * tokens
        self._xy = keep * self._xy + tokens * seconds
        spread = self._w * self._xx - self._x * self._x  # w^2 x the tokens' variance
        if spread > (MIN_SPREAD * self._w) ** 2:
            slope = (self._w * self._xy - self._x * self._y) / spread
            if slope > 0:  # noise can tilt a fit over sizes close together: keep the last one
                self.seconds_per_token = slope

    def bound_per_token(self, tokens: int, seconds: float) -> None:
        """No fit yet: a prefill of `tokens` took `seconds`, so a token's marginal cost is at
        most their average (the fixed part counted in). It stands, a conservative budget,
        until the fit over later prefills finds a positive slope."""
        if self.seconds_per_token is None and tokens >= 1 and seconds > 0:
            self.seconds_per_token = seconds / tokens

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
