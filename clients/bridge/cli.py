"""`tokenstream bridge`: argparse -> BridgeConfig -> run the bridge until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os

from clients.bridge.config import BridgeConfig
from clients.bridge.http import WS_PATH
from clients.bridge.server import run_bridge
from clients.library.targets import TARGET_HELP, target_option
from streaming_backend.wire import CHAT_MODEL

TOKEN_ENV = "TOKENSTREAM_BRIDGE_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of `tokenstream bridge`."""
    defaults = BridgeConfig()
    parser.add_argument(
        "--triton", default=defaults.triton_url, type=target_option, help=TARGET_HELP
    )
    parser.add_argument("--host", default=defaults.host, help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=defaults.port, help="page and websocket port")
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"bearer token clients must present (default: ${TOKEN_ENV}, else none)",
    )
    parser.add_argument(
        "--origin",
        action="append",
        default=[],
        help="allowed browser Origin, repeatable; default same origin only; '*' = any",
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=defaults.max_concurrent,
        help="generations per connection",
    )
    parser.add_argument("--model", default=CHAT_MODEL, help="model name in the repository")
    parser.add_argument(
        "--upstream-idle-timeout",
        type=float,
        default=defaults.upstream_idle_timeout_s,
        help="seconds without a response from Triton before a generation fails (default "
        f"{defaults.upstream_idle_timeout_s:g})",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")


def config_from_args(args: argparse.Namespace) -> BridgeConfig:
    """A BridgeConfig from parsed arguments."""
    return BridgeConfig(
        triton_url=args.triton,
        host=args.host,
        port=args.port,
        token=args.token or None,
        origins=tuple(args.origin),
        max_concurrent=args.max_concurrent,
        model=args.model,
        upstream_idle_timeout_s=args.upstream_idle_timeout or None,
    )


def main(args: argparse.Namespace) -> int:
    """Run `tokenstream bridge`."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    cfg = config_from_args(args)
    page, socket = f"http://{cfg.host}:{cfg.port}/", f"ws://{cfg.host}:{cfg.port}{WS_PATH}"
    print(f"chat page: {page}   websocket: {socket}")
    run_bridge(cfg)
    return 0
