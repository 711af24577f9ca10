"""scripts/speculation_bench.py's measure of what copies: the share of an answer's tokens that lie
in a run of 4 tokens its prompt holds too, and the sets' figures summed from their groups."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "answer, share",
    [
        ([3, 4, 5, 6, 7], 1.0),  # all of it a run of the prompt
        ([1, 2, 3, 4, 50, 51, 52, 7, 8, 9, 10], 8 / 11),  # two runs of 4, 3 tokens of its own
        ([5, 6, 7, 60, 61, 62, 63], 0.0),  # a run of 3 is not a copy
        ([4, 3, 2, 1], 0.0),  # the prompt's tokens in another order
        ([], 0.0),
    ],
)
def test_the_copied_share_counts_tokens_in_runs_of_four_the_prompt_holds(
    load_script, answer, share
):
    script = load_script("speculation_bench")
    prompt = list(range(1, 11))
    assert script.copied_fraction(answer, prompt) == pytest.approx(share)


def test_a_sets_figures_are_its_groups_summed(load_script):
    """The `copying` line sums the chosen groups' tallies, identical counts and pairs."""
    script = load_script("speculation_bench")
    a = script.Group(script.Tally(10, 1.0, 9, 0.9), script.Tally(10, 0.5, 9, 0.4), 2, 2, [2.0])
    b = script.Group(script.Tally(20, 2.0, 19, 1.9), script.Tally(20, 1.0, 19, 0.8), 1, 2, [2.5])
    plain, spec, same, total, pairs = script.combined([a, b])
    assert (plain.tokens, plain.seconds, plain.decoded) == (30, 3.0, 28)
    assert spec.decode_seconds == pytest.approx(1.2)
    assert (same, total, pairs) == (3, 4, [2.0, 2.5])
