"""Readiness of every replica a Triton target names, each probed on a channel of its own.

A round_robin channel's readiness call lands on one replica, so it cannot tell which replicas
are up. This probes each address on its own small channel: the bridge is ready while at least
one replica is, and /healthz shows each one. A name (dns:///...) is resolved anew on every probe,
so replicas added or removed behind it appear and disappear here too.
"""

from __future__ import annotations

import asyncio
import logging

from clients.grpc_client import AsyncChatClient
from clients.targets import Target

READY, NOT_READY = "ready", "not ready"

log = logging.getLogger("tokenstream.replicas")


class ReplicaHealth:
    """The last known readiness of each replica of a target, and the probe that updates it."""

    def __init__(self, target: Target, model: str) -> None:
        self.target = target
        self.model = model
        self.states: dict[str, str] = {}  # host:port -> READY / NOT_READY
        self._clients: dict[str, AsyncChatClient] = {}

    @property
    def any_ready(self) -> bool:
        """True while at least one replica answered ready at the last probe."""
        return READY in self.states.values()

    async def probe(self, timeout_s: float = 2.0) -> dict[str, str]:
        """Ask every replica whether the server and the model are ready; the new states."""
        addresses = await asyncio.to_thread(self.target.replicas)
        await self._forget(set(self._clients) - set(addresses))
        for address in addresses:
            if address not in self._clients:
                self._clients[address] = AsyncChatClient(address, self.model)
        answers = await asyncio.gather(*(self._clients[a].is_ready(timeout_s) for a in addresses))
        states = {a: READY if ok else NOT_READY for a, ok in zip(addresses, answers)}
        for address in sorted(set(states) | set(self.states)):
            if states.get(address) != self.states.get(address):
                log.info("replica %s: %s", address, states.get(address, "gone"))
        self.states = states
        return states

    async def close(self) -> None:
        """Close every probe channel."""
        await self._forget(set(self._clients))

    async def _forget(self, addresses: set[str]) -> None:
        for address in addresses:
            await self._clients.pop(address).close()
