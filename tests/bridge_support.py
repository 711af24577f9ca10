"""Helpers shared by the bridge's test files: a bridge on a free port, HTTP and websocket reads,
and the model's metrics read from Triton's metrics port."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import urllib.error
import urllib.request
from contextlib import asynccontextmanager

from clients.bridge import WS_PATH, Bridge, BridgeConfig

FAST = dict(port=0, health_interval_s=0.2, close_timeout_s=1.0)


def frame(**fields) -> str:
    """A client frame as JSON text (ASCII escapes, so lone surrogates can be sent)."""
    return json.dumps(fields)


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def running_bridge(**overrides):
    """A Bridge on a free port; Triton defaults to an address where nothing listens."""
    cfg = BridgeConfig(**{"triton_url": f"127.0.0.1:{free_port()}", **FAST, **overrides})
    async with Bridge(cfg) as bridge:
        yield bridge


@asynccontextmanager
async def bridge_to(server, **overrides):
    """A Bridge in front of a real tritonserver."""
    async with running_bridge(triton_url=server.grpc_url, **overrides) as bridge:
        yield bridge


def ws_url(bridge: Bridge, query: str = "") -> str:
    """The bridge's websocket URL."""
    return f"ws://127.0.0.1:{bridge.port}{WS_PATH}{query}"


async def http_get(bridge: Bridge, path: str, headers=None) -> tuple[int, dict, bytes]:
    """GET from the bridge in a thread (the bridge runs on this test's event loop)."""

    def get():
        request = urllib.request.Request(
            f"http://127.0.0.1:{bridge.port}{path}", headers=headers or {}
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=10) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    return await asyncio.to_thread(get)


async def next_frame(ws, timeout: float = 30.0) -> dict:
    """The next frame from the bridge, parsed."""
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def collect(ws, ids: set[str], timeout: float = 120.0) -> dict[str, list[dict]]:
    """Frames by id until every id in `ids` got its done or error."""
    frames: dict[str, list[dict]] = {i: [] for i in ids}
    open_ids = set(ids)
    while open_ids:
        got = await next_frame(ws, timeout)
        frames[got["id"]].append(got)
        if got["type"] in ("done", "error"):
            open_ids.discard(got["id"])
    return frames


def metric(server, name: str) -> float:
    """One of the model's metrics on Triton's metrics port, summed over its label sets."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    values = re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert values, f"the model exports no {name}"
    return sum(float(v) for v in values)


def active_streams(server) -> float:
    """The model's active-streams gauge."""
    return metric(server, "tokenstream_active_streams")


def tokens_generated(server) -> float:
    """The model's output-token counter."""
    return metric(server, "tokenstream_generation_tokens_total")


async def wait_idle_engine(server, timeout: float = 10.0) -> float:
    """Seconds until the active-streams gauge reads 0 (fails after `timeout`)."""
    start = time.monotonic()
    while (value := await asyncio.to_thread(active_streams, server)) != 0:
        assert time.monotonic() - start < timeout, f"active streams stuck at {value}"
        await asyncio.sleep(0.05)
    return time.monotonic() - start
