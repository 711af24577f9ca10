"""Transports the benchmark drives: gRPC stream_infer, HTTP generate_stream (SSE), the ws bridge.

Each transport fills a RequestRecord: `sent_ns` right before the request leaves, and one
Response per streamed response stamped the moment it arrives (CLOCK_MONOTONIC ns).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from clients.bench.metrics import RequestRecord, Response, ServerTiming

TRANSPORTS = ("grpc", "sse", "ws")


@dataclass(frozen=True)
class Prompt:
    """A prompt: plain text (sent as is) or chat messages (the model applies its template)."""

    text: str | None = None
    messages: tuple[dict, ...] | None = None


class Transport(Protocol):
    """What the runner needs from a transport."""

    name: str

    async def open(self, slots: int) -> None:
        """Connect; `slots` is the most requests that will be in flight at once."""

    async def generate(self, rec: RequestRecord, prompt: Prompt, params: dict) -> None:
        """Send one request and record its responses into `rec` (errors go into rec.error)."""

    async def close(self) -> None:
        """Release connections."""


def model_inputs(prompt: Prompt, params: dict) -> dict[str, object]:
    """Tensor name -> value for the `chat` model (docs/interface.md)."""
    inputs: dict[str, object] = {
        "stream": True,
        "sampling_parameters": json.dumps(params),
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "return_finish_reason": True,
        "return_timing": True,
    }
    if prompt.messages is not None:
        inputs["messages"] = json.dumps(list(prompt.messages))
    else:
        inputs["text_input"] = prompt.text or ""
    return inputs


def record_response(
    rec: RequestRecord,
    recv_ns: int,
    *,
    text: str,
    tokens: int | None,
    timing: dict | None = None,
    finish_reason: str | None = None,
    input_tokens: int | None = None,
) -> None:
    """Add one model response to the record."""
    server = ServerTiming.from_dict(timing) if timing else None
    rec.responses.append(
        Response(
            recv_ns=recv_ns,
            tokens=int(tokens or 0),
            chars=len(text),
            emitted_ns=None if server is None else server.emitted_ns,
        )
    )
    # the stamps of the first token, as the bridge's done.timing.server holds them
    if (tokens or text) and rec.server_timing is None:
        rec.server_timing = server
    if input_tokens is not None:
        rec.prompt_tokens = int(input_tokens)
    if finish_reason:
        rec.finish_reason = finish_reason


def record_error(rec: RequestRecord, message: str, cancelled: bool = False) -> None:
    """Record a failed request; the model's `cancelled` category counts as a cancellation."""
    rec.error = message
    rec.cancelled = cancelled or message.lower().lstrip().startswith("cancelled")


# --- gRPC -------------------------------------------------------------------------------------


class GrpcTransport:
    """tritonclient.grpc.aio stream_infer through clients.grpc_client: a stream per request."""

    name = "grpc"

    def __init__(self, url: str, model: str = "chat"):
        self.url, self.model = url, model
        self.client = None

    async def open(self, slots: int) -> None:
        """Create the channel (one HTTP/2 connection multiplexes every stream)."""
        from clients.grpc_client import AsyncChatClient

        if self.client is None:
            self.client = AsyncChatClient(self.url, self.model)
            if not await self.client.is_ready():
                raise ConnectionError(f"Triton gRPC at {self.url}: model {self.model!r} not ready")

    async def generate(self, rec: RequestRecord, prompt: Prompt, params: dict) -> None:
        """Stream one request; leaving early cancels it upstream (the client's aclose)."""
        from clients.grpc_client import GenerateRequest, GenerationError

        request = GenerateRequest(
            prompt=prompt.text if prompt.messages is None else None,
            messages=prompt.messages,
            sampling=params,
            return_timing=True,
        )
        # as perf_analyzer does: stamped right before the call that builds and writes it
        rec.sent_ns = time.monotonic_ns()
        chunks = self.client.generate(request, request_id=str(rec.index))
        try:
            async for c in chunks:
                record_response(
                    rec,
                    c.received_ns,
                    text=c.text,
                    tokens=c.num_output_tokens,
                    timing=c.timing,
                    finish_reason=c.finish_reason,
                    input_tokens=c.num_input_tokens,
                )
        except GenerationError as exc:
            record_error(rec, exc.message, cancelled=exc.code == "cancelled")
        finally:
            await chunks.aclose()

    async def close(self) -> None:
        """Close the channel."""
        if self.client is not None:
            await self.client.close()
            self.client = None


# --- HTTP generate_stream (SSE) ---------------------------------------------------------------


def parse_sse_line(line: bytes) -> dict | None:
    """The JSON object of an SSE `data:` line; None for other lines (blank, comments, ids)."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    return json.loads(payload) if payload else None


class SseTransport:
    """Triton's HTTP POST /v2/models/<model>/generate_stream, read as server-sent events."""

    name = "sse"

    def __init__(self, url: str, model: str = "chat"):
        self.endpoint = f"{url.rstrip('/')}/v2/models/{model}/generate_stream"
        self.session = None

    async def open(self, slots: int) -> None:
        """One aiohttp session; no connection cap, so the runner alone sets concurrency."""
        import aiohttp

        if self.session is None:
            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
            self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
            await self._check_ready()

    async def _check_ready(self) -> None:
        """GET the model's ready endpoint, so a wrong URL fails once and clearly."""
        ready = self.endpoint.rsplit("/", 1)[0] + "/ready"
        try:
            async with self.session.get(ready) as resp:
                ok = resp.status == 200
        except Exception as exc:  # aiohttp raises several kinds; all mean "cannot reach"
            raise ConnectionError(f"Triton HTTP at {ready}: {exc}") from exc
        if not ok:
            raise ConnectionError(f"Triton HTTP at {ready}: model not ready (HTTP {resp.status})")

    async def generate(self, rec: RequestRecord, prompt: Prompt, params: dict) -> None:
        """POST one request and record each `data:` event."""
        body = model_inputs(prompt, params)
        rec.sent_ns = time.monotonic_ns()
        async with self.session.post(self.endpoint, json=body) as resp:
            if resp.status != 200:
                record_error(rec, f"HTTP {resp.status}: {(await resp.text()).strip()}")
                return
            async for line in resp.content:
                now = time.monotonic_ns()
                event = parse_sse_line(line)
                if event is None:
                    continue
                if "error" in event:
                    record_error(rec, str(event["error"]))
                    return
                timing = event.get("timing")
                record_response(
                    rec,
                    now,
                    text=event.get("text_output") or "",
                    tokens=event.get("num_output_tokens"),
                    timing=json.loads(timing) if timing else None,
                    finish_reason=event.get("finish_reason"),
                    input_tokens=event.get("num_input_tokens"),
                )
        if not rec.responses and rec.error is None:
            rec.error = "event stream ended without a response"

    async def close(self) -> None:
        """Close the session."""
        if self.session is not None:
            await self.session.close()
            self.session = None


# --- websocket bridge -------------------------------------------------------------------------


def bridge_request(gen_id: str, prompt: Prompt, params: dict) -> dict:
    """The bridge's `generate` message."""
    msg: dict = {"type": "generate", "id": gen_id, "params": params}
    if prompt.messages is not None:
        msg["messages"] = list(prompt.messages)
    else:
        msg["prompt"] = prompt.text or ""
    return msg


def bridge_server_timing(timing: dict | None) -> ServerTiming | None:
    """Server timestamps of the first token from a `done.timing` object, if it carries them."""
    if not timing:
        return None
    for candidate in (timing.get("server"), timing):
        if isinstance(candidate, dict) and "prefill_start_ns" in candidate:
            return ServerTiming.from_dict(candidate)
    return None


def record_bridge_message(rec: RequestRecord, recv_ns: int, msg: dict) -> bool:
    """Add one bridge message to the record; True when the generation is over."""
    kind = msg.get("type")
    seen = sum(r.tokens for r in rec.responses)
    if kind == "token":
        text = msg.get("text") or ""
        n = int(msg.get("n", seen + 1))
        rec.responses.append(Response(recv_ns=recv_ns, tokens=n - seen, chars=len(text)))
        return False
    if kind == "done":
        usage = msg.get("usage") or {}
        total = int(usage.get("completion_tokens", seen))
        # the done frame is the last response: request latency ends here
        rec.responses.append(Response(recv_ns=recv_ns, tokens=max(total - seen, 0), chars=0))
        rec.finish_reason = msg.get("finish_reason")
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.server_timing = bridge_server_timing(msg.get("timing"))
        rec.extra = {"bridge_timing": msg.get("timing")}
        return True
    if kind == "error":
        code = str(msg.get("code", ""))
        message = f"{code}: {msg.get('message', '')}".strip(": ")
        record_error(rec, message, cancelled="cancel" in code.lower())
        return True
    return False


class BridgeConnection:
    """One websocket to the bridge; a reader task routes messages to generations by id."""

    def __init__(self, ws):
        self.ws = ws
        self.pending: dict[str, asyncio.Queue] = {}
        self.ids = itertools.count()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        """Route each frame by id; a frame without one (or a closed socket) goes to everyone."""
        try:
            async for raw in self.ws:
                now = time.monotonic_ns()
                msg = json.loads(raw)
                queue = self.pending.get(str(msg.get("id")))
                targets = [queue] if queue is not None else list(self.pending.values())
                for q in targets:
                    q.put_nowait((now, msg))
        except Exception as exc:  # connection lost: every open generation ends in an error
            self._fail_all(f"websocket failed: {exc!r}")
        else:
            self._fail_all("websocket closed by the bridge")

    def _fail_all(self, message: str) -> None:
        """End every open generation with an error message."""
        now = time.monotonic_ns()
        for q in self.pending.values():
            q.put_nowait((now, {"type": "error", "code": "closed", "message": message}))

    async def generate(self, rec: RequestRecord, prompt: Prompt, params: dict) -> None:
        """Send one generate message and record messages until done or error."""
        gen_id = f"{rec.index}-{next(self.ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self.pending[gen_id] = queue
        finished = False
        try:
            frame = json.dumps(bridge_request(gen_id, prompt, params))
            rec.sent_ns = time.monotonic_ns()
            await self.ws.send(frame)
            while not finished:
                recv_ns, msg = await queue.get()
                finished = record_bridge_message(rec, recv_ns, msg)
        finally:
            del self.pending[gen_id]
            if not finished:
                await self._cancel(gen_id)

    async def _cancel(self, gen_id: str) -> None:
        """Ask the bridge to stop a generation we abandoned (best effort)."""
        try:
            await self.ws.send(json.dumps({"type": "cancel", "id": gen_id}))
        except Exception:  # the socket is gone: the bridge cancels on close by itself
            pass

    async def close(self) -> None:
        """Close the socket and wait for the reader."""
        await self.ws.close()
        await asyncio.gather(self.reader, return_exceptions=True)


class WsTransport:
    """The websocket bridge: one connection per concurrent slot, as a chat page holds one."""

    name = "ws"

    def __init__(self, url: str, token: str | None = None, max_connections: int = 64):
        self.url, self.token, self.max_connections = url, token, max_connections
        self.conns: list[BridgeConnection] = []
        self._next: Iterator[BridgeConnection] | None = None

    async def open(self, slots: int) -> None:
        """Open connections up to min(slots, max_connections); requests go round-robin."""
        from websockets.asyncio.client import connect

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        while len(self.conns) < max(1, min(slots, self.max_connections)):
            try:
                ws = await connect(self.url, additional_headers=headers, max_size=None)
            except Exception as exc:  # refused, wrong path, 401/403: one clear message
                raise ConnectionError(f"bridge websocket at {self.url}: {exc}") from exc
            self.conns.append(BridgeConnection(ws))
        self._next = itertools.cycle(list(self.conns))

    async def generate(self, rec: RequestRecord, prompt: Prompt, params: dict) -> None:
        """Run one generation on the next connection."""
        await next(self._next).generate(rec, prompt, params)

    async def close(self) -> None:
        """Close every connection."""
        await asyncio.gather(*(c.close() for c in self.conns), return_exceptions=True)
        self.conns = []


def make_transport(name: str, *, triton: str, url: str, bridge: str, model: str, token=None):
    """A transport by name."""
    if name == "grpc":
        return GrpcTransport(triton, model)
    if name == "sse":
        return SseTransport(url, model)
    if name == "ws":
        return WsTransport(bridge, token)
    raise ValueError(f"unknown transport {name!r}; choose from {', '.join(TRANSPORTS)}")
