"""Tests for streaming_backend/steps/__init__.py: the admission the engine and the dialogue
model share."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from streaming_backend.steps import admission


@dataclass
class FakeSteps:
    """What admission reads of the steps: their free rows and their prompt-token cap."""

    free: int
    prompt_tokens_per_step: int | None

    def capacity(self) -> int:
        return self.free


@pytest.mark.parametrize(
    "free, cap, waiting, reserved, admitted",
    [
        (4, None, [(1, 500)] * 6, 0, 4),  # chunked prefill (no cap): as many as rows are free
        (0, None, [(1, 5)], 0, 0),  # no free row: none
        (4, 100, [(1, 40), (1, 50), (1, 20)], 0, 2),  # the third would pass the cap
        (4, 100, [(1, 40), (1, 60), (1, 1)], 0, 2),  # exactly the cap is within it
        (4, 100, [(1, 300), (1, 1)], 0, 1),  # the first goes whatever its length, alone
        (4, 100, [(1, 90), (1, 20), (1, 5)], 0, 1),  # in order: a short one does not jump ahead
        (5, None, [(2, 5), (3, 5), (1, 5)], 0, 2),  # beams: each takes all its rows
        (5, None, [(2, 5), (4, 5), (1, 5)], 0, 1),  # the next one's rows do not fit: it waits
        (5, None, [(3, 5), (1, 5)], 3, 0),  # rows kept for unforked beams are not free
        (5, None, [(3, 5), (1, 5)], 2, 1),
        (1, None, [(2, 5)], 0, 0),  # too wide for the steps: none (the caller says why)
        (4, None, [], 0, 0),  # nothing waiting
    ],
)
def test_admission_takes_the_waiting_in_order_while_rows_and_the_cap_allow(
    free, cap, waiting, reserved, admitted
):
    """Waiting requests, (rows, prompt tokens) each, are admitted from the front while the steps
    have room for all of the next one's rows (their capacity less what is reserved) and, under a
    prompt-token cap, while the sum stays within it; the first goes whatever its length."""
    assert admission(FakeSteps(free, cap), waiting, reserved) == admitted


def test_admission_reads_the_queue_only_as_far_as_it_admits():
    """It stops reading at the first request that stays, so a long queue costs nothing more."""
    read = []

    def queue():
        for size in (10, 10, 10, 10, 10):
            read.append(size)
            yield 1, size

    assert admission(FakeSteps(2, None), queue()) == 2
    assert len(read) == 3
