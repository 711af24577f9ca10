"""`tokenstream serve`: tritonserver and the websocket bridge in one process.

Start Triton on repository/ through the launcher, wait until every model is loaded, print the
endpoints, run the bridge in this thread, and stop everything on SIGINT/SIGTERM. The launcher
(streaming_backend.launcher) knows nothing of the bridge: this module composes the two, and
`_bridge` is its only use of clients.bridge.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from streaming_backend.config import PARAMETER_HELP, default_parameters
from streaming_backend.launcher import ServerConfig, ServerDied, TritonServer
from streaming_backend.launcher.batching import DialogueBatching
from streaming_backend.launcher.server import (
    DEFAULT_PORTS,
    GRPC_MAX_CONNECTION_AGE_S,
    client_host,
)
from streaming_backend.paths import default_repository

DEFAULT_BRIDGE_PORT = 8080
SERVE_OPTIONS = ("model", "dtype", "max_streams", "queue_limit")  # parameters with an option

RunUntil = Callable[[asyncio.Event], Awaitable[None]]  # an async service, run until the event


@dataclass(frozen=True)
class ServeConfig:
    """Triton's settings and the bridge's port (0: no bridge)."""

    server: ServerConfig
    bridge_port: int = DEFAULT_BRIDGE_PORT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tokenstream serve`; model settings take help and defaults from the model's."""
    defaults = default_parameters()
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    for name, port in DEFAULT_PORTS.items():
        parser.add_argument(f"--{name}-port", type=int, default=0, help=f"0: {port}")
    parser.add_argument("--model", help=_setting_help("model"))
    parser.add_argument("--dtype", default=defaults["dtype"], help=_setting_help("dtype"))
    parser.add_argument("--max-streams", type=int, help=_setting_help("max_streams"))
    parser.add_argument("--queue-limit", type=int, help=_setting_help("queue_limit"))
    parser.add_argument("--log-level", type=int, default=0, help="tritonserver --log-verbose")
    parser.add_argument(
        "--grpc-max-connection-age",
        type=float,
        default=GRPC_MAX_CONNECTION_AGE_S,
        metavar="SECONDS",
        help="close each gRPC client connection after this long, so clients re-resolve and find "
        f"new replicas; open streams finish (default {GRPC_MAX_CONNECTION_AGE_S:g}; 0: never)",
    )
    others = ", ".join(key for key in defaults if key not in SERVE_OPTIONS)
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
    parser.add_argument("--repository", type=Path, default=None, help=argparse.SUPPRESS)
    _add_model_arguments(parser)


def _setting_help(key: str) -> str:
    """A model setting's meaning and default, as streaming_backend.config defines them."""
    default = default_parameters()[key]
    return f"{PARAMETER_HELP[key]} (default {default})" if default else PARAMETER_HELP[key]


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig for parsed `tokenstream serve` options."""
    extra = dict(_key_value(item) for item in args.parameter)
    server = ServerConfig(
        repository=args.repository or default_repository(),
        model=args.model,
        dtype=args.dtype,
        max_streams=args.max_streams,
        queue_limit=args.queue_limit,
        model_parameters=extra,
        models=_models_from_args(args),
        dialogue=_batching_from_args(args),
        host=args.host,
        http_port=args.http_port or DEFAULT_PORTS["http"],
        grpc_port=args.grpc_port or DEFAULT_PORTS["grpc"],
        metrics_port=args.metrics_port or DEFAULT_PORTS["metrics"],
        log_level=args.log_level,
        grpc_max_connection_age_s=args.grpc_max_connection_age or None,
    )
    return ServeConfig(server, bridge_port=0 if args.no_bridge else args.bridge_port)


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--parameter expects KEY=VALUE, got {item!r}")
    return key, value


def main(args: argparse.Namespace) -> int:
    """Entry point of `tokenstream serve` (parsed options)."""
    return serve(config_from_args(args))


def serve(cfg: ServeConfig) -> int:
    """Run Triton (and the bridge) until SIGINT/SIGTERM; non-zero if the server dies."""
    stop = threading.Event()
    restore = _handle_signals(stop)
    server = TritonServer(cfg.server)
    try:
        return _serve(server, cfg.bridge_port, stop)
    finally:
        seconds = server.stop()
        print(f"tokenstream: stopped in {seconds:.1f} s", flush=True)
        restore()


def _handle_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGINT/SIGTERM set `stop`; returns a function restoring the previous handlers."""

    def on_signal(signum: int, frame: object) -> None:
        # set from another thread: Event.set() here could deadlock on the lock wait() holds
        threading.Thread(target=stop.set, daemon=True).start()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _serve(server: TritonServer, bridge_port: int, stop: threading.Event) -> int:
    """Start, wait for readiness, serve until `stop`; the exit status."""
    print(f"tokenstream: starting tritonserver on {server.config.repository}", flush=True)
    server.start()
    try:
        if not server.wait_ready(abort=stop):
            return 0  # interrupted while the models loaded
    except (ServerDied, TimeoutError) as error:
        print(f"tokenstream: {error}", file=sys.stderr, flush=True)
        return 1
    died = threading.Event()
    threading.Thread(target=_watch, args=(server, died, stop), daemon=True).start()
    bridge = _bridge(server, bridge_port) if bridge_port else None
    _print_endpoints(server, bridge_port if bridge else 0)
    if bridge is not None:
        if _run_until(bridge, stop):
            return 1
        if not stop.is_set():
            print("tokenstream: the bridge ended; Triton keeps serving", flush=True)
    stop.wait()
    if died.is_set():
        print(f"tokenstream: {server.died_error()}", file=sys.stderr, flush=True)
        return 1
    return 0


def _watch(server: TritonServer, died: threading.Event, stop: threading.Event) -> None:
    """Set `died` and `stop` when tritonserver exits on its own."""
    server.wait()
    if not stop.is_set():
        died.set()
        stop.set()


def _print_endpoints(server: TritonServer, bridge_port: int) -> None:
    models = server.config.models or sorted(
        p.name for p in server.config.repository.iterdir() if p.is_dir()
    )
    lines = [
        "tokenstream: Triton is ready",
        f"  models   {', '.join(models)}",
        f"  HTTP     {server.http_url}   (e.g. POST /v2/models/<model>/generate_stream)",
        f"  gRPC     {server.grpc_url}",
        f"  metrics  {server.metrics_url}",
    ]
    if bridge_port:
        lines.append(f"  chat     http://{client_host(server.config.host)}:{bridge_port}/")
    lines.append("  Ctrl-C stops everything")
    print("\n".join(lines), flush=True)


def _bridge(server: TritonServer, port: int) -> RunUntil | None:
    """The websocket bridge in front of `server`; None, with a warning, when it cannot run."""
    # optional: `serve` goes on without it when websockets or tritonclient are not installed
    try:
        from clients.bridge import BridgeConfig, serve_bridge
    except ImportError as error:
        print(f"tokenstream: warning: websocket bridge not started ({error})", flush=True)
        return None
    cfg = BridgeConfig(triton_url=server.grpc_url, host=server.config.host, port=port)
    return functools.partial(serve_bridge, cfg)


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
