"""The Bridge: the websocket server, its one Triton client, the Triton health watch, and the
entry points that run it until a stop event or a signal.

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
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from clients.bridge import http
from clients.bridge.config import BridgeConfig
from clients.bridge.connection import Connection
from clients.grpc_client import AsyncChatClient
from clients.replica_health import ReplicaHealth
from clients.targets import parse_target

log = logging.getLogger("tokenstream.bridge")


class Bridge:
    """The websocket server, its Triton client and the Triton health watch."""

    def __init__(self, cfg: BridgeConfig) -> None:
        self.cfg = cfg
        self.client: AsyncChatClient | None = None
        self.replicas: ReplicaHealth | None = None
        self.triton_ready = False
        self.connections: set[Connection] = set()
        self._preauthed: set[ServerConnection] = set()
        self._server = None
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
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        """Connect to Triton, start the health watch, listen."""
        self.client = AsyncChatClient(self.cfg.triton_url, self.cfg.model)
        self.replicas = ReplicaHealth(parse_target(self.cfg.triton_url), self.cfg.model)
        await self.client.is_ready()  # connects the channel to every replica before streams come
        self.triton_ready = await self._probe_replicas()
        self._health_task = asyncio.create_task(self._watch_triton())
        self._server = await serve(
            self._handle,
            self.cfg.host,
            self.cfg.port,
            process_request=self._process_request,
            compression=None,  # token frames are tiny; deflate would only add latency
            max_size=self.cfg.max_frame_bytes,
            ping_interval=self.cfg.ping_interval_s,
            ping_timeout=self.cfg.ping_timeout_s,
            close_timeout=self.cfg.close_timeout_s,
        )
        log.info(
            "bridge on http://%s:%d -> Triton %s", self.cfg.host, self.port, self.cfg.triton_url
        )

    async def close(self) -> None:
        """Close every connection (cancelling their generations), then the Triton client."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
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

    async def _watch_triton(self) -> None:
        """Poll Triton's readiness; gRPC reconnects the channel by itself after a restart."""
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            ready = await self._probe_replicas(timeout_s=max(self.cfg.health_interval_s, 1.0))
            if ready != self.triton_ready:
                level = logging.INFO if ready else logging.WARNING
                log.log(level, "Triton at %s is %s", self.cfg.triton_url, _state(ready))
            self.triton_ready = ready

    def health(self) -> dict[str, Any]:
        """The /healthz body."""
        return {
            "ready": self.triton_ready,
            "triton": self.cfg.triton_url,
            "triton_state": _state(self.triton_ready),
            "replicas": dict(self.replicas.states) if self.replicas else {},
            "connections": len(self.connections),
            "generations": sum(len(c.generations) for c in self.connections),
        }

    def _process_request(self, ws: ServerConnection, request: Request) -> Response | None:
        """Answer plain HTTP (page, health) and vet websocket handshakes; None = go on."""
        path = http.request_path(request)
        if not http.host_allowed(request.headers.get("Host"), self.cfg.host):
            return http.json_response(403, {"error": "host not allowed"})
        if path == http.HEALTH_PATH:
            return http.json_response(200 if self.triton_ready else 503, self.health())
        if path in http.STATIC_FILES:
            return http.static_response(path)
        if path != http.WS_PATH:
            return http.json_response(404, {"error": "not found"})
        return self._vet_handshake(ws, request)

    def _vet_handshake(self, ws: ServerConnection, request: Request) -> Response | None:
        host = request.headers.get("Host")
        if not http.origin_allowed(request.headers.get("Origin"), host, self.cfg.origins):
            log.warning("refused Origin %r", request.headers.get("Origin"))
            return http.json_response(403, {"error": "origin not allowed"})
        if len(self.connections) >= self.cfg.max_connections:
            return http.json_response(503, {"error": "too many connections"})
        offered = http.bearer(request)
        if self.cfg.token is not None and offered is not None:
            if not http.token_matches(offered, self.cfg.token):
                return http.json_response(401, {"error": "bad token"})
            self._preauthed.add(ws)
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        authed = self.cfg.token is None or ws in self._preauthed
        self._preauthed.discard(ws)
        conn = Connection(self, ws, next(self._numbers), authed)
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)


def _state(ready: bool) -> str:
    return "ready" if ready else "not ready"


async def serve_bridge(cfg: BridgeConfig, stop: asyncio.Event | None = None) -> None:
    """Run the bridge until `stop` is set (forever without one)."""
    stop = stop or asyncio.Event()
    async with Bridge(cfg):
        await stop.wait()


def run_bridge(cfg: BridgeConfig) -> None:
    """Run the bridge in a fresh event loop until SIGINT or SIGTERM."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_bridge(cfg, stop)

    asyncio.run(main())
