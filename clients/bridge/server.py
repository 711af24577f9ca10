"""The Bridge: the HTTP server (chat page, websocket, health, OpenAI-compatible API), its one
Triton client, the Triton health watch, and the entry points that run it until a stop event or a
signal.

Each generation runs on its own gRPC stream (all sharing one channel to Triton): Triton cancels
requests per stream, so this is what lets a cancel message or a closed socket stop exactly that
generation in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import threading
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from clients.bridge import http
from clients.bridge.app import build_app
from clients.bridge.config import BridgeConfig
from clients.bridge.connection import Connection
from clients.bridge.websocket import WebSocket
from clients.library.chunk import Chunk
from clients.library.grpc_client import AsyncChatClient
from clients.library.replica_health import ReplicaHealth
from clients.library.request import GenerateRequest
from clients.library.targets import parse_target

log = logging.getLogger("tokenstream.bridge")


class Bridge:
    """The websocket server, its Triton client and the Triton health watch."""

    def __init__(self, cfg: BridgeConfig) -> None:
        self.cfg = cfg
        self.client: AsyncChatClient | None = None
        self.replicas: ReplicaHealth | None = None
        self.triton_ready = False
        self.connections: set[Connection] = set()
        self._runner: web.AppRunner | None = None
        self._health_task: asyncio.Task | None = None
        self._numbers = itertools.count(1)

    async def __aenter__(self) -> Bridge:
        try:
            await self.start()
        except BaseException:
            await self.close()  # e.g. the port is taken: no health task or channel left behind
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    @property
    def port(self) -> int:
        """The bound TCP port (useful with port 0)."""
        return self._runner.addresses[0][1]

    async def start(self) -> None:
        """Connect to Triton, start the health watch, listen."""
        self.client = AsyncChatClient(
            self.cfg.triton_url, self.cfg.model, idle_timeout_s=self.cfg.upstream_idle_timeout_s
        )
        self.replicas = ReplicaHealth(
            parse_target(self.cfg.triton_url), self.cfg.model, self.cfg.health_failures
        )
        await self.client.is_ready()  # connects the channel to every replica before streams come
        self.triton_ready = await self._probe_replicas()
        self._health_task = asyncio.create_task(self._watch_triton())
        self._runner = web.AppRunner(
            build_app(self),
            handler_cancellation=True,  # a client that goes away cancels its request's handler
            access_log=None,
            shutdown_timeout=self.cfg.close_timeout_s,
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, self.cfg.host, self.cfg.port).start()
        log.info(
            "bridge on http://%s:%d -> Triton %s", self.cfg.host, self.port, self.cfg.triton_url
        )

    async def close(self) -> None:
        """Close every connection (cancelling their generations), then the Triton client."""
        if self._runner is not None:
            await self._runner.cleanup()  # runs close_connections (an on_shutdown hook)
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.client is not None:
            await self.client.close()
        if self.replicas is not None:
            await self.replicas.close()

    async def _probe_replicas(self, timeout_s: float = 2.0) -> bool:
        """Probe every replica the target names; True while at least one is ready."""
        await self.replicas.probe(timeout_s)
        return self.replicas.any_ready

    async def close_connections(self) -> None:
        """Close every websocket as the server goes away (their generations are cancelled)."""
        await asyncio.gather(*(c.ws.close(1001, "server shutting down") for c in self.connections))

    async def _watch_triton(self) -> None:
        """Poll Triton's readiness; gRPC reconnects the channel by itself after a restart."""
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            ready = await self._probe_replicas(timeout_s=max(self.cfg.health_interval_s, 1.0))
            if ready != self.triton_ready:
                level = logging.INFO if ready else logging.WARNING
                log.log(level, "Triton at %s is %s", self.cfg.triton_url, _state(ready))
            self.triton_ready = ready

    def generate(self, request: GenerateRequest, request_id: str) -> AsyncIterator[Chunk]:
        """One generation's Chunks on its own gRPC stream (closing the iterator cancels it)."""
        return self.client.generate(request, request_id)

    @property
    def ready(self) -> bool:
        """Triton is ready, and so is whatever else the config names (the supervisor)."""
        also = self.cfg.also_ready
        return self.triton_ready and (also is None or also())

    async def settle(self, grace_s: float) -> None:
        """Wait up to `grace_s` for running generations to end and every queued frame to go."""
        deadline = asyncio.get_running_loop().time() + grace_s
        while any(c.generations or not c.outbox.empty() for c in self.connections):
            if asyncio.get_running_loop().time() >= deadline:
                return
            await asyncio.sleep(0.02)

    def health(self) -> dict[str, Any]:
        """The /healthz body."""
        return {
            "ready": self.ready,
            "triton": self.cfg.triton_url,
            "triton_state": _state(self.triton_ready),
            "replicas": dict(self.replicas.states) if self.replicas else {},
            "connections": len(self.connections),
            "generations": sum(len(c.generations) for c in self.connections),
        }

    async def handle_websocket(self, request: web.Request) -> web.StreamResponse:
        """Vet a websocket handshake, then run its Connection until it ends."""
        refusal = self._vet_handshake(request)
        if refusal is not None:
            return refusal
        ws = web.WebSocketResponse(
            compress=False,  # token frames are tiny; deflate would only add latency
            max_msg_size=self.cfg.max_frame_bytes,
            heartbeat=self.cfg.ping_interval_s,
            timeout=self.cfg.close_timeout_s,
            writer_limit=0,  # wait for the socket whenever it is backed up, frame by frame
        )
        await ws.prepare(request)
        offered = http.bearer(request.headers, request.query)
        authed = self.cfg.token is None or offered is not None  # a wrong one was refused above
        conn = Connection(self, WebSocket(ws, request.transport), next(self._numbers), authed)
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)
        return ws

    def _vet_handshake(self, request: web.Request) -> web.Response | None:
        """A refusal for a handshake that fails a check; None = accept."""
        host = request.headers.get("Host")
        if not http.origin_allowed(request.headers.get("Origin"), host, self.cfg.origins):
            log.warning("refused Origin %r", request.headers.get("Origin"))
            return http.json_response(403, {"error": "origin not allowed"})
        if not web.WebSocketResponse().can_prepare(request).ok:
            return http.json_response(426, {"error": "this path takes websocket connections"})
        if len(self.connections) >= self.cfg.max_connections:
            return http.json_response(503, {"error": "too many connections"})
        offered = http.bearer(request.headers, request.query)
        if self.cfg.token is not None and offered is not None:
            if not http.token_matches(offered, self.cfg.token):
                return http.json_response(401, {"error": "bad token"})
        return None


def _state(ready: bool) -> str:
    return "ready" if ready else "not ready"


async def serve_bridge(
    cfg: BridgeConfig, stop: asyncio.Event | None = None, serving: threading.Event | None = None
) -> None:
    """Run the bridge until `stop` is set (forever without one); `serving`, if given, is set
    while it listens (tokenstream serve's readiness waits for it)."""
    stop = stop or asyncio.Event()
    serving = serving or threading.Event()
    try:
        async with Bridge(cfg) as bridge:
            serving.set()
            await stop.wait()
            serving.clear()
            await bridge.settle(cfg.stop_grace_s)
    finally:
        serving.clear()


def run_bridge(cfg: BridgeConfig) -> None:
    """Run the bridge in a fresh event loop until SIGINT or SIGTERM."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_bridge(cfg, stop)

    asyncio.run(main())
