"""The bridge's websocket frames -> Chunks, and one websocket shared by many generations.

The bridge sends `token` frames ({"text", "n": tokens so far}), then one `done` frame (finish
reason, usage, and under timing.server the first token's server stamps) or one `error` frame;
clients/bridge/protocol.py names every word of them.
A generation that receives no frame for `idle_timeout_s` fails with `unavailable`, as on the
other transports.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence

from clients.bridge import protocol as p
from clients.library.chunk import (
    DEFAULT_IDLE_TIMEOUT_S,
    Chunk,
    GenerationError,
    parse_timing,
    within_idle_timeout,
)
from streaming_backend.wire import CANCELLED, FINISH_REASON, MESSAGES, TIMING, FinishReason


def bridge_request(
    gen_id: str, prompt: str | None, messages: Sequence[Mapping] | None, params: Mapping
) -> dict:
    """The bridge's `generate` message: a chat as `messages`, plain text as `prompt`."""
    msg: dict = {p.TYPE: p.GENERATE, p.ID: gen_id, p.PARAMS: dict(params)}
    if messages is not None:
        msg[MESSAGES] = list(messages)
    else:
        msg[p.PROMPT] = prompt or ""
    return msg


def done_timing(msg: Mapping):
    """The first token's server stamps of a `done` frame (timing.server), if it carries them."""
    timing = msg.get(TIMING) or {}
    for candidate in (timing.get(p.SERVER), timing):
        if isinstance(candidate, dict):
            try:
                return parse_timing(candidate)
            except (KeyError, TypeError, ValueError):  # not the stamps: the next candidate
                continue
    return None


def frame_chunk(msg: Mapping, tokens_so_far: int, received_ns: int) -> Chunk | None:
    """A Chunk from a token or done frame; an error frame raises GenerationError; else None."""
    kind, gen_id = msg.get(p.TYPE), str(msg.get(p.ID))
    if kind == p.TOKEN:
        n = int(msg.get(p.COUNT, tokens_so_far + 1))
        text = msg.get(p.TEXT) or ""
        return Chunk.delta(text, n - tokens_so_far, received_ns, request_id=gen_id)
    if kind == p.DONE:
        usage = msg.get(p.USAGE) or {}
        rest = max(int(usage.get(p.COMPLETION_TOKENS, tokens_so_far)) - tokens_so_far, 0)
        # the done frame is the last response: request latency ends here
        return Chunk.last(
            rest,
            received_ns,
            prompt_tokens=usage.get(p.PROMPT_TOKENS),
            finish_reason=msg.get(FINISH_REASON) or FinishReason.STOP.value,
            request_id=gen_id,
        )
    if kind == p.ERROR:
        code = str(msg.get(p.CODE, ""))
        message = f"{code}: {msg.get(p.MESSAGE, '')}".strip(": ")
        raise GenerationError(message, CANCELLED.code if "cancel" in code.lower() else code)
    return None


class BridgeConnection:
    """One websocket to the bridge; a reader task routes frames to generations by id."""

    def __init__(self, ws, idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S):
        self.ws = ws
        self.idle_timeout_s = idle_timeout_s  # per frame of a generation; None: no limit
        self.pending: dict[str, asyncio.Queue] = {}
        self.ids = itertools.count()
        self.reader = asyncio.create_task(self._read())

    def new_id(self, prefix: str) -> str:
        """A generation id unique on this connection."""
        return f"{prefix}-{next(self.ids)}"

    async def _read(self) -> None:
        """Route each frame by id; a frame without one (or a closed socket) goes to everyone."""
        try:
            async for raw in self.ws:
                now = time.monotonic_ns()
                msg = json.loads(raw)
                queue = self.pending.get(str(msg.get(p.ID)))
                targets = [queue] if queue is not None else list(self.pending.values())
                for q in targets:
                    q.put_nowait((now, msg))
        except Exception as exc:  # connection lost: every open generation ends in an error
            self._fail_all(f"websocket failed: {exc!r}")
        else:
            self._fail_all("websocket closed by the bridge")

    def _fail_all(self, message: str) -> None:
        """End every open generation with an error frame."""
        now = time.monotonic_ns()
        for q in self.pending.values():
            q.put_nowait((now, {p.TYPE: p.ERROR, p.CODE: p.CLOSED, p.MESSAGE: message}))

    async def frames(self, request: dict) -> AsyncIterator[tuple[int, dict]]:
        """Send a generate message; yield (received_ns, frame) up to its done or error frame.

        GenerationError (`unavailable`) when no frame of it arrives for `idle_timeout_s`; the
        bridge is then asked to cancel it."""
        gen_id = request[p.ID]
        queue: asyncio.Queue = asyncio.Queue()
        self.pending[gen_id] = queue
        finished = False
        try:
            await self.ws.send(json.dumps(request))
            while not finished:
                received_ns, msg = await within_idle_timeout(queue.get(), self.idle_timeout_s)
                finished = msg.get(p.TYPE) in p.ENDING_TYPES
                yield received_ns, msg
        finally:
            del self.pending[gen_id]
            if not finished:
                await self._cancel(gen_id)

    async def _cancel(self, gen_id: str) -> None:
        """Ask the bridge to stop a generation we abandoned (best effort)."""
        try:
            await self.ws.send(json.dumps({p.TYPE: p.CANCEL, p.ID: gen_id}))
        except Exception:  # the socket is gone: the bridge cancels on close by itself
            pass

    async def close(self) -> None:
        """Close the socket and wait for the reader."""
        await self.ws.close()
        await asyncio.gather(self.reader, return_exceptions=True)
