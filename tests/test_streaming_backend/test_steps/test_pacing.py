"""Tests for streaming_backend/steps/pacing.py: prefill chunks sized in time."""

from __future__ import annotations

import pytest

from streaming_backend.steps.pacing import GRANULE, PrefillPacer


def paced(ms_per_token: float, ms_per_step: float, fixed_ms: float = 20.0, **kwargs):
    """A pacer that saw prefills of 32 and 160 tokens (a fixed cost plus a cost per token) and
    one decode step."""
    pacer = PrefillPacer(**kwargs)
    for tokens in (32, 160):
        pacer.observe_prefill(tokens, (fixed_ms + tokens * ms_per_token) / 1e3)
    pacer.observe_decode(ms_per_step / 1e3)
    return pacer


@pytest.mark.parametrize(
    "ms_per_token, ms_per_step, budget",
    [
        (0.5, 40.0, 80),  # 80 tokens cost one step
        (2.0, 40.0, 16),  # slow prefill (bf16 without native bf16): a small chunk
        (0.05, 40.0, 800),  # fast prefill (a GPU): a large chunk
        (5.0, 1.0, GRANULE),  # never below one granule
        (0.001, 1000.0, 4096),  # never above the ceiling
        (0.5, 47.0, 80),  # rounded down to a granule: 94 tokens -> 80
    ],
)
def test_budget_is_one_decode_steps_time_of_prefill(ms_per_token, ms_per_step, budget):
    """The chunk costs about one decode step, in granules, within [granule, ceiling]."""
    assert paced(ms_per_token, ms_per_step).budget() == budget


def test_a_fixed_chunk_overrides_the_measurements():
    """prefill_chunk_tokens set: always that many, whatever was measured."""
    assert paced(0.5, 40.0, fixed=24).budget() == 24
    assert "fixed" in paced(0.5, 40.0, fixed=24).describe()


def test_until_measured_the_start_budget_holds():
    """Before both rates are known (no calibration, no steps yet) the start value is used."""
    pacer = PrefillPacer(start=64)
    assert pacer.budget() == 64
    pacer.observe_decode(0.04)
    assert pacer.budget() == 64


def test_the_fixed_cost_of_a_prefill_does_not_shrink_the_chunk():
    """A prefill pass costs as much as a decode step before its first token: the budget follows
    the cost per token (the slope), not the average cost per token, which would count the fixed
    part against every token and keep chunks at their smallest."""
    pacer = paced(0.5, 40.0, fixed_ms=40.0)
    assert pacer.seconds_per_token == pytest.approx(0.5e-3)
    assert pacer.budget() == 80
    for _ in range(30):  # the engine then prefills 80-token chunks: the slope stays known
        pacer.observe_prefill(80, (40.0 + 80 * 0.5) / 1e3)
    assert pacer.budget() == 80


def test_one_chunk_size_alone_does_not_give_a_slope():
    """Prefills of a single size cannot tell fixed from per-token cost: no rate until sizes
    differ, so the start budget holds."""
    pacer = PrefillPacer(start=48)
    for _ in range(5):
        pacer.observe_prefill(64, 0.05)
    pacer.observe_decode(0.04)
    assert pacer.seconds_per_token is None and pacer.budget() == 48


def test_the_budget_follows_the_running_batch():
    """As the decode step grows (more streams), the chunk grows with it; smoothed, not jumped."""
    pacer = paced(0.5, 10.0)
    assert pacer.budget() == 16
    pacer.observe_decode(0.08)
    assert 16 < pacer.budget() < 160  # one slow step moves it part of the way
    for _ in range(40):
        pacer.observe_decode(0.08)
    assert pacer.budget() == 144  # 159.9 tokens, in granules


def test_a_bound_stands_in_until_the_fit_finds_a_slope():
    """Calibration that found no positive slope (the per-token cost below the timer's noise)
    bounds the cost by a prefill's average; a fitted slope replaces it, a bound never
    replaces a fit."""
    pacer = PrefillPacer()
    pacer.observe_prefill(32, 0.010)
    pacer.observe_prefill(160, 0.009)  # noise: the larger chunk ran faster
    assert pacer.seconds_per_token is None
    pacer.bound_per_token(160, 0.008)
    pacer.observe_decode(0.008)
    assert pacer.seconds_per_token == pytest.approx(0.05e-3) and pacer.budget() == 160
    for _ in range(10):  # the steps' own prefills: 1 ms fixed, 0.1 ms a token
        for tokens in (16, 160):
            pacer.observe_prefill(tokens, (1.0 + 0.1 * tokens) / 1e3)
    assert pacer.seconds_per_token == pytest.approx(0.1e-3, rel=0.05)
    pacer.bound_per_token(160, 0.001)
    assert pacer.seconds_per_token == pytest.approx(0.1e-3, rel=0.05)
