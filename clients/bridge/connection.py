"""One websocket client: its messages, its generations, its bounded outbox, its lifetime.

Shaped like the websockets documentation: `async for message in websocket`, the reader, the
sender and two watchdogs run as tasks under `asyncio.wait(..., FIRST_COMPLETED)`, and whatever is
still pending is cancelled. Each generation is a task relaying one gRPC stream; it ends with
exactly one `done` or one `error` frame, whatever goes wrong (except when the socket is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from typing import Any

from clients.bridge import protocol as p
from clients.bridge.frames import Trace, done_frame, error_frame, token_frame
from clients.bridge.http import token_matches
from clients.bridge.messages import Auth, Cancel, Generate, ProtocolError, parse_message
from clients.bridge.upstream import Upstream
from clients.bridge.websocket import SocketClosed, WebSocket
from clients.library.aio import within
from clients.library.chunk import Chunk
from clients.library.grpc_client import GenerationError
from streaming_backend.wire import INTERNAL, UNAVAILABLE, FinishReason

log = logging.getLogger("tokenstream.bridge")

Close = tuple[int, str]  # a websocket close code and reason


class Connection:
    """One websocket client: its generations, its bounded outbox, its lifetime."""

    def __init__(self, bridge: Upstream, ws: WebSocket, number: int, authed: bool) -> None:
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
        with contextlib.suppress(SocketClosed, TimeoutError):
            while not self.outbox.empty():
                frame = self.outbox.get_nowait()
                await within(self.ws.send(frame), self.cfg.close_timeout_s)

    async def receive(self) -> Close | None:
        """Handle client frames until the socket closes; a reason to close, if any."""
        with contextlib.suppress(SocketClosed):
            async for message in self.ws:
                self.last_activity = time.monotonic()
                close = self.handle(message)
                if close is not None:
                    return close
        return None

    def handle(self, message: str | bytes) -> Close | None:
        """Act on one frame; a close reason when the client must be dropped."""
        try:
            msg = parse_message(message)
        except ProtocolError as exc:
            self.post(error_frame(exc.gen_id, exc.code, exc.message))
            return None if self.authed else (1008, "authentication required")
        if not self.authed:
            if isinstance(msg, Auth) and token_matches(msg.token, self.cfg.token):
                self.authed = True
                return None
            self.post(error_frame(None, p.UNAUTHORIZED, "send {type: auth, token} first"))
            return (1008, "authentication required")
        if isinstance(msg, Generate):
            self.start(msg)
        elif isinstance(msg, Cancel):
            self.cancel(msg.gen_id)
        return None

    def start(self, msg: Generate) -> None:
        """Start one generation unless the id is taken, the cap is hit or Triton is down."""
        if msg.gen_id in self.generations:
            self.post(error_frame(msg.gen_id, p.DUPLICATE_ID, "a generation with this id runs"))
        elif len(self.generations) >= self.cfg.max_concurrent:
            limit = self.cfg.max_concurrent
            self.post(error_frame(msg.gen_id, p.TOO_MANY, f"at most {limit} generations at once"))
        elif not self.bridge.ready:
            text = f"Triton at {self.cfg.triton_url} is not ready; retry shortly"
            self.post(error_frame(msg.gen_id, UNAVAILABLE.code, text))
        else:
            self.generations[msg.gen_id] = asyncio.create_task(self.generate(msg))

    def cancel(self, gen_id: str) -> None:
        """Cancel one generation; unknown ids are ignored (it may have just finished)."""
        task = self.generations.get(gen_id)
        if task is not None:
            self.client_cancelled.add(gen_id)
            task.cancel()

    async def generate(self, msg: Generate) -> None:
        """Relay one generation: token frames, then exactly one done or one error frame."""
        trace = Trace(accepted_ns=time.monotonic_ns())
        request_id = f"ws{self.number}-{uuid.uuid4().hex[:12]}"
        try:
            finish_reason = await self.relay_stream(msg, request_id, trace)
            self.post(done_frame(msg.gen_id, finish_reason, trace, time.monotonic_ns()))
        except GenerationError as exc:
            self.post(error_frame(msg.gen_id, exc.code, exc.message))
        except asyncio.CancelledError:
            if msg.gen_id not in self.client_cancelled:
                raise  # the connection is going away: nobody to tell
            # The client asked for this cancel: it ends the generation, not this task's caller.
            task = asyncio.current_task()
            if hasattr(task, "uncancel"):  # Python >= 3.11
                task.uncancel()
            cancelled = FinishReason.CANCELLED.value
            self.post(done_frame(msg.gen_id, cancelled, trace, time.monotonic_ns()))
        except Exception as exc:  # a bug, not the client's fault: say so and keep the socket
            log.exception("generation %s (%s) failed", msg.gen_id, request_id)
            text = f"{INTERNAL.prefix}: the bridge failed ({type(exc).__name__}); see its log"
            self.post(error_frame(msg.gen_id, INTERNAL.code, text))
        finally:
            self.client_cancelled.discard(msg.gen_id)
            self.generations.pop(msg.gen_id, None)
            self.last_activity = time.monotonic()  # idle time counts from the last answer

    async def relay_stream(self, msg: Generate, request_id: str, trace: Trace) -> str:
        """Forward the upstream stream's chunks as token frames; its finish reason."""
        finish_reason = None
        trace.upstream_ns = time.monotonic_ns()
        chunks = self.bridge.generate(msg.request, request_id)
        async with contextlib.aclosing(chunks):  # leaving early cancels the stream upstream
            async for chunk in chunks:
                finish_reason = self.relay(msg.gen_id, chunk, trace) or finish_reason
        return finish_reason or FinishReason.STOP.value

    def relay(self, gen_id: str, chunk: Chunk, trace: Trace) -> str | None:
        """Forward one chunk as a token frame; its finish reason, if it has one."""
        trace.observe(chunk)
        if chunk.text or chunk.num_output_tokens:
            trace.relayed(chunk, time.monotonic_ns())
            self.post(token_frame(gen_id, chunk.text, trace.completion_tokens))
        return chunk.finish_reason

    def post(self, frame: dict[str, Any]) -> None:
        """Queue a frame for the client; a full queue marks the client too slow."""
        try:
            self.outbox.put_nowait(json.dumps(frame, ensure_ascii=False))
        except asyncio.QueueFull:
            self.overflow.set()

    async def send_loop(self) -> Close | None:
        """Send queued frames in order; a client that stops reading ends the connection."""
        while True:
            frame = await self.outbox.get()
            try:
                await within(self.ws.send(frame), self.cfg.send_timeout_s)
            except TimeoutError:
                return (1008, "client too slow: a frame waited too long")
            except SocketClosed:
                return None

    async def watch_overflow(self) -> Close:
        """End the connection when the outbox overflows."""
        await self.overflow.wait()
        return (1008, "client too slow: send queue full")

    async def watch_idle(self) -> Close:
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
