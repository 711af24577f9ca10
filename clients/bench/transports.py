"""Transports the benchmark drives: gRPC stream_infer, HTTP generate_stream (SSE), the ws bridge,
the bridge's OpenAI-compatible API.

Each transport is a thin driver over a client of clients/ (grpc_client, sse_client, ws_client,
openai_client),
which turn responses into Chunks; it fills a RequestRecord: `sent_ns` right before the request
leaves and every Chunk (stamped the moment it arrived, CLOCK_MONOTONIC ns). A new transport is
one more class here, over a converter to Chunks in its own clients/ module.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Protocol

from clients.bench.summary import RequestRecord
from clients.library.chunk import Chunk, GenerationError
from clients.library.request import GenerateRequest
from streaming_backend.wire import CANCELLED, CHAT_MODEL, TIMING

TRANSPORTS = ("grpc", "sse", "ws", "openai")
# Those that carry chat messages (GenerateRequest.messages), so a multi-turn conversation: each of
# them today (a transport of plain text or token ids alone would be left out here).
CHAT_TRANSPORTS = ("grpc", "sse", "ws", "openai")


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


def generate_request(prompt: Prompt, params: dict) -> GenerateRequest:
    """The request the benchmark sends: streamed, with token counts and server timing."""
    return GenerateRequest(
        prompt=(prompt.text or "") if prompt.messages is None else None,
        messages=prompt.messages,
        sampling=params,
        return_timing=True,
    )


def record_error(rec: RequestRecord, message: str, cancelled: bool = False) -> None:
    """Record a failed request; the model's `cancelled` category counts as a cancellation."""
    rec.error = message
    rec.cancelled = cancelled or message.lower().lstrip().startswith(CANCELLED.prefix)


async def record_chunks(rec: RequestRecord, chunks: AsyncIterator[Chunk]) -> None:
    """Append every Chunk of a generation to `rec`; a GenerationError becomes rec.error."""
    try:
        async for chunk in chunks:
            rec.chunks.append(chunk)
    except GenerationError as exc:
        record_error(rec, exc.message, cancelled=exc.code == CANCELLED.code)
    finally:
        await chunks.aclose()


class GrpcTransport:
    """tritonclient.grpc.aio stream_infer through clients.library.grpc_client: a stream each."""

    name = "grpc"

    def __init__(self, url: str, model: str = CHAT_MODEL):
        self.url, self.model = url, model
        self.client = None

    async def open(self, slots: int) -> None:
        """Create the channel (one HTTP/2 connection multiplexes every stream)."""
        from clients.library.grpc_client import AsyncChatClient

        if self.client is None:
            self.client = AsyncChatClient(self.url, self.model)
            if not await self.client.is_ready():
                raise ConnectionError(f"Triton gRPC at {self.url}: model {self.model!r} not ready")

    async def generate(self, rec: RequestRecord, prompt: Prompt, params: dict) -> None:
        """Stream one request; leaving early cancels it upstream (the client's aclose)."""
        request = generate_request(prompt, params)
        # as perf_analyzer does: stamped right before the call that builds and writes it
        rec.sent_ns = time.monotonic_ns()
        await record_chunks(rec, self.client.generate(request, request_id=str(rec.index)))

    async def close(self) -> None:
        """Close the channel."""
        if self.client is not None:
            await self.client.close()
            self.client = None


class EventStreamTransport:
    """A transport over one aiohttp session whose server answers each POST with an event stream
    (SseTransport, OpenAITransport): a subclass checks the server once and opens a stream."""

    session = None

    async def open(self, slots: int) -> None:
        """One aiohttp session; no connection cap, so the runner alone sets concurrency."""
        import aiohttp

        if self.session is None:
            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
            self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
            await self.check()

    async def check(self) -> None:
        """Ask the server once, so a wrong URL, token or model fails once and clearly."""
        raise NotImplementedError

    def stream(self, request: GenerateRequest, rec: RequestRecord) -> AsyncIterator[Chunk]:
        """The Chunks of one request, through this transport's client."""
        raise NotImplementedError

    async def generate(self, rec: RequestRecord, prompt: Prompt, params: dict) -> None:
        """POST one streamed request and record each event's Chunk."""
        request = generate_request(prompt, params)
        rec.sent_ns = time.monotonic_ns()
        await record_chunks(rec, self.stream(request, rec))
        if not rec.chunks and rec.error is None:
            rec.error = "event stream ended without a response"

    async def close(self) -> None:
        """Close the session."""
        if self.session is not None:
            await self.session.close()
            self.session = None


class SseTransport(EventStreamTransport):
    """Triton's HTTP POST /v2/models/<model>/generate_stream through clients.library.sse_client."""

    name = "sse"

    def __init__(self, url: str, model: str = CHAT_MODEL):
        from clients.library.sse_client import generate_stream_url

        self.endpoint = generate_stream_url(url, model)

    async def check(self) -> None:
        """GET the model's ready endpoint."""
        ready = self.endpoint.rsplit("/", 1)[0] + "/ready"
        try:
            async with self.session.get(ready) as resp:
                ok = resp.status == 200
        except Exception as exc:  # aiohttp raises several kinds; all mean "cannot reach"
            raise ConnectionError(f"Triton HTTP at {ready}: {exc}") from exc
        if not ok:
            raise ConnectionError(f"Triton HTTP at {ready}: model not ready (HTTP {resp.status})")

    def stream(self, request: GenerateRequest, rec: RequestRecord) -> AsyncIterator[Chunk]:
        """generate_stream's events as Chunks, the record's index as the request id."""
        from clients.library.sse_client import generate

        return generate(self.session, self.endpoint, request, str(rec.index))


class OpenAITransport(EventStreamTransport):
    """The bridge's OpenAI-compatible API (/v1, streamed) through clients.library.openai_client."""

    name = "openai"

    def __init__(self, base_url: str, model: str = CHAT_MODEL, api_key: str | None = None):
        self.base_url, self.model, self.api_key = base_url.rstrip("/"), model, api_key

    async def check(self) -> None:
        """GET /v1/models: the model must be listed."""
        url = f"{self.base_url}/v1/models"
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            async with self.session.get(url, headers=headers) as resp:
                status, body = resp.status, await resp.text()
        except Exception as exc:  # aiohttp raises several kinds; all mean "cannot reach"
            raise ConnectionError(f"OpenAI API at {url}: {exc}") from exc
        if status != 200 or f'"{self.model}"' not in body:
            raise ConnectionError(f"OpenAI API at {url}: HTTP {status}, no model {self.model!r}")

    def stream(self, request: GenerateRequest, rec: RequestRecord) -> AsyncIterator[Chunk]:
        """The API's streamed events as Chunks."""
        from clients.library.openai_client import generate

        return generate(self.session, self.base_url, request, self.model, self.api_key)


class WsTransport:
    """The websocket bridge: one connection per concurrent slot, as a chat page holds one."""

    name = "ws"

    def __init__(self, url: str, token: str | None = None, max_connections: int = 64):
        self.url, self.token, self.max_connections = url, token, max_connections
        self.conns: list = []
        self._next: Iterator | None = None

    async def open(self, slots: int) -> None:
        """Open connections up to min(slots, max_connections); requests go round-robin."""
        from websockets.asyncio.client import connect

        from clients.bridge.ws_client import BridgeConnection

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
        await bridge_generate(next(self._next), rec, prompt, params)

    async def close(self) -> None:
        """Close every connection."""
        import asyncio

        await asyncio.gather(*(c.close() for c in self.conns), return_exceptions=True)
        self.conns = []


async def bridge_generate(conn, rec: RequestRecord, prompt: Prompt, params: dict) -> None:
    """One generation over a BridgeConnection: its frames become Chunks in `rec`."""
    from clients.bridge.ws_client import bridge_request, done_timing, frame_chunk

    msg = bridge_request(conn.new_id(str(rec.index)), prompt.text, prompt.messages, params)
    rec.sent_ns = time.monotonic_ns()
    frames = conn.frames(msg)
    try:
        async for received_ns, frame in frames:
            chunk = frame_chunk(frame, rec.output_tokens(), received_ns)
            if chunk is not None:
                rec.chunks.append(chunk)
            if chunk is not None and chunk.final:
                rec.first_token_timing = done_timing(frame)
                rec.extra = {"bridge_timing": frame.get(TIMING)}
    except GenerationError as exc:
        record_error(rec, exc.message, cancelled=exc.code == CANCELLED.code)
    finally:
        await frames.aclose()


def make_transport(
    name: str, *, triton: str, url: str, bridge: str, model: str, token=None, openai: str = ""
):
    """A transport by name."""
    if name == "grpc":
        return GrpcTransport(triton, model)
    if name == "sse":
        return SseTransport(url, model)
    if name == "ws":
        return WsTransport(bridge, token)
    if name == "openai":
        return OpenAITransport(openai, model, token)
    raise ValueError(f"unknown transport {name!r}; choose from {', '.join(TRANSPORTS)}")
