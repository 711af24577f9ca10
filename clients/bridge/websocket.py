"""The websocket as a Connection sees it: text frames in (`async for`), `send`, `close`, and the
transport; an adapter over aiohttp's WebSocketResponse, so connection.py keeps the shape of the
websockets documentation whatever serves the socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import WSMsgType, web


class SocketClosed(Exception):
    """The websocket is closed (by the peer, a protocol error, or us)."""


class WebSocket:
    """One accepted websocket: frames in, frames out, close."""

    def __init__(self, ws: web.WebSocketResponse, transport: asyncio.BaseTransport) -> None:
        self._ws = ws
        self.transport = transport

    async def __aiter__(self) -> AsyncIterator[str | bytes]:
        """Text and binary frames until the socket closes (aiohttp answers pings and closes)."""
        async for message in self._ws:
            if message.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                yield message.data
            elif message.type is WSMsgType.ERROR:
                return  # e.g. a frame over the size limit: aiohttp already closed with 1009

    async def send(self, text: str) -> None:
        """Send one text frame; waits while the client's socket is backed up."""
        if self._ws.closed:
            raise SocketClosed("the websocket is closed")
        try:
            await self._ws.send_str(text)
        except ConnectionError as exc:  # aiohttp: "Cannot write to closing transport"
            raise SocketClosed(str(exc)) from None

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close with a code and reason (a no-op when already closed)."""
        await self._ws.close(code=code, message=reason.encode())

    @property
    def closed(self) -> bool:
        """True once the closing handshake started."""
        return self._ws.closed
