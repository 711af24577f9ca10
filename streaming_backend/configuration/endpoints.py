"""Where `tokenstream serve` listens by default, and the addresses clients use to reach it.

Every default port and address is written here once; the launcher, `serve`, the bridge, the
terminal chat, bench, stress and reload take their defaults from this module. Standard library
only (the launcher and every client import it).
"""

from __future__ import annotations

HOST = "127.0.0.1"  # loopback unless told otherwise
HTTP_PORT = 8000  # Triton HTTP/REST (/v2/..., generate_stream)
GRPC_PORT = 8001  # Triton gRPC (stream_infer)
METRICS_PORT = 8002  # Triton's Prometheus metrics
SUPERVISOR_PORT = 8003  # the supervisor: /ready, /live, /status, /metrics, POST /reload
BRIDGE_PORT = 8080  # the bridge: chat page, websocket, OpenAI-compatible API

TRITON_PORTS = {"http": HTTP_PORT, "grpc": GRPC_PORT, "metrics": METRICS_PORT}

GRPC_TARGET = f"{HOST}:{GRPC_PORT}"
HTTP_URL = f"http://{HOST}:{HTTP_PORT}"
METRICS_URL = f"http://{HOST}:{METRICS_PORT}/metrics"
SUPERVISOR_URL = f"http://{HOST}:{SUPERVISOR_PORT}"
BRIDGE_URL = f"http://{HOST}:{BRIDGE_PORT}"
BRIDGE_WS_URL = f"ws://{HOST}:{BRIDGE_PORT}/ws"
