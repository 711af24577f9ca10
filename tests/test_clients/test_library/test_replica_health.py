"""Readiness of each replica with hysteresis (clients/library/replica_health.py): a lost probe
under load does not flap it; a replica that stops answering, or says it is not ready, is taken
out."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
from bridge_support import bridge_to, http_get
from conftest import start_server

from clients.bridge import HEALTH_PATH
from clients.library.replica_health import NOT_READY, READY, ReplicaHealth
from clients.library.targets import parse_target

ADDRESS = "127.0.0.1:1"


class ScriptedClient:
    """A probe channel that answers from a script: True ready, False not ready, None silent."""

    def __init__(self, answers):
        self.answers = list(answers)

    async def readiness(self, timeout_s: float) -> bool | None:
        return self.answers.pop(0)

    async def close(self) -> None:
        pass


async def states_after(answers, failures: int = 3) -> list[str]:
    """The replica's state after each scripted probe answer."""
    health = ReplicaHealth(parse_target(ADDRESS), "chat", failures_to_not_ready=failures)
    health._clients[ADDRESS] = ScriptedClient(answers)
    return [(await health.probe())[ADDRESS] for _ in answers]


@pytest.mark.parametrize(
    ("answers", "states"),
    [
        # two lost probes under load: still ready; the third in a row: not ready
        ([True, None, None, True], [READY, READY, READY, READY]),
        ([True, None, None, None], [READY, READY, READY, NOT_READY]),
        # misses count only in a row: an answer in between starts the count again
        ([True, None, None, True, None, None], [READY] * 6),
        # one ready answer brings it back at once
        ([True, None, None, None, True], [READY, READY, READY, NOT_READY, READY]),
        # the server's own "not ready" (loading, unloaded, draining) counts at once
        ([True, False, True], [READY, NOT_READY, READY]),
        # never seen ready: not ready until it answers ready
        ([None, None, True], [NOT_READY, NOT_READY, READY]),
    ],
)
async def test_ready_replica_turns_not_ready_after_three_unanswered_probes(answers, states):
    """Hysteresis: N (3) unanswered probes in a row before not ready, one answer to be ready."""
    assert await states_after(answers) == states


async def test_one_failure_threshold_is_the_old_behaviour():
    """failures_to_not_ready=1: every unanswered probe counts at once."""
    assert await states_after([True, None, True], failures=1) == [READY, NOT_READY, READY]
    with pytest.raises(ValueError):
        ReplicaHealth(parse_target(ADDRESS), "chat", failures_to_not_ready=0)


async def wait_until(condition, timeout: float = 30.0) -> None:
    """Poll a condition the bridge's health watch makes true."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def healthz(bridge) -> tuple[int, dict]:
    status, _, body = await http_get(bridge, HEALTH_PATH)
    return status, json.loads(body)


@pytest.mark.server
async def test_a_frozen_triton_is_taken_out_only_after_three_lost_probes(tiny_model_dir):
    """Triton frozen (SIGSTOP: probes time out, as under a heavy load): /healthz stays 200 through
    the first lost probes, turns 503 after the third in a row, and 200 again on the first answer
    once Triton runs again (SIGCONT)."""
    server = start_server(tiny_model_dir)
    try:
        async with bridge_to(server, health_interval_s=0.3) as bridge:
            await wait_until(lambda: bridge.ready)
            address = next(iter(bridge.replicas.states))
            os.kill(server.pid, signal.SIGSTOP)
            try:
                await wait_until(lambda: bridge.replicas.misses.get(address, 0) >= 1)
                status, body = await healthz(bridge)
                assert status == 200 and body["replicas"][address] == READY
                await wait_until(lambda: not bridge.ready)
                assert bridge.replicas.misses[address] == 3
                status, body = await healthz(bridge)
                assert status == 503 and body["replicas"][address] == NOT_READY
            finally:
                os.kill(server.pid, signal.SIGCONT)
            await wait_until(lambda: bridge.ready)
            assert (await healthz(bridge))[0] == 200
    finally:
        server.stop(graceful=False)  # nothing to drain
