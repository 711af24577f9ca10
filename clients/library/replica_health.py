"""Readiness of every replica a Triton target names, each probed on a channel of its own.

A round_robin channel's readiness call lands on one replica, so it cannot tell which replicas
are up. This probes each address on its own small channel: the bridge is ready while at least
one replica is, and /healthz shows each one. A name (dns:///...) is resolved anew on every probe,
so replicas added or removed behind it appear and disappear here too.

Hysteresis, so that a probe lost under load does not flap readiness: a replica that was ready
turns not ready only after `failures_to_not_ready` probes in a row get no answer (a timeout or a
refused connection); a "not ready" answer from the server turns it not ready at once (it is
loading, unloaded or draining: the server says so), and one ready answer makes it ready again.
A replica never seen ready is not ready.
"""

from __future__ import annotations

import asyncio
import logging

from clients.library.grpc_client import AsyncChatClient
from clients.library.targets import Target

READY, NOT_READY = "ready", "not ready"
# Unanswered probes in a row before a ready replica counts as not ready (with the bridge's 1 s
# probes: a replica that stopped answering is taken out after about 3 s, as Kubernetes' default
# failureThreshold of 3 does).
FAILURES_TO_NOT_READY = 3

log = logging.getLogger("tokenstream.replicas")


class ReplicaHealth:
    """The last known readiness of each replica of a target, and the probe that updates it."""

    def __init__(
        self, target: Target, model: str, failures_to_not_ready: int = FAILURES_TO_NOT_READY
    ) -> None:
        if failures_to_not_ready < 1:
            raise ValueError("failures_to_not_ready must be at least 1")
        self.target = target
        self.model = model
        self.failures_to_not_ready = failures_to_not_ready
        self.states: dict[str, str] = {}  # host:port -> READY / NOT_READY
        self.misses: dict[str, int] = {}  # host:port -> unanswered probes in a row
        self._clients: dict[str, AsyncChatClient] = {}

    @property
    def any_ready(self) -> bool:
        """True while at least one replica counts as ready (see the hysteresis above)."""
        return READY in self.states.values()

    async def probe(self, timeout_s: float = 2.0) -> dict[str, str]:
        """Ask every replica whether the server and the model are ready; the new states."""
        addresses = await asyncio.to_thread(self.target.replicas)
        await self._forget(set(self._clients) - set(addresses))
        for address in addresses:
            if address not in self._clients:
                self._clients[address] = AsyncChatClient(address, self.model)
        answers = await asyncio.gather(*(self._clients[a].readiness(timeout_s) for a in addresses))
        states = {a: self._next_state(a, answer) for a, answer in zip(addresses, answers)}
        self.misses = {a: self.misses.get(a, 0) for a in addresses}
        for address in sorted(set(states) | set(self.states)):
            if states.get(address) != self.states.get(address):
                log.info("replica %s: %s", address, states.get(address, "gone"))
        self.states = states
        return states

    def _next_state(self, address: str, answer: bool | None) -> str:
        """A replica's state after one probe's answer (None: no answer), with the hysteresis."""
        if answer is not None:
            self.misses[address] = 0
            return READY if answer else NOT_READY
        self.misses[address] = self.misses.get(address, 0) + 1
        log.debug("replica %s: no answer to probe %d in a row", address, self.misses[address])
        was_ready = self.states.get(address) == READY
        return (
            READY if was_ready and self.misses[address] < self.failures_to_not_ready else NOT_READY
        )

    async def close(self) -> None:
        """Close every probe channel."""
        await self._forget(set(self._clients))

    async def _forget(self, addresses: set[str]) -> None:
        for address in addresses:
            await self._clients.pop(address).close()
