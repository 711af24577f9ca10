"""`tokenstream bridge`: relay Triton's gRPC token streams to browsers over websockets.

One concern per module, in the order a message travels:

- messages.py    client frame -> Generate / Cancel / Auth (validation, no I/O)
- connection.py  one websocket: its generations, outbox and lifetime
- frames.py      token / done / error frames and the timing trace (no I/O)
- http.py        static chat page, /healthz, Host / Origin / token checks
- server.py      the Bridge (server, Triton client, health watch); serve_bridge, run_bridge
- config.py      BridgeConfig;  cli.py: argparse -> BridgeConfig -> run

Protocol: README.md, section "Browser chat (websocket bridge)".
"""

from clients.bridge.cli import add_arguments, main
from clients.bridge.config import BridgeConfig
from clients.bridge.http import HEALTH_PATH, WS_PATH
from clients.bridge.server import Bridge, run_bridge, serve_bridge

__all__ = [
    "HEALTH_PATH",
    "WS_PATH",
    "Bridge",
    "BridgeConfig",
    "add_arguments",
    "main",
    "run_bridge",
    "serve_bridge",
]
