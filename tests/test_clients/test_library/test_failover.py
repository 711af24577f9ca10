"""Tests of clients/library/failover.py: a generation that fails as unavailable before its first
response is tried again; anything else, or any failure after a response, is raised as is.
(The real thing, against replicas that stop, is in test_scale_out.py.)"""

from __future__ import annotations

import pytest

from clients.library.chunk import Chunk, GenerationError
from clients.library.failover import RETRY_DELAYS_S, failover, failover_sync, next_delay

NO_DELAYS = (0.0, 0.0, 0.0)


def chunk(text: str, final: bool = False) -> Chunk:
    return Chunk(
        text=text,
        num_output_tokens=1,
        num_input_tokens=None,
        output_ids=None,
        finish_reason="stop" if final else None,
        timing=None,
        final=final,
        request_id="r",
        received_ns=0,
    )


class Attempts:
    """Attempt factories that fail as scripted, then stream; records what was opened/closed."""

    def __init__(self, failures: list[tuple[int, str]]) -> None:
        self.failures = list(failures)  # per attempt: (chunks before failing, error code)
        self.opened = self.closed = 0

    def _plan(self):
        self.opened += 1
        return self.failures.pop(0) if self.failures else None

    async def attempt(self):
        plan = self._plan()
        try:
            for i in range(plan[0] if plan else 2):
                yield chunk(f"t{i}", final=plan is None and i == 1)
            if plan:
                raise GenerationError("boom", plan[1])
        finally:
            self.closed += 1

    def attempt_sync(self):
        plan = self._plan()
        try:
            for i in range(plan[0] if plan else 2):
                yield chunk(f"t{i}", final=plan is None and i == 1)
            if plan:
                raise GenerationError("boom", plan[1])
        finally:
            self.closed += 1


async def collect(attempts: Attempts) -> list[str]:
    return [c.text async for c in failover(attempts.attempt, NO_DELAYS)]


def collect_sync(attempts: Attempts) -> list[str]:
    return [c.text for c in failover_sync(attempts.attempt_sync, NO_DELAYS)]


async def test_unavailable_before_the_first_response_is_retried():
    """Two unavailable attempts with no response, then one that streams: the caller sees only
    the third attempt's chunks, and every attempt was closed."""
    for run in (collect, collect_sync):
        attempts = Attempts([(0, "unavailable"), (0, "unavailable")])
        texts = await run(attempts) if run is collect else run(attempts)
        assert texts == ["t0", "t1"]
        assert attempts.opened == attempts.closed == 3


@pytest.mark.parametrize(
    "failure",
    [(1, "unavailable"), (0, "invalid_request"), (0, "overloaded"), (0, "internal")],
)
async def test_other_failures_are_raised_as_they_are(failure):
    """After a response, or for any other error, there is no retry."""
    for run in (collect, collect_sync):
        attempts = Attempts([failure])
        with pytest.raises(GenerationError) as caught:
            await run(attempts) if run is collect else run(attempts)
        assert caught.value.code == failure[1]
        assert attempts.opened == attempts.closed == 1


async def test_attempts_are_bounded():
    """When every attempt fails unavailable, the last error is raised after len(delays)+1 tries."""
    attempts = Attempts([(0, "unavailable")] * 10)
    with pytest.raises(GenerationError):
        await collect(attempts)
    assert attempts.opened == attempts.closed == len(NO_DELAYS) + 1


async def test_closing_early_closes_the_attempt():
    """Leaving after the first chunk closes the running attempt (which cancels its stream)."""
    attempts = Attempts([])
    chunks = failover(attempts.attempt, NO_DELAYS)
    assert (await anext(chunks)).text == "t0"
    await chunks.aclose()
    assert attempts.closed == 1


@pytest.mark.parametrize(
    ("code", "retryable_flag", "responses", "tries", "delay"),
    [
        ("unavailable", True, 0, 1, 0.5),  # the first failure: the first pause
        ("unavailable", True, 0, 3, 2.5),  # the third: the third pause
        ("unavailable", True, 0, 4, None),  # as many failures as pauses: give up
        ("unavailable", True, 1, 1, None),  # after a response: never retried
        ("unavailable", False, 0, 1, None),  # an idle timeout: not retried
        ("overloaded", True, 0, 1, None),  # anything but unavailable: raised as is
        ("invalid_request", True, 0, 1, None),
    ],
)
def test_next_delay_is_the_one_retry_decision(code, retryable_flag, responses, tries, delay):
    """Both loops ask next_delay: the pause before the next attempt, or None to raise."""
    error = GenerationError("x", code, retryable=retryable_flag)
    assert next_delay(error, responses, tries, (0.5, 1.5, 2.5)) == delay


def test_default_retries_outlast_a_refusing_replica_of_two():
    """With two replicas, one refusing (stopping, draining), an attempt lands on it about half
    the time: the default retries leave a stream failing at most once in 10,000, and give up on
    a service that is down within a few seconds."""
    attempts = len(RETRY_DELAYS_S) + 1
    assert 0.5**attempts <= 1e-4
    assert sum(RETRY_DELAYS_S) <= 4.0
