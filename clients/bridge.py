"""`tokenstream bridge`: relay Triton's gRPC token streams to browsers over websockets.

Shaped like the websockets documentation: one handler per connection reading with
`async for message in websocket`, JSON messages with a "type" field, the health check and the
static chat page answered through `process_request`, SIGTERM closes the server.

Each generation runs on its own gRPC stream (all sharing one channel to Triton): Triton cancels
requests per stream, so this is what lets a cancel message or a closed socket stop exactly that
generation in the engine. Protocol: README.md, section "Browser chat (websocket bridge)".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import http
import ipaddress
import itertools
import json
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from clients.chunk import Chunk
from clients.grpc_client import (
    MODEL_NAME,
    AsyncChatClient,
    GenerateRequest,
    GenerationError,
)

log = logging.getLogger("tokenstream.bridge")

WS_PATH = "/ws"
HEALTH_PATH = "/healthz"
STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
# The page loads only its own files and talks only to its own origin's websocket.
SECURITY_HEADERS = [
    (
        "Content-Security-Policy",
        "default-src 'self'; connect-src 'self'; base-uri 'none'; frame-ancestors 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-cache"),
]
PARAM_KEYS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "min_tokens",
        "seed",
        "stop",
        "repetition_penalty",
        "ignore_eos",
    }
)
ROLES = frozenset({"system", "user", "assistant"})
MAX_ID_LENGTH = 128
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class BridgeConfig:
    """Settings of one bridge process."""

    triton_url: str = "127.0.0.1:8001"
    host: str = "127.0.0.1"
    port: int = 8080  # 0 = any free port (Bridge.port tells which)
    token: str | None = None  # bearer token required of every websocket client when set
    origins: tuple[str, ...] = ()  # allowed browser Origins; () = same origin only; "*" = any
    max_concurrent: int = 4  # generations at once per connection
    max_connections: int = 256
    send_queue: int = 256  # frames waiting for one client before it counts as too slow
    send_timeout_s: float = 10.0  # one frame not taken by the client in this long: too slow
    max_frame_bytes: int = 256 * 1024
    idle_timeout_s: float = 300.0  # no message and no generation running for this long
    auth_timeout_s: float = 10.0  # a client owing the token must send it within this
    ping_interval_s: float | None = 20.0
    ping_timeout_s: float | None = 20.0
    close_timeout_s: float = 2.0
    health_interval_s: float = 1.0
    socket_send_buffer: int | None = None  # SO_SNDBUF per client socket; None = kernel default
    model: str = MODEL_NAME


class ProtocolError(Exception):
    """A client message the bridge refuses; sent back as an error frame."""

    def __init__(self, code: str, message: str, gen_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.gen_id = gen_id


@dataclass(frozen=True)
class Generate:
    """A parsed `generate` message."""

    gen_id: str
    request: GenerateRequest


@dataclass(frozen=True)
class Cancel:
    """A parsed `cancel` message."""

    gen_id: str


@dataclass(frozen=True)
class Auth:
    """A parsed `auth` message."""

    token: str


# ---------------------------------------------------------------- protocol: client -> bridge


def parse_message(raw: str | bytes) -> Generate | Cancel | Auth:
    """Validate one client frame into a message value; ProtocolError says what is wrong."""
    if isinstance(raw, bytes):
        raise ProtocolError("bad_frame", "binary frames are not supported; send JSON text")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ProtocolError("bad_frame", f"frame is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError("bad_frame", "frame must be a JSON object with a 'type' field")
    kind = data.get("type")
    if kind == "auth":
        token = data.get("token")
        if not isinstance(token, str):
            raise ProtocolError("bad_frame", "auth needs a string 'token'")
        return Auth(token)
    if kind not in ("generate", "cancel"):
        raise ProtocolError("unknown_type", f"unknown message type {kind!r}", _loose_id(data))
    gen_id = _parse_id(data)
    if kind == "cancel":
        return Cancel(gen_id)
    return Generate(gen_id, _parse_request(data, gen_id))


def _loose_id(data: dict) -> str | None:
    """The message's id when it is a usable one, for addressing an error to it."""
    gen_id = data.get("id")
    return gen_id if isinstance(gen_id, str) and 0 < len(gen_id) <= MAX_ID_LENGTH else None


def _parse_id(data: dict) -> str:
    gen_id = _loose_id(data)
    if gen_id is None:
        raise ProtocolError("bad_frame", f"'id' must be a string of 1 to {MAX_ID_LENGTH} chars")
    return gen_id


def _parse_request(data: dict, gen_id: str) -> GenerateRequest:
    """The GenerateRequest of a generate message (prompt or messages, params)."""
    prompt, messages = data.get("prompt"), data.get("messages")
    if (prompt is None) == (messages is None):
        raise ProtocolError("bad_frame", "give exactly one of 'prompt' and 'messages'", gen_id)
    if prompt is not None and not (isinstance(prompt, str) and prompt):
        raise ProtocolError("bad_frame", "'prompt' must be a non-empty string", gen_id)
    if messages is not None:
        _check_messages(messages, gen_id)
    params = _parse_params(data.get("params", {}), gen_id)
    return GenerateRequest(prompt=prompt, messages=messages, sampling=params, return_timing=True)


def _check_messages(messages: Any, gen_id: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("bad_frame", "'messages' must be a non-empty list", gen_id)
    for m in messages:
        if not (
            isinstance(m, dict)
            and set(m) == {"role", "content"}
            and m["role"] in ROLES
            and isinstance(m["content"], str)
        ):
            raise ProtocolError(
                "bad_frame",
                'each message must be {"role": system|user|assistant, "content": string}',
                gen_id,
            )


def _parse_params(params: Any, gen_id: str) -> dict[str, Any]:
    """Shape checks only; the model validates values and its message comes back verbatim."""
    if not isinstance(params, dict):
        raise ProtocolError("bad_params", "'params' must be an object", gen_id)
    unknown = sorted(set(params) - PARAM_KEYS)
    if unknown:
        allowed = ", ".join(sorted(PARAM_KEYS))
        raise ProtocolError("bad_params", f"unknown params {unknown}; allowed: {allowed}", gen_id)
    for key, value in params.items():
        scalar = isinstance(value, (str, int, float, bool))
        strings = key == "stop" and isinstance(value, list)
        if not (scalar or (strings and all(isinstance(s, str) for s in value))):
            raise ProtocolError("bad_params", f"params.{key} has an unsupported type", gen_id)
    return dict(params)


# ---------------------------------------------------------------- protocol: bridge -> client


def error_frame(gen_id: str | None, code: str, message: str) -> dict[str, Any]:
    """An error message for one generation (or the connection when gen_id is None)."""
    return {"type": "error", "id": gen_id, "code": code, "message": message}


@dataclass
class Trace:
    """What the bridge saw of one generation; monotonic ns, the server's clock where 'server'."""

    accepted_ns: int  # the generate frame was parsed
    upstream_ns: int = 0  # the request went to Triton
    first_chunk_ns: int | None = None
    first_out_ns: int | None = None  # the first token frame was queued for the client
    server_first: dict[str, int] | None = None  # `timing` of the first response with tokens
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    relay_ns_total: int = 0  # summed chunk-received -> frame-queued time
    frames: int = 0

    def observe(self, chunk: Chunk, out_ns: int) -> None:
        """Account one chunk whose token frame was queued at out_ns."""
        tokens = chunk.num_output_tokens if chunk.num_output_tokens is not None else 1
        if chunk.num_input_tokens is not None and self.prompt_tokens is None:
            self.prompt_tokens = chunk.num_input_tokens
        if self.first_chunk_ns is None and tokens:
            self.first_chunk_ns, self.first_out_ns = chunk.received_ns, out_ns
            self.server_first = dict(chunk.timing) if chunk.timing else None
        self.completion_tokens += tokens
        self.relay_ns_total += out_ns - chunk.received_ns
        self.frames += 1


def done_frame(gen_id: str, finish_reason: str, trace: Trace, now_ns: int) -> dict[str, Any]:
    """The `done` message: finish reason, token usage, server and bridge timings in ms."""
    return {
        "type": "done",
        "id": gen_id,
        "finish_reason": finish_reason,
        "usage": {
            "prompt_tokens": trace.prompt_tokens,
            "completion_tokens": trace.completion_tokens,
        },
        "timing": {"server": _server_timing(trace), "bridge": _bridge_timing(trace, now_ns)},
    }


def _ms(later: int | None, earlier: int | None) -> float | None:
    return None if later is None or earlier is None else round((later - earlier) / 1e6, 3)


def _server_timing(trace: Trace) -> dict[str, Any]:
    """The first token's server stamps (raw ns, the server's clock) and the spans between."""
    t = trace.server_first or {}
    spans = {
        "queue_ms": _ms(t.get("prefill_start_ns"), t.get("queued_ns")),
        "prefill_ms": _ms(t.get("emitted_ns"), t.get("prefill_start_ns")),
        "first_token_ms": _ms(t.get("emitted_ns"), t.get("received_ns")),
    }
    return spans | {key: value for key, value in t.items() if key.endswith("_ns")}


def _bridge_timing(trace: Trace, now_ns: int) -> dict[str, float | None]:
    t = trace.server_first or {}
    # Server stamp -> bridge receipt, via wall clock so it also holds across machines.
    emitted, server_offset = t.get("emitted_ns"), t.get("wall_minus_monotonic_ns")
    emitted_wall = None if emitted is None or server_offset is None else emitted + server_offset
    first_wall = None
    if trace.first_chunk_ns is not None:
        first_wall = trace.first_chunk_ns + time.time_ns() - time.monotonic_ns()
    return {
        "ttft_ms": _ms(trace.first_out_ns, trace.accepted_ns),
        "upstream_ttft_ms": _ms(trace.first_chunk_ns, trace.upstream_ns),
        "server_to_bridge_ms": _ms(first_wall, emitted_wall),
        "relay_mean_ms": round(trace.relay_ns_total / trace.frames / 1e6, 3)
        if trace.frames
        else None,
        "total_ms": _ms(now_ns, trace.accepted_ns),
    }


# ---------------------------------------------------------------- HTTP side: page, health, checks


def _host_allowed(host_header: str | None, bind_host: str) -> bool:
    """Guard against DNS rebinding: a loopback bridge answers only to loopback host names."""
    if not _is_loopback(bind_host):
        return True
    if not host_header:
        return False
    hostname = urlsplit("//" + host_header).hostname or ""
    return hostname.lower() in LOOPBACK_NAMES


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str | None, host_header: str | None, origins: tuple[str, ...]) -> bool:
    """Same origin by default, else the allow-list; clients without Origin (not browsers) pass."""
    if origin is None:
        return True
    if "*" in origins or origin in origins:
        return True
    if origins or not host_header:
        return False
    return urlsplit(origin).netloc.lower() == host_header.lower()


def _bearer(request: Request) -> str | None:
    """A token offered in the handshake: `Authorization: Bearer` or the `token` query param."""
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    values = parse_qs(urlsplit(request.path).query).get("token")
    return values[0] if values else None


def _response(status: int, body: bytes, content_type: str) -> Response:
    status = http.HTTPStatus(status)
    headers = Headers(
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
            *SECURITY_HEADERS,
        ]
    )
    return Response(status.value, status.phrase, headers, body)


def _json_response(status: int, payload: dict) -> Response:
    return _response(status, json.dumps(payload).encode(), "application/json")


def _static_response(path: str) -> Response:
    name, content_type = STATIC_FILES[path]
    return _response(200, (STATIC_DIR / name).read_bytes(), content_type)


# ---------------------------------------------------------------- the bridge


class Bridge:
    """The websocket server, its Triton client and the Triton health watch."""

    def __init__(self, cfg: BridgeConfig) -> None:
        self.cfg = cfg
        self.client: AsyncChatClient | None = None
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
        self.triton_ready = await self.client.is_ready()
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

    async def _watch_triton(self) -> None:
        """Poll Triton's readiness; gRPC reconnects the channel by itself after a restart."""
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            ready = await self.client.is_ready(timeout_s=max(self.cfg.health_interval_s, 1.0))
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
            "connections": len(self.connections),
            "generations": sum(len(c.generations) for c in self.connections),
        }

    def _process_request(self, ws: ServerConnection, request: Request) -> Response | None:
        """Answer plain HTTP (page, health) and vet websocket handshakes; None = go on."""
        path = urlsplit(request.path).path
        if not _host_allowed(request.headers.get("Host"), self.cfg.host):
            return _json_response(403, {"error": "host not allowed"})
        if path == HEALTH_PATH:
            return _json_response(200 if self.triton_ready else 503, self.health())
        if path in STATIC_FILES:
            return _static_response(path)
        if path != WS_PATH:
            return _json_response(404, {"error": "not found"})
        return self._vet_handshake(ws, request)

    def _vet_handshake(self, ws: ServerConnection, request: Request) -> Response | None:
        host = request.headers.get("Host")
        if not origin_allowed(request.headers.get("Origin"), host, self.cfg.origins):
            log.warning("refused Origin %r", request.headers.get("Origin"))
            return _json_response(403, {"error": "origin not allowed"})
        if len(self.connections) >= self.cfg.max_connections:
            return _json_response(503, {"error": "too many connections"})
        offered = _bearer(request)
        if self.cfg.token is not None and offered is not None:
            if not hmac.compare_digest(offered.encode(), self.cfg.token.encode()):
                return _json_response(401, {"error": "bad token"})
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


class Connection:
    """One websocket client: its generations, its bounded outbox, its lifetime."""

    def __init__(self, bridge: Bridge, ws: ServerConnection, number: int, authed: bool) -> None:
        self.bridge, self.cfg, self.ws, self.number = bridge, bridge.cfg, ws, number
        self.authed = authed
        self.generations: dict[str, asyncio.Task] = {}
        self.client_cancelled: set[str] = set()
        self.outbox: asyncio.Queue[str] = asyncio.Queue(maxsize=self.cfg.send_queue)
        self.overflow = asyncio.Event()
        self.opened = self.last_activity = time.monotonic()
        self._set_send_buffer()

    def _set_send_buffer(self) -> None:
        # A small kernel buffer makes a stalled reader show up in our outbox, not in RAM.
        sock = self.ws.transport.get_extra_info("socket")
        if self.cfg.socket_send_buffer and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.cfg.socket_send_buffer)

    async def run(self) -> None:
        """Read, send and watch until one of them ends, then cancel the rest and close."""
        tasks = [
            asyncio.create_task(self.receive()),
            asyncio.create_task(self.send_loop()),
            asyncio.create_task(self.watch_idle()),
            asyncio.create_task(self.watch_overflow()),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            close = next(iter(done)).result()
        finally:
            for task in tasks:
                task.cancel()
            await self.cancel_all()
        if close is not None:
            log.info("closing connection %d: %s", self.number, close[1])
            if not self.overflow.is_set():
                await self.flush()  # e.g. the error frame that explains the close
            await self.ws.close(*close)

    async def flush(self) -> None:
        """Send what is still queued, briefly; used before a deliberate close."""
        with contextlib.suppress(ConnectionClosed, TimeoutError):
            while not self.outbox.empty():
                frame = self.outbox.get_nowait()
                await asyncio.wait_for(self.ws.send(frame), self.cfg.close_timeout_s)

    async def receive(self) -> tuple[int, str] | None:
        """Handle client frames until the socket closes; a reason to close, if any."""
        with contextlib.suppress(ConnectionClosed):
            async for message in self.ws:
                self.last_activity = time.monotonic()
                close = self.handle(message)
                if close is not None:
                    return close
        return None

    def handle(self, message: str | bytes) -> tuple[int, str] | None:
        """Act on one frame; a close reason when the client must be dropped."""
        try:
            msg = parse_message(message)
        except ProtocolError as exc:
            self.post(error_frame(exc.gen_id, exc.code, exc.message))
            return None if self.authed else (1008, "authentication required")
        if not self.authed:
            if isinstance(msg, Auth) and _same(msg.token, self.cfg.token):
                self.authed = True
                return None
            self.post(error_frame(None, "unauthorized", "send {type: auth, token} first"))
            return (1008, "authentication required")
        if isinstance(msg, Generate):
            self.start(msg)
        elif isinstance(msg, Cancel):
            self.cancel(msg.gen_id)
        return None

    def start(self, msg: Generate) -> None:
        """Start one generation unless the id is taken, the cap is hit or Triton is down."""
        if msg.gen_id in self.generations:
            self.post(error_frame(msg.gen_id, "duplicate_id", "a generation with this id runs"))
        elif len(self.generations) >= self.cfg.max_concurrent:
            limit = self.cfg.max_concurrent
            self.post(error_frame(msg.gen_id, "too_many", f"at most {limit} generations at once"))
        elif not self.bridge.triton_ready:
            text = f"Triton at {self.cfg.triton_url} is not ready; retry shortly"
            self.post(error_frame(msg.gen_id, "unavailable", text))
        else:
            self.generations[msg.gen_id] = asyncio.create_task(self.generate(msg))

    def cancel(self, gen_id: str) -> None:
        """Cancel one generation; unknown ids are ignored (it may have just finished)."""
        task = self.generations.get(gen_id)
        if task is not None:
            self.client_cancelled.add(gen_id)
            task.cancel()

    async def generate(self, msg: Generate) -> None:
        """Relay one generation: token frames, then one done or one error frame."""
        trace = Trace(accepted_ns=time.monotonic_ns())
        finish_reason = None
        request_id = f"ws{self.number}-{uuid.uuid4().hex[:12]}"
        try:
            trace.upstream_ns = time.monotonic_ns()
            chunks = self.bridge.client.generate(msg.request, request_id)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    finish_reason = self.relay(msg.gen_id, chunk, trace) or finish_reason
            self.post(done_frame(msg.gen_id, finish_reason or "stop", trace, time.monotonic_ns()))
        except GenerationError as exc:
            self.post(error_frame(msg.gen_id, exc.code, exc.message))
        except asyncio.CancelledError:
            if msg.gen_id not in self.client_cancelled:
                raise  # the connection is going away: nobody to tell
            # The client asked for this cancel: it ends the generation, not this task's caller.
            task = asyncio.current_task()
            if hasattr(task, "uncancel"):  # Python >= 3.11
                task.uncancel()
            self.post(done_frame(msg.gen_id, "cancelled", trace, time.monotonic_ns()))
        finally:
            self.client_cancelled.discard(msg.gen_id)
            self.generations.pop(msg.gen_id, None)
            self.last_activity = time.monotonic()  # idle time counts from the last answer

    def relay(self, gen_id: str, chunk: Chunk, trace: Trace) -> str | None:
        """Forward one chunk as a token frame; its finish reason, if it has one."""
        if chunk.text or chunk.num_output_tokens:
            out_ns = time.monotonic_ns()
            trace.observe(chunk, out_ns)
            self.post(
                {"type": "token", "id": gen_id, "text": chunk.text, "n": trace.completion_tokens}
            )
        elif chunk.num_input_tokens is not None and trace.prompt_tokens is None:
            trace.prompt_tokens = chunk.num_input_tokens
        return chunk.finish_reason

    def post(self, frame: dict[str, Any]) -> None:
        """Queue a frame for the client; a full queue marks the client too slow."""
        try:
            self.outbox.put_nowait(json.dumps(frame, ensure_ascii=False))
        except asyncio.QueueFull:
            self.overflow.set()

    async def send_loop(self) -> tuple[int, str] | None:
        """Send queued frames in order; a client that stops reading ends the connection."""
        while True:
            frame = await self.outbox.get()
            try:
                await asyncio.wait_for(self.ws.send(frame), self.cfg.send_timeout_s)
            except TimeoutError:
                return (1008, "client too slow: a frame waited too long")
            except ConnectionClosed:
                return None

    async def watch_overflow(self) -> tuple[int, str]:
        """End the connection when the outbox overflows."""
        await self.overflow.wait()
        return (1008, "client too slow: send queue full")

    async def watch_idle(self) -> tuple[int, str]:
        """End the connection after the auth deadline or an idle spell without generations."""
        auth_deadline = self.opened + self.cfg.auth_timeout_s
        while True:
            now = time.monotonic()
            if not self.authed and now >= auth_deadline:
                return (1008, "authentication timeout")
            wake = self.last_activity + self.cfg.idle_timeout_s
            if now >= wake:
                if not self.generations:
                    return (1001, "idle timeout")
                wake = now + 1.0  # look again once the running generations may have ended
            if not self.authed:
                wake = min(wake, auth_deadline)
            await asyncio.sleep(wake - now)

    async def cancel_all(self) -> None:
        """Cancel every running generation and wait until their upstream streams are cancelled."""
        tasks = list(self.generations.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _same(offered: str, expected: str | None) -> bool:
    return expected is not None and hmac.compare_digest(offered.encode(), expected.encode())


# ---------------------------------------------------------------- entry points


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of `tokenstream bridge`."""
    parser.add_argument("--triton", default="127.0.0.1:8001", help="Triton gRPC HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=8080, help="port of the page and websocket")
    parser.add_argument(
        "--token",
        default=os.environ.get("TOKENSTREAM_BRIDGE_TOKEN"),
        help="bearer token clients must present (default: $TOKENSTREAM_BRIDGE_TOKEN, else none)",
    )
    parser.add_argument(
        "--origin",
        action="append",
        default=[],
        help="allowed browser Origin, repeatable; default same origin only; '*' = any",
    )
    parser.add_argument("--max-concurrent", type=int, default=4, help="generations per connection")
    parser.add_argument("--model", default=MODEL_NAME, help="model name in the repository")
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
    )


def main(args: argparse.Namespace) -> int:
    """Run `tokenstream bridge`."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    cfg = config_from_args(args)
    print(
        f"chat page: http://{cfg.host}:{cfg.port}/   websocket: ws://{cfg.host}:{cfg.port}{WS_PATH}"
    )
    run_bridge(cfg)
    return 0


__all__ = [
    "Bridge",
    "BridgeConfig",
    "ProtocolError",
    "done_frame",
    "error_frame",
    "parse_message",
    "run_bridge",
    "serve_bridge",
]
