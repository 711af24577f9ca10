"""Scale-out across Triton replicas: real tritonservers on 127.0.0.2, 127.0.0.3 (and 127.0.0.4
later), the same ports on each (all of 127.0.0.0/8 is on `lo`), clients spreading generations
over them with gRPC's round_robin (clients/library/targets.py), failing over before the first token
(clients/library/failover.py) and watching each replica (clients/library/replica_health.py).

Each replica's share is read from its own metrics port (tokenstream_generation_tokens_total).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import suppress
from pathlib import Path

import pytest
from bridge_support import collect, http_get, metric, running_bridge, tokens_generated, ws_url
from conftest import REPO_ROOT, server_config
from websockets.asyncio.client import connect

from clients.bench.cli import add_arguments, config_from_args, run_bench
from clients.bridge import HEALTH_PATH
from clients.library.targets import parse_target
from streaming_backend.launcher import TritonServer, free_port
from streaming_backend.wire import CHAT_MODEL

pytestmark = pytest.mark.server

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
TOKEN_DELAY_MS = 10  # spacing of tokens, so long streams are still open when a replica stops
CONNECTION_AGE_S = 2.0  # short, so the tests see connections recycled under running streams
ENDING_TIMEOUT_S = 120  # a generation's whole run; generous: a loaded 2-core machine is slow
LONG_TOKENS = 100  # long enough to be open when its replica stops
PICKUP_SLACK_S = 5.0  # a connection's reconnect and the first stream, on a loaded machine
PROMPT = [{"role": "user", "content": "Count to ten."}]


def shared_ports() -> dict[str, int]:
    """HTTP, gRPC and metrics ports that are free on every test host right now."""
    ports: dict[str, int] = {}
    for name in ("http", "grpc", "metrics"):
        for _ in range(50):
            port = free_port(HOSTS[0])
            if port not in ports.values() and all(_free(h, port) for h in HOSTS[1:]):
                ports[name] = port
                break
    assert len(ports) == 3, "no ports free on every test host"
    return ports


def _free(host: str, port: int) -> bool:
    try:
        socket.create_server((host, port)).close()
    except OSError:
        return False
    return True


def replica(model_dir, host: str, ports: dict[str, int]) -> TritonServer:
    """A started (not yet ready) tritonserver on `host` with the shared ports."""
    config = server_config(
        model_dir,
        models=(CHAT_MODEL,),  # not the dialogue_model: its two instances slow every start
        max_streams=16,
        queue_limit=64,
        test_token_delay_ms=TOKEN_DELAY_MS,
        host=host,
        http_port=ports["http"],
        grpc_port=ports["grpc"],
        metrics_port=ports["metrics"],
        grpc_max_connection_age_s=CONNECTION_AGE_S,
    )
    return TritonServer(config, on_log=None).start()


def ready(*servers: TritonServer) -> None:
    """Wait until every server is ready (they load in parallel)."""
    for server in servers:
        server.wait_ready()


@pytest.fixture(scope="module")
def ports() -> dict[str, int]:
    return shared_ports()


@pytest.fixture(scope="module")
def pair(tiny_model_dir, ports):
    """Two replicas, on 127.0.0.2 and 127.0.0.3, same ports."""
    servers = [replica(tiny_model_dir, host, ports) for host in HOSTS[:2]]
    try:
        ready(*servers)
        yield servers
    finally:
        for server in servers:
            server.stop(graceful=False)  # nothing to drain


def list_target(ports, hosts=HOSTS[:2]) -> str:
    """The explicit-list target of `hosts` on the shared gRPC port."""
    return parse_target(",".join(f"{h}:{ports['grpc']}" for h in hosts)).uri


def tokens(servers) -> list[float]:
    """Each replica's output-token counter."""
    return [tokens_generated(s) if s.returncode is None else 0.0 for s in servers]


def generate_frame(gen_id: str, max_tokens: int) -> str:
    params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return json.dumps({"type": "generate", "id": gen_id, "messages": PROMPT, "params": params})


def assert_fair(shares: list[float], total: float) -> None:
    """Every replica served between half and one and a half times an equal share."""
    equal = total / len(shares)
    assert sum(shares) == total, (shares, total)
    assert all(0.5 * equal <= s <= 1.5 * equal for s in shares), shares


async def test_bridge_spreads_generations_over_replicas(pair, ports):
    """24 concurrent generations through one bridge on an `ipv4:` list: each replica serves a
    fair share (read from its own metrics port), and /healthz shows both replicas ready."""
    before = tokens(pair)
    async with running_bridge(triton_url=list_target(ports), max_concurrent=32) as bridge:
        status, _, body = await http_get(bridge, HEALTH_PATH)
        assert status == 200
        assert set(json.loads(body)["replicas"].values()) == {"ready"}
        assert len(json.loads(body)["replicas"]) == 2
        async with connect(ws_url(bridge)) as ws:
            ids = {f"g{i}" for i in range(24)}
            for gen_id in ids:
                await ws.send(generate_frame(gen_id, 16))
            frames = await collect(ws, ids)
    assert all(f[-1]["type"] == "done" for f in frames.values()), frames
    shares = [a - b for a, b in zip(tokens(pair), before)]
    print(f"bridge spread over 2 replicas (tokens): {shares}")
    assert_fair(shares, 24 * 16)


async def test_bench_spreads_over_replicas(pair, ports, tmp_path):
    """`tokenstream bench --triton ipv4:...` spreads its requests the same way."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--triton", ",".join(f"{h}:{ports['grpc']}" for h in HOSTS[:2]), "--concurrency", "8"]
        + ["--requests", "24", "--warmup", "0", "--output-tokens", "16", "--no-progress"]
    )
    before = tokens(pair)
    doc = await run_bench(config_from_args(args))
    assert doc["runs"][0]["summary"]["completed"] == 24
    shares = [a - b for a, b in zip(tokens(pair), before)]
    print(f"bench spread over 2 replicas (tokens): {shares}")
    assert_fair(shares, 24 * 16)


async def test_streams_outlive_the_connection_age(pair, ports):
    """A stream longer than the servers' maximum connection age finishes normally: the age
    only closes the connection to new streams (no grace limit is set)."""
    async with running_bridge(triton_url=list_target(ports)) as bridge:
        async with connect(ws_url(bridge)) as ws:
            await ws.send(generate_frame("long", 200))  # 200 x 10 ms > CONNECTION_AGE_S
            frames = await collect(ws, {"long"})
    assert frames["long"][-1]["type"] == "done", frames["long"][-1]
    assert frames["long"][-1]["usage"]["completion_tokens"] == 200


class Load:
    """Generations through one websocket, `workers` at a time, until stopped; every outcome."""

    def __init__(self, ws, workers: int, max_tokens: int) -> None:
        self.ws, self.workers, self.max_tokens = ws, workers, max_tokens
        self.outcomes: dict[str, tuple[float, dict]] = {}  # id -> (start time, last frame)
        self.waiters: dict[str, asyncio.Future] = {}
        self.token_frames: dict[str, int] = {}
        self.unexpected: list[dict] = []  # terminal frames that matched no running generation
        self.stop = asyncio.Event()
        self._count = 0

    async def run(self) -> None:
        reader = asyncio.create_task(self._read())
        try:
            await asyncio.gather(*(self._worker() for _ in range(self.workers)))
        finally:
            reader.cancel()
            with suppress(asyncio.CancelledError):
                await reader

    async def one(self, max_tokens: int) -> dict:
        """Run one generation; its last frame."""
        self._count += 1
        gen_id, started = f"q{self._count}", time.monotonic()
        self.waiters[gen_id] = asyncio.get_running_loop().create_future()
        await self.ws.send(generate_frame(gen_id, max_tokens))
        try:
            last = await asyncio.wait_for(self.waiters[gen_id], ENDING_TIMEOUT_S)
        except TimeoutError:
            raise AssertionError(
                f"{gen_id}: no ending in {ENDING_TIMEOUT_S} s, "
                f"{self.token_frames.get(gen_id)} tokens; {self.unexpected}"
            ) from None
        self.outcomes[gen_id] = (started, last)
        return last

    async def _worker(self) -> None:
        while not self.stop.is_set():
            await self.one(self.max_tokens)

    async def _read(self) -> None:
        async for message in self.ws:
            got = json.loads(message)
            if got["type"] not in ("done", "error"):
                self.token_frames[got.get("id")] = self.token_frames.get(got.get("id"), 0) + 1
                continue
            waiter = self.waiters.pop(got.get("id"), None)
            if waiter is None:  # a second ending, or an error about no generation
                self.unexpected.append(got)
            else:
                waiter.set_result(got)


async def wait_until(condition, timeout: float) -> float:
    """Seconds until `condition()` (run in a thread) is true; fails after `timeout`."""
    start = time.monotonic()
    while not await asyncio.to_thread(condition):
        assert time.monotonic() - start < timeout, "condition not reached in time"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_replica_added_then_stopped(pair, ports, tiny_model_dir, caplog):
    """A third replica, listed up front and started while clients run, gets new streams within
    gRPC's reconnect backoff (2 s); SIGTERM to it mid-run ends its open streams with a final
    response or a clear error, while every other generation succeeds on the two others."""
    caplog.set_level(logging.INFO, logger="tokenstream.client")
    third_host = HOSTS[2]
    target = list_target(ports, HOSTS)
    async with running_bridge(triton_url=target, max_concurrent=32) as bridge:
        assert bridge.replicas.states[f"{third_host}:{ports['grpc']}"] == "not ready"
        async with connect(ws_url(bridge)) as ws:
            load = Load(ws, workers=4, max_tokens=8)
            running = asyncio.create_task(load.run())
            third = replica(tiny_model_dir, third_host, ports)
            try:
                await asyncio.to_thread(ready, third)
                pickup = await wait_until(lambda: tokens_generated(third) > 0, 30)
                print(f"new replica served its first tokens {pickup:.2f} s after it was ready")
                await wait_until(
                    lambda: (
                        bridge.health()["replicas"]
                        == dict.fromkeys(bridge.health()["replicas"], "ready")
                    ),
                    10,
                )
                long_ones = [asyncio.create_task(load.one(LONG_TOKENS)) for _ in range(6)]
                await wait_until(lambda: metric(third, "tokenstream_active_streams") >= 1, 10)
                stopped_at = time.monotonic()
                seconds = await asyncio.to_thread(third.stop)
                print(f"SIGTERM to the third replica: stopped in {seconds:.2f} s")
                ended = await asyncio.gather(*long_ones)
                await asyncio.sleep(1.0)  # a few more generations after the stop
            finally:
                load.stop.set()
                await running
                third.stop()
    outcomes = list(load.outcomes.values())
    retries = [r.getMessage() for r in caplog.records if r.name == "tokenstream.client"]
    print(f"attempts retried on another replica: {len(retries)}", retries[:3])
    print("long streams when their replica stopped:", [_describe(f) for f in ended])
    print("generations that failed:", [_describe(last) for _, last in outcomes if _failed(last)])
    after = [last for start, last in outcomes if start > stopped_at]
    print(f"generations: {len(outcomes)}, started after the SIGTERM: {len(after)}")
    for _, last in outcomes:  # a final response, or a clear error for a stream cut short
        assert last["type"] == "done" or last["code"] in ("unavailable", "cancelled"), last
    assert after and not any(_failed(last) for last in after)


def _failed(last: dict) -> bool:
    return last["type"] != "done"


def _describe(last: dict) -> str:
    if last["type"] == "done":
        return f"done/{last['finish_reason']}/{last['usage']['completion_tokens']}"
    return f"error/{last['code']}: {last['message'][:80]}"


NAME = "replicas.tokenstream.test"


def can_unshare() -> bool:
    """Whether this process may make a private mount namespace (root, or user namespaces)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = [unshare, "-m", "sh", "-c", "mount --bind /etc/hosts /etc/hosts"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def bridge_with_hosts(hosts_file: Path, target: str, port: int, log: Path) -> subprocess.Popen:
    """`tokenstream bridge` in a private mount namespace where /etc/hosts is `hosts_file`."""
    script = 'mount --bind "$1" /etc/hosts && shift && exec "$@"'
    bridge = [sys.executable, "-m", "clients.cli", "bridge", "--triton", target]
    bridge += ["--port", str(port), "--max-concurrent", "32", "--log-level", "INFO"]
    with log.open("w") as out:
        return subprocess.Popen(
            [shutil.which("unshare"), "-m", "sh", "-c", script, "sh", str(hosts_file), *bridge],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )


def health(port: int) -> dict | None:
    """The bridge's /healthz body, None while it does not answer."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}{HEALTH_PATH}", timeout=5) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())
    except OSError:
        return None


@pytest.mark.skipif(not can_unshare(), reason="needs a private mount namespace (unshare -m)")
async def test_new_replica_found_through_a_name(pair, ports, tiny_model_dir, tmp_path):
    """A bridge on `dns:///name:port`, the name resolving to two replicas (a hosts file in the
    bridge's own mount namespace): a third address added to the name while clients run gets new
    streams within the servers' maximum connection age plus gRPC's re-resolution delay."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("".join(f"{h} {NAME}\n" for h in HOSTS[:2]) + "127.0.0.1 localhost\n")
    port = free_port("127.0.0.1")
    target = f"dns:///{NAME}:{ports['grpc']}"
    process = bridge_with_hosts(hosts_file, target, port, tmp_path / "bridge.log")
    third = None
    try:
        await wait_until(lambda: (health(port) or {}).get("ready"), 60)
        assert len(health(port)["replicas"]) == 2
        async with connect(f"ws://127.0.0.1:{port}/ws") as ws:
            load = Load(ws, workers=4, max_tokens=8)
            running = asyncio.create_task(load.run())
            try:
                third = replica(tiny_model_dir, HOSTS[2], ports)
                await asyncio.to_thread(ready, third)
                with hosts_file.open("a") as hosts:  # in place: the bind mount keeps the inode
                    hosts.write(f"{HOSTS[2]} {NAME}\n")
                pickup = await wait_until(lambda: tokens_generated(third) > 0, 60)
                # /healthz resolves the name on its own probe (every second): it may list the
                # new address a little after the channel's resolver has already used it.
                await wait_until(lambda: len(health(port)["replicas"]) == 3, 10)
            finally:
                load.stop.set()
                await running
        seen = health(port)["replicas"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        if third is not None:
            third.stop(graceful=False)  # nothing left to drain
    print(f"name-resolved replica served its first tokens {pickup:.2f} s after it was added")
    assert seen == dict.fromkeys(seen, "ready") and len(seen) == 3
    assert all(last["type"] == "done" for _, last in load.outcomes.values())
    assert pickup < CONNECTION_AGE_S * 1.1 + 1.0 + PICKUP_SLACK_S
