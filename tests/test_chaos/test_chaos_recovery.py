"""Chaos: a supervised server under streams survives a reload, a cancel storm, a killed model
process and a killed tritonserver, without any action from a person.

The tests share one supervised server, in this order (each leaves it serving): reload under 16
streams, cancel storm, kill -9 of the stub, kill -9 of tritonserver, a frozen stub (SIGSTOP: alive
but silent, found by the canary). A poisoned device (a CUDA error in a decode step: the engine and
then the model say unhealthy) has a server of its own. Each prints what it measured.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    REPO_ROOT,
    GrpcStream,
    bridge_thread,
    stub_pids,
    supervised_server,
    wait_for,
    ws_generation,
)

from clients.cli.reload import ReloadConfig, reload
from streaming_backend import wire
from streaming_backend.launcher.control import control
from streaming_backend.wire import SERVER_LOST, UNAVAILABLE

pytestmark = [pytest.mark.chaos, pytest.mark.server]

TOKEN_DELAY_MS = 20  # streams of 150 tokens last about 3 s
LONG = 150
ERROR_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def second_tiny_model_dir(tmp_path_factory, tiny_model_dir):
    """Another tiny model with other random weights and its own output layer: its greedy text
    differs (a tied random model just repeats the prompt's last token)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = False
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny-model-b")
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def chaos_server(tiny_model_dir):
    """One supervised tiny-model server for the whole module, and a bridge in front of it.

    Yields (supervisor, health_url, events, bridge_port).
    """
    with supervised_server(
        tiny_model_dir,
        models=(wire.CHAT_MODEL,),  # not the dialogue model: its stubs would be killed by mistake
        max_streams=32,
        queue_limit=1100,
        model_parameters={"test_token_delay_ms": str(TOKEN_DELAY_MS)},
    ) as (supervisor, health_url, events):
        with bridge_thread(supervisor.server.grpc_url, also_ready=supervisor.ready) as port:
            yield supervisor, health_url, events, port


def greedy_text(grpc_url: str) -> str:
    stream = GrpcStream(grpc_url, prompt="The weather today", max_tokens=8).start()
    try:
        assert stream.ended.wait(60) and stream.final, stream.error
    finally:
        stream.close()
    return "".join(stream.texts)


def status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def supervisor_status(health_url: str) -> dict:
    """The supervisor's /status."""
    with urllib.request.urlopen(f"{health_url}/status", timeout=5) as response:
        return json.loads(response.read())


def restarts(health_url: str) -> dict:
    return supervisor_status(health_url)["restarts"]


def test_reload_under_16_streams_finishes_them_and_serves_the_new_model(
    chaos_server, second_tiny_model_dir
) -> None:
    """`tokenstream reload --model` (the supervisor's POST /reload, as the CLI sends it) under 16
    open streams: all 16 end with FINAL and their full length; probes sent all along never fail;
    requests after the reload get the new model's text, and /status names the new model (what a
    later restart serves)."""
    supervisor, health_url, events, _ = chaos_server
    grpc_url = supervisor.server.grpc_url
    before = greedy_text(grpc_url)
    streams = [GrpcStream(grpc_url, max_tokens=LONG).start() for _ in range(16)]
    probe_failures: list[str] = []
    probe_times: list[float] = []
    probing = threading.Event()

    def probe() -> None:
        while not probing.is_set():
            stream = GrpcStream(grpc_url, max_tokens=2).start()
            stream.ended.wait(120)
            stream.close()
            if not stream.final:
                probe_failures.append(str(stream.error))
            probe_times.append(time.monotonic())

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        seconds = reload(
            ReloadConfig(health_url, str(second_tiny_model_dir), admin_key=supervisor.admin_key)
        )
    finally:
        probing.set()
        prober.join(timeout=120)
    for stream in streams:
        assert stream.ended.wait(120)
        stream.close()
    gaps = np.diff(probe_times) if len(probe_times) > 1 else np.array([0.0])
    print(
        f"\nreload: {seconds:.1f} s; {len(probe_times)} probes, {len(probe_failures)} failed, "
        f"longest gap between probe answers {gaps.max():.2f} s"
    )
    assert [(s.final, s.tokens, s.error) for s in streams] == [(True, LONG, None)] * 16
    assert probe_failures == []
    after = greedy_text(grpc_url)
    assert after != before
    assert status(f"{health_url}/ready") == 200
    assert any("reloaded chat" in line for line in events)
    now = supervisor_status(health_url)
    assert (now["model"], now["reloads"]) == (str(second_tiny_model_dir), {"ok": 1, "failed": 0})


def test_cancel_storm_leaves_no_live_stream(chaos_server) -> None:
    """1,000 streams over 20 channels: random cancels and channel closes. After it, no request
    is active in the model and a normal request works."""
    supervisor = chaos_server[0]
    started = time.monotonic()
    outcome = asyncio.run(cancel_storm(supervisor.server.grpc_url, streams=1000, channels=20))
    took = time.monotonic() - started
    health = control(
        supervisor.server.http_url, wire.CHAT_MODEL, supervisor.admin_key, wire.CONTROL_HEALTH, 10
    )
    wait_for(lambda: active_streams(supervisor) == 0, timeout=30)
    print(f"\ncancel storm: {outcome} in {took:.1f} s; then {health}")
    assert sum(outcome.values()) == 1000
    assert greedy_text(supervisor.server.grpc_url)


def active_streams(supervisor) -> int:
    """What the model reports as active (accepted, no FINAL yet) and its metrics gauge."""
    health = control(
        supervisor.server.http_url, wire.CHAT_MODEL, supervisor.admin_key, wire.CONTROL_HEALTH, 10
    )
    with urllib.request.urlopen(supervisor.server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    gauge = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tokenstream_active_streams{")
    )
    return health.active + health.waiting + int(gauge)


async def cancel_storm(grpc_url: str, streams: int, channels: int) -> dict[str, int]:
    """Streams spread over channels; each is left to finish, cancelled, or its channel closed."""
    import tritonclient.grpc.aio as aio

    rng = random.Random(0)
    clients = [aio.InferenceServerClient(grpc_url) for _ in range(channels)]
    closing = set(rng.sample(range(channels), channels // 4))  # these channels close mid-way
    outcome = {"final": 0, "cancelled": 0, "closed": 0, "error": 0}

    async def one(index: int) -> None:
        client = clients[index % channels]
        max_tokens = rng.randint(1, 40)
        cancel_after = rng.choice([None, 0.0, 0.05, 0.3, 1.0])

        async def requests():
            yield {"model_name": wire.CHAT_MODEL, "inputs": aio_inputs(max_tokens)}
            await asyncio.sleep(3600)  # keep the request stream open until we leave

        async def consume() -> str:
            async for result, error in client.stream_infer(requests()):
                if error is not None:
                    return "error"
                if result.get_response().parameters[wire.FINAL_RESPONSE].bool_param:
                    return "final"
            return "error"

        try:
            outcome[await asyncio.wait_for(consume(), cancel_after)] += 1
        except asyncio.TimeoutError:
            outcome["cancelled"] += 1
        except asyncio.CancelledError:  # grpc.aio's word for "your channel was closed"
            if index % channels not in closing:
                raise
            outcome["closed"] += 1

    async def close_some() -> None:
        await asyncio.sleep(0.5)
        for index in closing:
            await clients[index].close()

    tasks = [asyncio.create_task(one(i)) for i in range(streams)]
    await asyncio.gather(close_some(), *tasks)
    for client in clients:
        await client.close()
    return outcome


def aio_inputs(max_tokens: int):
    import tritonclient.grpc.aio as aio

    values = {
        wire.TEXT_INPUT: np.array([b"Hello"], dtype=np.object_),
        wire.SAMPLING_PARAMETERS: np.array(
            [json.dumps({"max_tokens": max_tokens, "ignore_eos": True}).encode()], dtype=np.object_
        ),
        wire.STREAM: np.array([True]),
    }
    inputs = []
    for name, array in values.items():
        inputs.append(aio.InferInput(name, [1], "BOOL" if array.dtype == bool else "BYTES"))
        inputs[-1].set_data_from_numpy(array)
    return inputs


def kill_and_measure(chaos_server, victim: str) -> str:
    """kill -9 `victim` (the stub or tritonserver) under 8 gRPC streams and 8 websocket
    generations; every one ends with an error within 5 s, readiness drops, and the model serves
    again by itself after one restart. Returns that restart's cause."""
    supervisor, health_url, events, bridge_port = chaos_server
    server = supervisor.server
    causes_before = restarts(health_url)
    before = sum(causes_before.values())
    # the bridge probes Triton by itself: after a previous restart it may still be catching up
    wait_for(lambda: status(f"http://127.0.0.1:{bridge_port}/healthz") == 200, timeout=60)
    streams = [GrpcStream(server.grpc_url, max_tokens=LONG).start() for _ in range(8)]
    sockets = [{} for _ in range(8)]
    workers = [
        threading.Thread(target=ws_generation, args=(bridge_port, LONG, r), daemon=True)
        for r in sockets
    ]
    for worker in workers:
        worker.start()
    wait_for(lambda: all(s.tokens > 0 for s in streams), timeout=60)
    wait_for(lambda: all(r.get("started") for r in sockets), timeout=60)
    pid = stub_pids(server, wire.CHAT_MODEL)[0] if victim == "stub" else server.pid
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for stream in streams:
        assert stream.ended.wait(ERROR_WITHIN_S + 5)
    for worker in workers:
        worker.join(timeout=ERROR_WITHIN_S + 5)
    error_times = [s.ended_at - killed_at for s in streams]
    ws_times = [r["at"] - killed_at for r in sockets]
    # a dead tritonserver's streams end at once, a moment before the supervisor's next look
    # sees it gone (until then /ready may still say 200): wait for that look, then ask
    wait_for(lambda: sum(restarts(health_url).values()) > before, timeout=10)
    saw_not_ready = status(f"{health_url}/ready") != 200
    wait_for(lambda: status(f"{health_url}/ready") == 200, timeout=300)
    ready_at = time.monotonic()
    text = greedy_text(supervisor.server.grpc_url)
    served_at = time.monotonic()
    for stream in streams:
        stream.close()
    causes = restarts(health_url)
    cause = ",".join(k for k in causes if causes[k] != causes_before.get(k, 0))
    print(
        f"\nkill -9 {victim}: gRPC streams ended after {min(error_times):.2f}-"
        f"{max(error_times):.2f} s with {streams[0].error}; websockets after "
        f"{min(ws_times):.2f}-{max(ws_times):.2f} s with {sockets[0]['last']}; restart cause "
        f"{cause}; ready again after {ready_at - killed_at:.1f} s, first new answer after "
        f"{served_at - killed_at:.1f} s"
    )
    assert all(s.error is not None and not s.final for s in streams)
    assert max(error_times) < ERROR_WITHIN_S
    assert [r["last"]["code"] for r in sockets] == [UNAVAILABLE.code] * 8
    assert all(SERVER_LOST in r["last"]["message"] for r in sockets)
    assert max(ws_times) < ERROR_WITHIN_S
    assert saw_not_ready
    assert text
    assert sum(causes.values()) == before + 1
    assert any("restarting tritonserver" in line for line in events)
    return cause


def test_kill_9_of_the_model_process_ends_streams_and_recovers(chaos_server) -> None:
    """A dead backend stub: its streams end with an error, then a new Triton serves.

    The supervisor finds the stub's zombie in two looks 0.25 s apart (cause stub_died); Triton
    2.51 sometimes aborts by itself first (SIGABRT 0.3 s after the kill, seen in 1 of 6 runs on
    a busy 2-core machine), and the cause is then its own exit."""
    cause = kill_and_measure(chaos_server, "stub")
    aborted = any("tritonserver exited (status -6)" in line for line in chaos_server[2])
    assert cause == "stub_died" or (cause == "server_died" and aborted), cause


def test_kill_9_of_tritonserver_ends_streams_and_recovers(chaos_server) -> None:
    """A dead tritonserver: the same."""
    assert kill_and_measure(chaos_server, "tritonserver") == "server_died"


def test_a_frozen_model_process_is_found_by_the_canary_and_replaced(chaos_server) -> None:
    """SIGSTOP of the stub: no process died, but the model stops answering; the canary notices
    (measured: Triton's own stub health check already calls it "not healthy", which the canary
    reads as a dead stub), open streams end with an error and a new Triton serves."""
    supervisor, health_url, events, _ = chaos_server
    server = supervisor.server
    before = sum(restarts(health_url).values())
    streams = [GrpcStream(server.grpc_url, max_tokens=LONG).start() for _ in range(4)]
    wait_for(lambda: all(s.tokens > 0 for s in streams), timeout=60)
    stub = stub_pids(server, wire.CHAT_MODEL)[0]
    frozen_at = time.monotonic()
    os.kill(stub, signal.SIGSTOP)
    try:
        for stream in streams:
            assert stream.ended.wait(60)
        ended = max(s.ended_at for s in streams) - frozen_at
        wait_for(lambda: status(f"{health_url}/ready") == 200, timeout=300)
        back = time.monotonic() - frozen_at
        assert greedy_text(supervisor.server.grpc_url)
    finally:
        for stream in streams:
            stream.close()
    causes = restarts(health_url)
    print(
        f"\nSIGSTOP stub: streams ended after {ended:.1f} s; ready again after {back:.1f} s; "
        f"restarts by cause {causes}; last events: {events[-2:]}"
    )
    assert all(s.error is not None for s in streams)
    assert sum(causes.values()) == before + 1


# A chat model whose engine's next decode step fails as a poisoned CUDA device does, once the
# test creates a trigger file (one-shot: the step removes it). Everything else is the real model.
POISONABLE_MODEL = """\
import importlib.util
import os
import sys

_spec = importlib.util.spec_from_file_location("tokenstream_real_chat_model", {real!r})
_real = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # for its dataclasses
_spec.loader.exec_module(_real)
TRIGGER = {trigger!r}


class TritonPythonModel(_real.TritonPythonModel):
    def initialize(self, args):
        super().initialize(args)
        step = self.engine._decode_step

        def poisoned_step():
            if os.path.exists(TRIGGER):
                os.remove(TRIGGER)
                raise RuntimeError("CUDA error: device-side assert triggered (injected)")
            return step()

        self.engine._decode_step = poisoned_step
"""


def poisonable_repository(root: Path, trigger: Path) -> Path:
    """A model repository with the chat model's config and the poisonable model.py."""
    source = REPO_ROOT / "repository" / wire.CHAT_MODEL
    model_dir = root / wire.CHAT_MODEL
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text((source / "config.pbtxt").read_text())
    real = str(source / "1" / "model.py")
    code = POISONABLE_MODEL.format(real=real, trigger=str(trigger))
    (model_dir / "1" / "model.py").write_text(code)
    return root


def test_a_poisoned_device_makes_the_model_unhealthy_and_the_supervisor_restarts(
    tiny_model_dir, tmp_path
) -> None:
    """End to end: a decode step fails with a CUDA device-side assert. The step's streams end
    with that error, the engine turns unhealthy, the model says so to the canary, the supervisor
    restarts tritonserver (cause `unhealthy`) and the new one serves, with no action."""
    trigger = tmp_path / "poison-now"
    repository = poisonable_repository(tmp_path / "repository", trigger)
    with supervised_server(
        tiny_model_dir,
        repository=repository,
        models=(wire.CHAT_MODEL,),
        model_parameters={"test_token_delay_ms": str(TOKEN_DELAY_MS)},
    ) as (supervisor, health_url, events):
        grpc_url = supervisor.server.grpc_url
        streams = [GrpcStream(grpc_url, max_tokens=LONG).start() for _ in range(4)]
        try:
            wait_for(lambda: all(s.tokens > 0 for s in streams), timeout=60)
            poisoned_at = time.monotonic()
            trigger.touch()
            for stream in streams:
                assert stream.ended.wait(ERROR_WITHIN_S + 5)
            ended = max(s.ended_at for s in streams) - poisoned_at
            wait_for(lambda: restarts(health_url).get("unhealthy") == 1, timeout=60)
            wait_for(lambda: status(f"{health_url}/ready") == 200, timeout=300)
            ready_at = time.monotonic() - poisoned_at
            text = greedy_text(supervisor.server.grpc_url)
            served_at = time.monotonic() - poisoned_at
        finally:
            for stream in streams:
                stream.close()
        causes = restarts(health_url)
    reasons = [line for line in events if "unhealthy" in line]
    print(
        f"\npoisoned device: streams ended after {ended:.2f} s with {streams[0].error}; "
        f"restart cause {causes}; ready again after {ready_at:.1f} s, first new answer after "
        f"{served_at:.1f} s; {reasons[:1]}"
    )
    assert all(not s.final and "CUDA error" in str(s.error) for s in streams)
    assert ended < ERROR_WITHIN_S
    assert causes == {"unhealthy": 1}
    assert any("device failed" in line for line in reasons)
    assert text
    assert not trigger.exists()
