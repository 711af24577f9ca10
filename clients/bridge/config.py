"""The bridge's settings: one frozen value built by the CLI (or a caller) and read everywhere."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from clients.library.chunk import DEFAULT_IDLE_TIMEOUT_S
from clients.library.replica_health import FAILURES_TO_NOT_READY
from streaming_backend.configuration import endpoints
from streaming_backend.wire import CHAT_MODEL


@dataclass(frozen=True)
class BridgeConfig:
    """Settings of one bridge process."""

    triton_url: str = endpoints.GRPC_TARGET
    host: str = "127.0.0.1"
    port: int = endpoints.BRIDGE_PORT  # 0 = any free port (Bridge.port tells which)
    token: str | None = None  # bearer token required of every websocket client when set
    origins: tuple[str, ...] = ()  # allowed browser Origins; () = same origin only; "*" = any
    max_concurrent: int = 4  # generations at once per connection
    max_connections: int = 256
    send_queue: int = 256  # frames waiting for one client before it counts as too slow
    send_timeout_s: float = 10.0  # one frame not taken by the client in this long: too slow
    max_frame_bytes: int = 256 * 1024
    max_body_bytes: int = 1024 * 1024  # an HTTP request body (the OpenAI API)
    idle_timeout_s: float = 300.0  # no message and no generation running for this long
    auth_timeout_s: float = 10.0  # a client owing the token must send it within this
    # a ping every this often; a client whose pong does not come within half of it is
    # disconnected (aiohttp's heartbeat: it has no separate pong timeout); None: no pings
    ping_interval_s: float | None = 20.0
    close_timeout_s: float = 2.0
    # on stop, running generations get this long to end (under `serve` the drain has ended them
    # upstream already) and their last frames to go out, before sockets close with 1001
    stop_grace_s: float = 2.0
    health_interval_s: float = 1.0
    # probes in a row without an answer before a ready replica counts as not ready
    # (clients/library/replica_health.py); a "not ready" answer counts at once
    health_failures: int = FAILURES_TO_NOT_READY
    socket_send_buffer: int | None = None  # SO_SNDBUF per client socket; None = kernel default
    model: str = CHAT_MODEL
    # a generation that gets nothing from Triton for this long ends with an `unavailable` error
    upstream_idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S
    # asked beside Triton's readiness (`tokenstream serve` passes its supervisor's, which is
    # false while Triton drains or recovers); None: Triton's readiness alone
    also_ready: Callable[[], bool] | None = None
