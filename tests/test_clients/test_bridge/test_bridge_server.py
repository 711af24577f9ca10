"""Tests of clients/bridge/server.py: the Bridge's lifetime, its entry point, and Triton going
away and coming back under it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import pytest
from bridge_support import (
    FAST,
    bridge_to,
    collect,
    frame,
    free_port,
    http_get,
    next_frame,
    ws_url,
)
from websockets.asyncio.client import connect

from clients.bridge import HEALTH_PATH, Bridge, BridgeConfig, serve_bridge


async def _accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


async def test_serve_bridge_stops_on_event():
    """serve_bridge listens until its stop event is set, then returns and frees the port."""
    port = free_port()
    cfg = BridgeConfig(triton_url=f"127.0.0.1:{free_port()}", **{**FAST, "port": port})
    stop = asyncio.Event()
    task = asyncio.create_task(serve_bridge(cfg, stop))
    while not await _accepts(port):
        assert not task.done(), task.exception()
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert not await _accepts(port)


async def test_port_taken_fails_cleanly():
    """A bridge whose port is taken raises OSError and leaves no task running."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = BridgeConfig(triton_url=f"127.0.0.1:{free_port()}", port=taken.getsockname()[1])
        before = len(asyncio.all_tasks())
        with pytest.raises(OSError):
            async with Bridge(cfg):
                pass
        assert len(asyncio.all_tasks()) == before


async def wait_health(bridge: Bridge, ready: bool, timeout: float = 30.0) -> float:
    """Seconds until /healthz says `ready` (fails after `timeout`)."""
    start = time.monotonic()
    while True:
        status, _, body = await http_get(bridge, HEALTH_PATH)
        if json.loads(body)["ready"] is ready and (status == 200) is ready:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"/healthz stuck at {status} {body!r}"
        await asyncio.sleep(0.1)


@pytest.mark.server
async def test_triton_restarted_under_the_bridge(tiny_model_dir):
    """Triton dies mid-stream: an error frame, /healthz 503; back on its port: the socket works."""
    from conftest import server_config

    from streaming_backend.launcher import TritonServer
    from streaming_backend.wire import CHAT_MODEL

    config = server_config(
        tiny_model_dir,
        models=(CHAT_MODEL,),  # not the dialogue_model
        test_token_delay_ms=20,  # "a" is still streaming at the crash
    )
    first = TritonServer(config, on_log=None).start()
    second = None
    try:
        await asyncio.to_thread(first.wait_ready)
        async with bridge_to(first) as bridge, connect(ws_url(bridge), ping_interval=None) as ws:
            params = {"max_tokens": 220, "ignore_eos": True}
            await ws.send(frame(type="generate", id="a", prompt="Before", params=params))
            await next_frame(ws)
            os.kill(first.pid, signal.SIGKILL)  # a crash, with "a" still streaming
            end = (await collect(ws, {"a"}, timeout=30))["a"][-1]
            assert (end["type"], end["code"]) == ("error", "unavailable")
            await asyncio.to_thread(first.stop)  # reaps the stub and the shm region
            await wait_health(bridge, ready=False)
            await ws.send(frame(type="generate", id="b", prompt="During", params=params))
            err = (await collect(ws, {"b"}))["b"][-1]
            assert (err["type"], err["code"]) == ("error", "unavailable")
            assert "not ready" in err["message"]

            second = TritonServer(config, on_log=None).start()
            await asyncio.to_thread(second.wait_ready)
            back_in = await wait_health(bridge, ready=True)
            short = {"max_tokens": 4, "ignore_eos": True}
            await ws.send(frame(type="generate", id="c", prompt="After", params=short))
            assert (await collect(ws, {"c"}))["c"][-1]["usage"]["completion_tokens"] == 4
        assert back_in < 10
    finally:  # killed: nothing is left to drain
        first.stop(graceful=False)
        if second is not None:
            second.stop(graceful=False)
