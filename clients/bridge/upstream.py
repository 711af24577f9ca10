"""What a websocket connection and the OpenAI API need of the bridge that runs them: its
settings, whether it takes generations now, and one generation's stream of Chunks.

server.py's Bridge is one. connection.py and openai_api.py take it through this interface (and
app.py through its `Site`, one step wider), so none of them imports server.py, which imports them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from clients.bridge.config import BridgeConfig
from clients.library.chunk import Chunk
from clients.library.request import GenerateRequest


class Upstream(Protocol):
    """The bridge as one connection or one API handler sees it."""

    cfg: BridgeConfig

    @property
    def ready(self) -> bool:
        """Triton, and whatever else the config names, is ready: a generation may start."""
        ...

    def generate(self, request: GenerateRequest, request_id: str) -> AsyncIterator[Chunk]:
        """One generation's Chunks; closing the iterator early cancels it upstream."""
        ...
