"""Tests for streaming_backend/launcher/supervisor.py, health.py and control.py: a supervised real
tritonserver on the tiny model; its repository API is closed to plain clients."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import stub_pids, supervised_server, wait_for
from tritonclient.utils import InferenceServerException

from clients.library.grpc_client import GenerateRequest, stream_generate
from streaming_backend.launcher.control import ControlError, control
from streaming_backend.launcher.health import metrics_text
from streaming_backend.launcher.supervisor import (
    RestartBudget,
)
from streaming_backend.wire import (
    ADMIN_HEADER,
    CHAT_MODEL,
    CONTROL,
    CONTROL_DRAIN,
    CONTROL_END,
    CONTROL_HEALTH,
    FORWARD,
    MEMORY,
    NUMERICS,
    SAMPLING_PARAMETERS,
    SPECULATION,
    STEPS,
    STREAM,
    SYSTEM_FINGERPRINT,
    TEXT_INPUT,
    TEXT_OUTPUT,
)


def test_restart_budget_waits_longer_each_time_then_gives_up() -> None:
    """The first restart in the window is immediate, the next ones double, then none."""
    budget = RestartBudget(max_restarts=4, first_backoff_s=1.0, max_backoff_s=3.0)
    assert [budget.backoff(n) for n in range(1, 6)] == [0.0, 1.0, 2.0, 3.0, None]


@pytest.mark.parametrize(
    "setting, dtype", [("auto", None), ("fp32", "float32"), ("bf16", "bfloat16")]
)
def test_status_names_the_dtype_and_why(setting, dtype) -> None:
    """/status says which dtype the models load in and why, by the rule the models apply."""
    from streaming_backend.launcher.server import ServerConfig
    from streaming_backend.launcher.supervisor import Supervisor, SupervisorConfig
    from streaming_backend.model.hardware import host_dtype

    status = Supervisor(
        SupervisorConfig(ServerConfig(model_parameters={"dtype": setting}))
    ).status()
    expected = dtype or host_dtype("auto").dtype
    assert status["dtype"] == {
        "setting": setting,
        "dtype": expected,
        "reason": host_dtype(setting).reason,
    }


@pytest.mark.parametrize("setting", ["auto", "none", "int8"])
def test_status_names_the_weights_and_why(setting) -> None:
    """/status says which weight format the models use and why, for the dtype they load in."""
    from streaming_backend.launcher.server import ServerConfig
    from streaming_backend.launcher.supervisor import Supervisor, SupervisorConfig
    from streaming_backend.model.hardware import host_dtype, host_quantize

    parameters = {"dtype": "bf16", "quantize": setting}
    status = Supervisor(SupervisorConfig(ServerConfig(model_parameters=parameters))).status()
    assert status["quantize"] == host_quantize(setting, host_dtype("bf16").dtype).as_dict()
    assert status["quantize"]["setting"] == setting
    if setting != "auto":
        assert status["quantize"]["kind"] == setting


def test_status_shows_an_unknown_dtype_as_such() -> None:
    """An unknown dtype does not stop the supervisor starting (the model refuses it at load):
    /status names the setting and the error."""
    from streaming_backend.launcher.server import ServerConfig
    from streaming_backend.launcher.supervisor import Supervisor, SupervisorConfig

    server = ServerConfig(model_parameters={"dtype": "int3"})
    status = Supervisor(SupervisorConfig(server)).status()
    assert status["dtype"]["setting"] == "int3" and status["dtype"]["dtype"] == ""
    assert "unknown dtype 'int3'" in status["dtype"]["reason"]


def test_status_has_no_numerics_before_a_canary_answered() -> None:
    """The system fingerprint, the numerics, the steps and the forward come from the chat model's
    canary answers: null until one came."""
    from streaming_backend.launcher.server import ServerConfig
    from streaming_backend.launcher.supervisor import Supervisor, SupervisorConfig

    status = Supervisor(SupervisorConfig(ServerConfig())).status()
    assert status[SYSTEM_FINGERPRINT] is None and status[NUMERICS] is None
    assert status[STEPS] is None and status[FORWARD] is None


def test_readiness_waits_for_each_required_part() -> None:
    """A part `serve` requires (the bridge) keeps /ready false until it serves and again after
    it stops, and /status shows it; the models' own readiness does not wait for it."""
    from streaming_backend.launcher.server import ServerConfig
    from streaming_backend.launcher.supervisor import READY, Supervisor, SupervisorConfig

    supervisor = Supervisor(SupervisorConfig(ServerConfig()))
    # port 9 refuses: the dialogue model's counters are not there to read
    supervisor.server = SimpleNamespace(
        returncode=None, pid=1, metrics_url="http://127.0.0.1:9/metrics"
    )
    supervisor.state = READY
    assert supervisor.ready() and supervisor.status()["parts"] == {}
    bridge = supervisor.require("bridge")
    assert supervisor.models_ready() and not supervisor.ready()
    assert supervisor.status()["parts"] == {"bridge": False}
    bridge.set()
    assert supervisor.ready() and supervisor.status()["parts"] == {"bridge": True}
    bridge.clear()
    assert not supervisor.ready()


class ScriptedServer:
    """What the drain reads of a running tritonserver."""

    http_url = "http://127.0.0.1:9"
    returncode = None


def scripted_drain(monkeypatch, answers: list, drain_timeout_s: float = 2.0):
    """Drain a Supervisor whose model answers control requests from a script (a number: its
    open streams; an exception: raised); returns (actions sent, events said)."""
    from streaming_backend.launcher import supervisor as module
    from streaming_backend.launcher.control import ModelHealth
    from streaming_backend.launcher.server import ServerConfig

    sent: list[str] = []

    def scripted_control(http_url, model, key, action, timeout):
        sent.append(action)
        answer = answers.pop(0) if answers else 0
        if isinstance(answer, Exception):
            raise answer
        return ModelHealth(True, "", action != CONTROL_HEALTH, answer, 0)

    monkeypatch.setattr(module, "control", scripted_control)
    monkeypatch.setattr(module, "DRAIN_POLL_S", 0.01)
    monkeypatch.setattr(module, "END_WAIT_S", 0.2)
    events: list[str] = []
    config = module.SupervisorConfig(
        ServerConfig(models=(CHAT_MODEL,)), drain_timeout_s=drain_timeout_s
    )
    supervisor = module.Supervisor(config, events.append, None)
    supervisor.server = ScriptedServer()
    supervisor.state = module.READY
    supervisor.drain(threading.Event())
    return sent, events


TIMED_OUT = ControlError("no answer: timed out", unreachable=True)


def test_a_health_poll_that_times_out_does_not_end_the_drain(monkeypatch) -> None:
    """A busy machine: one health poll gets no answer in time. The drain goes on waiting for
    the open streams (it used to take that for "no open streams" and stop Triton under them)."""
    sent, events = scripted_drain(monkeypatch, [2, 2, TIMED_OUT, 1, 0])
    assert sent == [CONTROL_DRAIN] + [CONTROL_HEALTH] * 4
    assert not any("deadline" in line for line in events)


def test_a_model_silent_until_the_deadline_is_told_to_end_its_streams(monkeypatch) -> None:
    """No answer at all until the deadline: streams may be open, so END is sent."""
    sent, events = scripted_drain(monkeypatch, [2] + [TIMED_OUT] * 1000, drain_timeout_s=0.3)
    assert CONTROL_END in sent
    assert any("drain deadline: ending the open streams" in line for line in events)


def test_a_model_that_answers_with_an_error_ends_the_drain(monkeypatch) -> None:
    """An error answer (a dead stub: "not healthy"): nothing can finish, no waiting."""
    dead = ControlError("Stub process 'chat_0_0' is not healthy.")
    sent, _ = scripted_drain(monkeypatch, [2, dead])
    assert sent == [CONTROL_DRAIN, CONTROL_HEALTH]


def get(url: str, timeout: float = 10) -> tuple[int, dict | str]:
    """GET: (status, JSON body or text), for error statuses too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode()


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    """POST JSON: (status, JSON body)."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"} | (headers or {}),
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@pytest.fixture(scope="module")
def supervised(tiny_model_dir):
    """A Supervisor watching a tiny-model server (canary every 0.5 s), and its HTTP port."""
    with supervised_server(
        tiny_model_dir, max_streams=8, queue_limit=16, models=(CHAT_MODEL,)
    ) as running:
        yield running


def infer_text(grpc_url: str, prompt: str, max_tokens: int = 4) -> str:
    """One streamed gRPC generation with tritonclient; its whole text."""
    client = grpcclient.InferenceServerClient(grpc_url)
    results: list = []
    done = threading.Event()

    def callback(result, error):
        results.append(error or result)
        if error or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    inputs = []
    for name, value in (
        (TEXT_INPUT, prompt.encode()),
        (SAMPLING_PARAMETERS, json.dumps({"max_tokens": max_tokens, "temperature": 0}).encode()),
    ):
        inputs.append(grpcclient.InferInput(name, [1], "BYTES"))
        inputs[-1].set_data_from_numpy(np.array([value], dtype=np.object_))
    inputs.append(grpcclient.InferInput(STREAM, [1], "BOOL"))
    inputs[-1].set_data_from_numpy(np.array([True]))
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer(CHAT_MODEL, inputs, enable_empty_final_response=True)
        assert done.wait(60), "no final response"
    finally:
        client.stop_stream()
        client.close()
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors
    return "".join(
        r.as_numpy(TEXT_OUTPUT)[0].decode() for r in results if r.as_numpy(TEXT_OUTPUT) is not None
    )


@pytest.mark.server
def test_plain_clients_cannot_unload_the_model_but_still_infer(supervised) -> None:
    """The model-repository API wants the admin key on HTTP and gRPC; inference does not."""
    supervisor, _, _ = supervised
    server = supervisor.server
    http = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    for headers in (None, {ADMIN_HEADER: "a wrong key"}):
        with pytest.raises(InferenceServerException, match="restricted"):
            http.unload_model(CHAT_MODEL, headers=headers)
    http.close()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="restricted"):
        client.unload_model(CHAT_MODEL)
    client.close()
    assert infer_text(server.grpc_url, "Hello")
    assert get(f"{server.http_url}/v2/models/{CHAT_MODEL}/ready")[0] == 200


@pytest.mark.server
def test_control_requests_need_the_admin_key(supervised) -> None:
    """With the key the model answers its health; without it the request is refused."""
    supervisor, _, _ = supervised
    url = supervisor.server.http_url
    health = control(url, CHAT_MODEL, supervisor.admin_key, CONTROL_HEALTH, timeout=10)
    assert health.healthy and not health.draining and health.active == 0
    with pytest.raises(ControlError, match="admin key"):
        control(url, CHAT_MODEL, "not the key", CONTROL_HEALTH, timeout=10)
    body = {CONTROL: "not json"}
    request = urllib.request.Request(
        f"{url}/v2/models/{CHAT_MODEL}/generate_stream", data=json.dumps(body).encode()
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert b"invalid request" in refused.value.read()


@pytest.mark.server
def test_health_endpoints_tell_ready_live_status_and_metrics(supervised) -> None:
    """/ready 200 while serving, /live 200, /status names the state, /metrics counts restarts."""
    supervisor, url, _ = supervised
    status, body = get(f"{url}/ready")
    assert status == 200 and body["state"] == "ready", body
    assert get(f"{url}/live")[0] == 200
    status_body = get(f"{url}/status")[1]
    assert status_body["ready"] is True
    assert status_body["dtype"] == supervisor.dtype.as_dict()
    wait_for(lambda: get(f"{url}/status")[1][SYSTEM_FINGERPRINT] is not None)  # a canary came
    status_body = get(f"{url}/status")[1]
    health = control(
        supervisor.server.http_url, CHAT_MODEL, supervisor.admin_key, CONTROL_HEALTH, 10
    )
    assert status_body[SYSTEM_FINGERPRINT] == health.system_fingerprint
    assert status_body[NUMERICS] == health.numerics
    # the decode steps' threads, from the canary (a CPU, adaptive_threads on by default)
    assert status_body[STEPS]["most"] == health.steps["most"] == health.numerics["threads"]
    assert 1 <= status_body[STEPS]["threads"] <= status_body[STEPS]["most"]
    request = GenerateRequest(
        prompt="Hi", sampling={"max_tokens": 2}, return_system_fingerprint=True
    )
    answer = list(stream_generate(supervisor.server.grpc_url, request))
    assert {c.system_fingerprint for c in answer} == {health.system_fingerprint}
    assert status_body[NUMERICS]["forward"] == "compact"
    # which forward runs, with what (the same as the numerics name), and no reason on compact
    assert status_body[FORWARD] == health.forward
    numerics = status_body[NUMERICS]
    assert status_body[FORWARD] == {
        "forward": "compact",
        "why": None,
        "quantize": numerics["quantize"],
        "matmul": numerics["matmul"],
        "attention": numerics["attention"],
        "kv_cache": status_body[FORWARD]["kv_cache"],
        "draft_kv_cache": None,  # no draft model
    }
    # the tiny model's slots: its whole context of 256 positions each, no sliding-window rings
    kv_cache = status_body[FORWARD]["kv_cache"]
    assert kv_cache["slots"] >= 1 and kv_cache["positions"] == 256 and kv_cache["bytes"] > 0
    assert (kv_cache["ring_layers"], kv_cache["ring_rows"]) == (0, [])
    assert status_body[NUMERICS]["dtype"] == supervisor.dtype.dtype == "float32"
    status, text = get(f"{url}/metrics")
    assert status == 200 and 'tokenstream_supervisor_restarts_total{cause="stub_died"}' in text
    assert "tokenstream_supervisor_ready 1" in text
    assert text == metrics_text(supervisor)
    assert get(f"{url}/nothing")[0] == 404


@pytest.mark.server
def test_status_tells_the_weights_and_kv_cache_memory(supervised, tiny_model_dir) -> None:
    """/status's memory, as the chat model's canary tells it: its weights all shared, as many
    bytes as their weight file holds, none private; its KV cache reserved whole (the slots'
    bytes) and touched at most as much (the tiny model's cache is small enough to be zeroed at
    once: wholly touched; a large one's is touched as used, test_steps_slots.py)."""
    from streaming_backend.forward.weight_file import read_meta
    from streaming_backend.model.weight_cache import FOLDER
    from streaming_backend.paths import cache_dir

    supervisor, url, _ = supervised
    assert infer_text(supervisor.server.grpc_url, "Hello")
    wait_for(lambda: get(f"{url}/status")[1][MEMORY] is not None)  # a canary came
    status = get(f"{url}/status")[1]
    memory, kv_cache = status[MEMORY], status[FORWARD]["kv_cache"]
    sizes = [  # the tiny model's weight files (other tests may serve it otherwise quantized)
        path.stat().st_size
        for path in (cache_dir() / FOLDER).glob("*.weights")
        if read_meta(path)["checkpoint"] == str(tiny_model_dir)
    ]
    assert memory["weights"]["shared_bytes"] in sizes and memory["weights"]["private_bytes"] == 0
    assert memory["kv_cache"]["reserved_bytes"] == kv_cache["bytes"]
    assert 0 < memory["kv_cache"]["touched_bytes"] <= kv_cache["bytes"]
    health = control(
        supervisor.server.http_url, CHAT_MODEL, supervisor.admin_key, CONTROL_HEALTH, 10
    )
    assert health.memory == memory
    # speculative decoding's counts come the same way (auto: off on a CPU until measured)
    assert status[SPECULATION]["mode"] in ("off", "ngram") and health.speculation["drafted"] >= 0


@pytest.mark.server
def test_reload_needs_the_admin_key_and_a_failed_reload_keeps_the_old_model(
    supervised, tmp_path, tiny_model_dir
) -> None:
    """POST /reload without the key is refused; with a model that cannot load, the caller gets
    the error and the old model goes on serving. The log names the model it meant to replace."""
    supervisor, url, events = supervised
    assert post(f"{url}/reload", {})[0] == 403
    status, body = post(
        f"{url}/reload", {"model": str(tmp_path / "missing")}, {ADMIN_HEADER: supervisor.admin_key}
    )
    assert status == 500 and "old model keeps serving" in body["error"], body
    assert infer_text(supervisor.server.grpc_url, "Hello")
    assert get(f"{url}/ready")[0] == 200
    assert supervisor.reloads["failed"] == 1
    assert f"reloading chat: model {tiny_model_dir} -> {tmp_path / 'missing'}" in "\n".join(events)


@pytest.mark.server
def test_a_crash_looping_model_backs_off_then_stays_down_with_a_reason(echo_repository) -> None:
    """With a budget of one restart: the first dead stub is restarted, the second one is not;
    readiness then stays 503 and /status says why."""
    budget = RestartBudget(max_restarts=1, window_s=600)
    with supervised_server(None, repository=echo_repository, budget=budget) as running:
        supervisor, url, events = running
        first = supervisor.server
        os.kill(stub_pids(first)[0], signal.SIGKILL)
        wait_for(lambda: supervisor.server is not first and supervisor.state == "ready", 120)
        assert get(f"{url}/ready")[0] == 200
        os.kill(stub_pids(supervisor.server)[0], signal.SIGKILL)
        wait_for(lambda: supervisor.state == "failed", timeout=30)
        status, body = get(f"{url}/ready")
        assert status == 503 and body["state"] == "failed"
        assert "gave up" in body["reason"] and "model process" in body["reason"]
        assert body["restarts"] == {"stub_died": 2}
        assert get(f"{url}/live")[0] == 200  # the supervisor itself is fine
    assert sum("restarting tritonserver" in line for line in events) == 2
    assert any("gave up" in line for line in events)
