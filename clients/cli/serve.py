"""`tokenstream serve`: a supervised tritonserver and the websocket bridge in one process.

Start Triton on repository/ through the launcher's supervisor, wait until every model is loaded,
print the endpoints, run the bridge in a thread, and supervise Triton from the main thread
(restart on a lost model, readiness and reload on the supervisor port). SIGINT/SIGTERM drains:
new requests are refused, open streams get --drain-timeout to finish, then everything stops; a
second signal stops at once. The launcher (streaming_backend.launcher) knows nothing of the
bridge: this module composes the two, and `_bridge` is its only use of clients.bridge.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from streaming_backend.configuration import endpoints
from streaming_backend.configuration.models import TABLES, check_parameters, serve_options
from streaming_backend.launcher import ServerConfig, ServerDied, TritonServer
from streaming_backend.launcher.batching import DialogueBatching
from streaming_backend.launcher.health import HealthServer
from streaming_backend.launcher.server import GRPC_MAX_CONNECTION_AGE_S, client_host
from streaming_backend.launcher.supervisor import RestartBudget, Supervisor, SupervisorConfig
from streaming_backend.paths import admin_key_file, default_repository
from streaming_backend.wire import ADMIN_KEY_VARIABLE

DEFAULT_BRIDGE_PORT = endpoints.BRIDGE_PORT
DEFAULT_SUPERVISOR_PORT = endpoints.SUPERVISOR_PORT
DEFAULT_DRAIN_TIMEOUT_S = 30.0
BRIDGE_STOP_S = 5.0
# config.pbtxt parameters with an option of their own (the others: --parameter KEY=VALUE)
OPTIONS = serve_options()

RunUntil = Callable[[asyncio.Event], Awaitable[None]]  # an async service, run until the event


@dataclass(frozen=True)
class ServeConfig:
    """The supervised Triton, the bridge's port (0: no bridge) and the supervisor's port."""

    supervisor: SupervisorConfig
    bridge_port: int = DEFAULT_BRIDGE_PORT
    supervisor_port: int = DEFAULT_SUPERVISOR_PORT

    @property
    def server(self) -> ServerConfig:
        """Triton's settings."""
        return self.supervisor.server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tokenstream serve`; model settings take help and defaults from the model's."""
    parser.add_argument("--host", default=endpoints.HOST, help="address to bind (default loopback)")
    for name, port in endpoints.TRITON_PORTS.items():
        parser.add_argument(f"--{name}-port", type=int, default=0, help=f"0: {port}")
    for parameter, models in OPTIONS:  # set on the models that take them, when given
        own = [  # a model whose own default differs (the dialogue model's KV cache share)
            f"{model}'s default {TABLES[model][parameter.key].default}"
            for model in models
            if TABLES[model][parameter.key].default != parameter.default
        ]
        parser.add_argument(
            f"--{parameter.key.replace('_', '-')}",
            metavar=parameter.kind.metavar,
            help=f"{parameter.option_help()}; {' and '.join(models)}"
            + (f" ({', '.join(own)})" if own else ""),
        )
    parser.add_argument("--log-level", type=int, default=0, help="tritonserver --log-verbose")
    parser.add_argument(
        "--grpc-max-connection-age",
        type=float,
        default=GRPC_MAX_CONNECTION_AGE_S,
        metavar="SECONDS",
        help="close each gRPC client connection after this long, so clients re-resolve and find "
        f"new replicas; open streams finish (default {GRPC_MAX_CONNECTION_AGE_S:g}; 0: never)",
    )
    named = {parameter.key for parameter, _ in OPTIONS}
    others = ", ".join(
        sorted({p.key for table in TABLES.values() for p in table if p.key not in named})
    )
    parser.add_argument(
        "--parameter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"any other config.pbtxt parameter of the models (repeatable), e.g. {others}",
    )
    parser.add_argument(
        "--bridge-port", type=int, default=DEFAULT_BRIDGE_PORT, help="0 disables the bridge"
    )
    parser.add_argument("--no-bridge", action="store_true", help="do not run the bridge")
    parser.add_argument(
        "--supervisor-port",
        type=int,
        default=DEFAULT_SUPERVISOR_PORT,
        help="readiness (/ready), liveness (/live), /status, /metrics and POST /reload "
        f"(default {DEFAULT_SUPERVISOR_PORT})",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="seconds open streams get to finish after SIGTERM/SIGINT "
        f"(default {DEFAULT_DRAIN_TIMEOUT_S:g})",
    )
    budget = RestartBudget()
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=budget.max_restarts,
        help=f"restarts of a lost Triton within {budget.window_s:g} s before giving up "
        f"(default {budget.max_restarts})",
    )
    parser.add_argument(
        "--admin-key",
        default=None,
        help=f"key of the model-repository API and of reload (default ${ADMIN_KEY_VARIABLE}, "
        "else a new one per start, kept in a file only this user reads)",
    )
    parser.add_argument("--repository", type=Path, default=None, help=argparse.SUPPRESS)
    _add_model_arguments(parser)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig for parsed `tokenstream serve` options."""
    parameters = dict(_key_value(item) for item in args.parameter)
    for parameter, _ in OPTIONS:
        if getattr(args, parameter.key) is not None:
            parameters[parameter.key] = getattr(args, parameter.key)
    try:
        check_parameters(parameters)
    except ValueError as exc:
        raise SystemExit(f"tokenstream serve: {exc}") from None
    server = ServerConfig(
        repository=args.repository or default_repository(),
        model_parameters=parameters,
        models=_models_from_args(args),
        dialogue=_batching_from_args(args),
        host=args.host,
        http_port=args.http_port or endpoints.HTTP_PORT,
        grpc_port=args.grpc_port or endpoints.GRPC_PORT,
        metrics_port=args.metrics_port or endpoints.METRICS_PORT,
        log_level=args.log_level,
        grpc_max_connection_age_s=args.grpc_max_connection_age or None,
        admin_key=args.admin_key or os.environ.get(ADMIN_KEY_VARIABLE) or None,
    )
    supervisor = SupervisorConfig(
        server,
        budget=RestartBudget(max_restarts=args.max_restarts),
        drain_timeout_s=args.drain_timeout,
    )
    return ServeConfig(
        supervisor,
        bridge_port=0 if args.no_bridge else args.bridge_port,
        supervisor_port=args.supervisor_port,
    )


def write_admin_key(port: int, key: str) -> Path:
    """Keep the admin key where `tokenstream reload` finds it (readable by this user only)."""
    path = admin_key_file(port)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(key)
    return path


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--parameter expects KEY=VALUE, got {item!r}")
    return key, value


def main(args: argparse.Namespace) -> int:
    """Entry point of `tokenstream serve` (parsed options)."""
    return serve(config_from_args(args))


def serve(cfg: ServeConfig) -> int:
    """Run and supervise Triton (and the bridge) until SIGINT/SIGTERM; non-zero if it cannot
    start. The first signal drains, a second one stops at once."""
    stop, force = threading.Event(), threading.Event()
    restore = _handle_signals(stop, force)
    supervisor = Supervisor(cfg.supervisor)
    health = HealthServer(supervisor, cfg.supervisor.server.host, cfg.supervisor_port).start()
    key_file = write_admin_key(cfg.supervisor_port, supervisor.admin_key)
    try:
        return _serve(supervisor, cfg, stop, force)
    finally:
        seconds = supervisor.shutdown(graceful=not force.is_set())
        server = supervisor.server
        clean = "cleanly" if server is not None and server.exited_cleanly else "(killed)"
        print(f"tokenstream: stopped in {seconds:.1f} s, tritonserver exited {clean}", flush=True)
        health.close()
        key_file.unlink(missing_ok=True)
        restore()


def _handle_signals(stop: threading.Event, force: threading.Event) -> Callable[[], None]:
    """SIGINT/SIGTERM set `stop`, a second one `force`; returns a function restoring the
    previous handlers."""

    def on_signal(signum: int, frame: object) -> None:
        # set from another thread: Event.set() here could deadlock on the lock wait() holds
        event = force if stop.is_set() else stop
        threading.Thread(target=event.set, daemon=True).start()
        if event is force:
            print("tokenstream: second signal: stopping at once", flush=True)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _serve(
    supervisor: Supervisor, cfg: ServeConfig, stop: threading.Event, force: threading.Event
) -> int:
    """Start, wait for readiness, supervise until `stop`, drain; the exit status."""
    print(f"tokenstream: starting tritonserver on {cfg.supervisor.server.repository}", flush=True)
    started = time.monotonic()
    try:
        if not supervisor.start(stop):
            return 0  # interrupted while the models loaded
    except (ServerDied, TimeoutError) as error:
        print(f"tokenstream: {error}", file=sys.stderr, flush=True)
        return 1
    server = supervisor.server
    # the bridge's own health follows the models'; /ready waits for the bridge too
    bridge = None
    if cfg.bridge_port:
        bridge = _bridge(
            server, cfg.bridge_port, supervisor.models_ready, supervisor.require("bridge")
        )
    took = time.monotonic() - started
    _print_endpoints(server, cfg.bridge_port if bridge else 0, cfg.supervisor_port, took)
    bridge_stop = threading.Event()
    bridge_thread = None
    if bridge is not None:
        bridge_thread = threading.Thread(
            target=_run_bridge, args=(bridge, bridge_stop, stop), name="bridge", daemon=True
        )
        bridge_thread.start()
    supervisor.watch(stop)  # this (main) thread restarts Triton: its parent-death signal holds
    if not force.is_set():
        supervisor.drain(force)
    bridge_stop.set()
    if bridge_thread is not None:
        bridge_thread.join(timeout=BRIDGE_STOP_S)
    return 0


def _run_bridge(bridge: RunUntil, bridge_stop: threading.Event, stop: threading.Event) -> None:
    """Run the bridge until `bridge_stop`; if it fails, stop everything."""
    if _run_until(bridge, bridge_stop):
        stop.set()
    elif not bridge_stop.is_set():
        print("tokenstream: the bridge ended; Triton keeps serving", flush=True)


def _print_endpoints(
    server: TritonServer, bridge_port: int, supervisor_port: int, took: float
) -> None:
    models = server.config.models or sorted(
        p.name for p in server.config.repository.iterdir() if p.is_dir()
    )
    lines = [
        f"tokenstream: Triton is ready after {took:.1f} s",
        f"  models   {', '.join(models)}",
        f"  HTTP     {server.http_url}   (e.g. POST /v2/models/<model>/generate_stream)",
        f"  gRPC     {server.grpc_url}",
        f"  metrics  {server.metrics_url}",
        f"  health   http://{client_host(server.config.host)}:{supervisor_port}/ready"
        "   (/live, /status, /metrics, POST /reload)",
    ]
    if bridge_port:
        lines.append(f"  chat     http://{client_host(server.config.host)}:{bridge_port}/")
    lines.append("  Ctrl-C drains and stops everything; a second Ctrl-C stops at once")
    print("\n".join(lines), flush=True)


def _bridge(
    server: TritonServer, port: int, ready: Callable[[], bool], serving: threading.Event
) -> RunUntil | None:
    """The websocket bridge in front of `server`, setting `serving` while it listens; None,
    with a warning, when it cannot run."""
    # optional: `serve` goes on without it when websockets or tritonclient are not installed
    try:
        from clients.bridge import BridgeConfig, serve_bridge
    except ImportError as error:
        print(f"tokenstream: warning: websocket bridge not started ({error})", flush=True)
        return None
    cfg = BridgeConfig(
        triton_url=server.grpc_url, host=server.config.host, port=port, also_ready=ready
    )
    return functools.partial(serve_bridge, cfg, serving=serving)


def _run_until(service: RunUntil, stop: threading.Event) -> int:
    """Run an async service in this thread until `stop` is set; 1 if it fails, else 0."""
    # the bridge logs through `logging`; without a handler its warnings would be lost
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # not a line per health probe
    try:
        asyncio.run(_follow(service, stop))
    except Exception as error:  # the bridge failed (port taken, ...): Triton is stopped too
        print(f"tokenstream: bridge failed: {error!r}", file=sys.stderr, flush=True)
        return 1
    return 0


async def _follow(service: RunUntil, stop: threading.Event) -> None:
    """Await service(event) with an asyncio event that follows the threading `stop`."""
    loop = asyncio.get_running_loop()
    service_stop = asyncio.Event()

    def relay() -> None:
        stop.wait()
        with contextlib.suppress(RuntimeError):  # the loop is closed: the service ended already
            loop.call_soon_threadsafe(service_stop.set)

    threading.Thread(target=relay, name="bridge-stop", daemon=True).start()
    await service(service_stop)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options choosing the models and the dialogue model's batching."""
    parser.add_argument(
        "--models",
        default="",
        help="comma-separated models to load (default: every model of the repository)",
    )
    parser.add_argument(
        "--dialogue-instances", type=int, help="dialogue_model instances (default 2)"
    )
    parser.add_argument(
        "--dialogue-queue-delay-us",
        type=int,
        help="dialogue_model's max_queue_delay_microseconds (default 5000)",
    )
    parser.add_argument(
        "--no-dynamic-batching",
        action="store_true",
        help="dialogue_model without Triton's dynamic batcher (one request per execute)",
    )


def _models_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The --models list; empty means every model."""
    return tuple(name.strip() for name in args.models.split(",") if name.strip())


def _batching_from_args(args: argparse.Namespace) -> DialogueBatching:
    """The DialogueBatching of parsed options."""
    return DialogueBatching(
        instances=args.dialogue_instances,
        queue_delay_us=args.dialogue_queue_delay_us,
        dynamic_batching=not args.no_dynamic_batching,
    )
