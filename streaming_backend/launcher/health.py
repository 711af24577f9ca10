"""The supervisor's own HTTP port: readiness and liveness for Kubernetes, status, metrics, reload.

Triton's `/v2/health/ready` says 200 while a model's stub is dead, and its metrics port restarts
with it; these endpoints live in the supervising process and tell the truth across restarts.

| path | answer |
| --- | --- |
| GET /ready | 200 when the models (and the bridge, under serve) serve; else 503 |
| GET /live | 200 while the supervising loop turns; 503 when it is stuck (restart the pod) |
| GET /status | JSON: state, reason, counters, model, dtype, forward, numerics, steps, memory, ... |
|  | and speculation (drafted and accepted tokens; the dialogue model's too) |
| GET /metrics | Prometheus text: restarts, reloads, readiness, state |
| POST /reload | header `tokenstream-admin-key`; JSON body {"model": optional, "name": optional} |
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from streaming_backend.launcher.control import ControlError
from streaming_backend.launcher.supervisor import (
    DRAINING,
    FAILED,
    READY,
    RECOVERING,
    RELOADING,
    START_HUNG,
    STARTING,
    STOPPED,
    Supervisor,
)
from streaming_backend.wire import ADMIN_HEADER, CHAT_MODEL

STUCK_AFTER_S = 60.0  # no turn of the supervising loop for this long: not live
MAX_BODY = 64 * 1024
STATES = (STARTING, READY, RECOVERING, RELOADING, DRAINING, STOPPED, FAILED)


class HealthServer:
    """The endpoints above, served from a daemon thread."""

    def __init__(self, supervisor: Supervisor, host: str, port: int):
        handler = type("Handler", (_Handler,), {"supervisor": supervisor})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="supervisor-http", daemon=True
        )

    @property
    def port(self) -> int:
        """The port it listens on."""
        return self.httpd.server_address[1]

    def start(self) -> HealthServer:
        """Serve in the background."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        self.httpd.shutdown()
        self.httpd.server_close()


def metrics_text(supervisor: Supervisor) -> str:
    """The supervisor's metrics in Prometheus text format."""
    status = supervisor.status()
    lines = [
        "# HELP tokenstream_supervisor_restarts_total tritonserver restarts, by cause",
        "# TYPE tokenstream_supervisor_restarts_total counter",
    ]
    causes = ("stub_died", "server_died", "unresponsive", "unhealthy", START_HUNG)
    for cause in causes:
        lines.append(
            f'tokenstream_supervisor_restarts_total{{cause="{cause}"}} '
            f"{status['restarts'].get(cause, 0)}"
        )
    lines += [
        "# HELP tokenstream_supervisor_reloads_total model reloads, by result",
        "# TYPE tokenstream_supervisor_reloads_total counter",
    ]
    for result, count in status["reloads"].items():
        lines.append(f'tokenstream_supervisor_reloads_total{{result="{result}"}} {count}')
    lines += [
        "# HELP tokenstream_supervisor_ready 1 when the models and every required part serve",
        "# TYPE tokenstream_supervisor_ready gauge",
        f"tokenstream_supervisor_ready {int(status['ready'])}",
        "# HELP tokenstream_supervisor_state 1 for the current state",
        "# TYPE tokenstream_supervisor_state gauge",
    ]
    for state in STATES:
        value = int(state == status["state"])
        lines.append(f'tokenstream_supervisor_state{{state="{state}"}} {value}')
    return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    supervisor: Supervisor
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?")[0]
        if path in ("/ready", "/healthz"):
            ready = self.supervisor.ready()
            self._json(200 if ready else 503, self.supervisor.status())
        elif path == "/live":
            age = time.monotonic() - self.supervisor.heartbeat
            self._json(200 if age < STUCK_AFTER_S else 503, {"live": age < STUCK_AFTER_S})
        elif path == "/status":
            self._json(200, self.supervisor.status())
        elif path == "/metrics":
            self._send(200, metrics_text(self.supervisor).encode(), "text/plain; version=0.0.4")
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.split("?")[0] != "/reload":
            return self._json(404, {"error": "not found"})
        key = self.headers.get(ADMIN_HEADER, "")
        if not hmac.compare_digest(key.encode(), self.supervisor.admin_key.encode()):
            return self._json(403, {"error": f"reload needs the {ADMIN_HEADER} header"})
        try:
            body = self._body()
            seconds = self.supervisor.reload(
                body.get("model") or None, body.get("name") or CHAT_MODEL
            )
        except ControlError as error:
            return self._json(500, {"error": str(error)})
        except ValueError as error:
            return self._json(400, {"error": str(error)})
        self._json(200, {"reloaded": True, "seconds": round(seconds, 3)})

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise ValueError("body too large")
        body = json.loads(self.rfile.read(length) or b"{}")
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        return body

    def _json(self, status: int, body: dict) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # probes every few seconds: no line each
