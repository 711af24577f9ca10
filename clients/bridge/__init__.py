"""`tokenstream bridge`: relay Triton's gRPC token streams to browsers over websockets, and to
OpenAI clients over HTTP (server-sent events), from one aiohttp server.

One concern per module, in the order a message travels:

- protocol.py    every word of the websocket frames, both ways (constants only)
- messages.py    client frame -> Generate / Cancel / Auth (validation, no I/O)
- connection.py  one websocket: its generations, outbox and lifetime
- websocket.py   the socket as connection.py sees it (over aiohttp's WebSocketResponse)
- frames.py      token / done / error frames and the timing trace (no I/O)
- openai_request.py   OpenAI body -> ApiRequest (validation, no I/O)
- openai_response.py  Chunks -> OpenAI chunks and responses (no I/O)
- openai_errors.py    OpenAI's error object and statuses (no I/O)
- openai_api.py  the /v1 routes: one gRPC stream per request
- http.py        static chat page, /healthz answers, Host / Origin / token checks
- app.py         which path goes where (page, /healthz, /ws, /v1)
- upstream.py    what connection.py and openai_api.py need of the Bridge (app.py: its Site)
- server.py      the Bridge (server, Triton client, health watch); serve_bridge, run_bridge
- config.py      BridgeConfig;  cli.py: argparse -> BridgeConfig -> run
- static/        the chat page (its scripts speak protocol.py's words)
- ws_client.py   the protocol from the client's side: frames -> Chunks (the benchmark's ws)

Protocols: docs/bridge.md and docs/openai.md.
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
