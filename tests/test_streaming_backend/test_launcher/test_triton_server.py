"""Tests for streaming_backend/launcher/server.py: a real tritonserver on a tiny echo model."""

from __future__ import annotations

import http.server
import json
import re
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import alive, shm_files, write_echo_model
from hung_start import hanging_repository

from streaming_backend.launcher import ServerConfig, ServerDied, TritonServer, free_port
from streaming_backend.launcher.processes import WAIT4, descendants
from streaming_backend.launcher.server import StartHung

STOP_LIMIT_S = 15.0


def loopback_config(repository: Path, **overrides: object) -> ServerConfig:
    """A ServerConfig on free loopback ports."""
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    return ServerConfig(repository=repository, **(ports | overrides))


def stream(server: TritonServer, model: str, text: str) -> list[dict]:
    """POST generate_stream and return the SSE events as dicts."""
    body = json.dumps({"text_input": text}).encode()
    url = f"{server.http_url}/v2/models/{model}/generate_stream"
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        lines = response.read().decode().splitlines()
    return [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]


@pytest.fixture
def running_server(echo_repository: Path):
    """A ready server on the echo model whose suffix is patched to "?"."""
    server = TritonServer(loopback_config(echo_repository, model_parameters={"suffix": "?"}))
    try:
        server.start()
        server.wait_ready(timeout=120)
        yield server
    finally:
        server.stop()


# --------------------------------------------------------------------------- no server


def test_config_rejects_an_exit_timeout_that_breaks_the_stop_bound() -> None:
    """An exit timeout that would push stop() past 15 s is refused up front."""
    with pytest.raises(ValueError, match="exit_timeout_s"):
        ServerConfig(exit_timeout_s=60)


def test_repository_defaults_to_the_checkout_or_the_variable(monkeypatch, tmp_path: Path) -> None:
    """The checkout's repository/ by default; $TOKENSTREAM_REPOSITORY (installed copies) wins."""
    monkeypatch.delenv("TOKENSTREAM_REPOSITORY", raising=False)
    checkout = Path(__file__).resolve().parents[3]
    assert ServerConfig().repository == checkout / "repository"
    monkeypatch.setenv("TOKENSTREAM_REPOSITORY", str(tmp_path))
    assert ServerConfig().repository == tmp_path


class _Ready(http.server.BaseHTTPRequestHandler):
    """Answers every GET with 200, as Triton's /v2/health/ready does once models are loaded."""

    def do_GET(self) -> None:  # noqa: N802 (the handler's API)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_ready_waits_for_the_metrics_port(tmp_path: Path) -> None:
    """Triton answers /v2/health/ready before its metrics service listens: wait_ready() returns
    only once the metrics port accepts connections too."""
    http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    metrics_port = free_port()
    config = ServerConfig(
        repository=tmp_path, http_port=http_server.server_port, metrics_port=metrics_port
    )
    server = TritonServer(config, on_log=None)
    server._process = subprocess.Popen(["sleep", "60"])  # stands in for a running tritonserver
    try:
        assert server.is_ready()
        with pytest.raises(TimeoutError):
            server.wait_ready(timeout=1.0)
        with socket.create_server(("127.0.0.1", metrics_port)):
            assert server.wait_ready(timeout=5.0)
    finally:
        server._process.kill()
        server._process.wait()
        http_server.shutdown()
        http_server.server_close()


# --------------------------------------------------------------------------- real server


@pytest.mark.server
def test_server_is_ready_on_loopback_and_streams(running_server: TritonServer) -> None:
    """The server answers on loopback ports; the patched parameter reaches the model."""
    assert running_server.http_url.startswith("http://127.0.0.1:")
    assert running_server.grpc_url.startswith("127.0.0.1:")
    assert running_server.metrics_url.endswith("/metrics")
    events = stream(running_server, "echo", "hi")
    assert [event["text_output"] for event in events] == ["hi?"] * 3


@pytest.mark.server
def test_stop_leaves_no_process_and_no_shm(running_server: TritonServer) -> None:
    """stop() takes < 15 s, leaves no descendant and no shm file, and is idempotent."""
    family = descendants(running_server.pid)
    assert family, "the python backend stub should be a child of tritonserver"
    assert shm_files(running_server.shm_prefix), "the stub should have made its shm region"
    runtime = running_server.runtime_repository
    seconds = running_server.stop()
    print(f"stop() took {seconds:.2f} s")
    assert seconds < STOP_LIMIT_S
    assert alive(family) == []
    assert shm_files(running_server.shm_prefix) == []
    assert running_server.returncode is not None and not runtime.exists()
    assert running_server.stop() == 0.0


@pytest.mark.server
def test_stop_kills_a_server_that_hangs_on_exit(tmp_path: Path) -> None:
    """A model whose finalize hangs: stop() falls back to SIGKILL and still cleans up in time."""
    write_echo_model(tmp_path, finalize_line="time.sleep(120)")
    server = TritonServer(loopback_config(tmp_path, exit_timeout_s=2))
    try:
        server.start()
        server.wait_ready(timeout=120)
        family = descendants(server.pid)
        seconds = server.stop()
        print(f"stop() of a hanging server took {seconds:.2f} s")
        assert seconds < STOP_LIMIT_S
        assert server.killed, "the hanging stub should have needed SIGKILL"
        assert alive(family) == [] and shm_files(server.shm_prefix) == []
    finally:
        server.stop()


@pytest.mark.server
def test_failing_model_raises_server_died_with_log(tmp_path: Path) -> None:
    """A model that fails to load makes wait_ready raise ServerDied holding the log lines."""
    write_echo_model(tmp_path, init_line='raise RuntimeError("broken on purpose")')
    server = TritonServer(loopback_config(tmp_path))
    try:
        server.start()
        with pytest.raises(ServerDied, match="broken on purpose") as caught:
            server.wait_ready(timeout=120)
        assert "Last log:" in str(caught.value)
    finally:
        server.stop()
    assert shm_files(server.shm_prefix) == []


@pytest.mark.server
def test_a_start_that_hangs_after_initialize_raises_start_hung_in_time(tmp_path: Path) -> None:
    """A model whose stub misses the python backend's health checks during initialize (stopped
    for 4 s): Triton gives up on it and waits for it to exit while it idles after initialize.
    wait_ready raises StartHung once the bound after its `initialize returned` line has passed,
    naming the stub Triton waits for and the real time waited; stop() leaves nothing behind."""
    repository, _ = hanging_repository(tmp_path, hangs="always")
    server = TritonServer(loopback_config(repository, hung_start_s=3.0), on_log=None)
    try:
        server.start()
        with pytest.raises(StartHung) as caught:
            server.wait_ready(timeout=120)
        initialized = server.start_watch.initialized
        overdue = time.monotonic() - initialized[-1].at
        family = descendants(server.pid)
    finally:
        server.stop(graceful=False)
    message = str(caught.value)
    print(f"\n{message.splitlines()[0]}")
    assert [line.instance for line in initialized] == ["echo_0_0"]
    assert 3.0 <= overdue < 10.0
    assert "after every model's initialize returned" in message or "began waiting" in message
    assert re.search(r", \d+\.\d s after it started: its start hangs", message)
    if WAIT4 is not None:
        assert "waits for the model process echo_0_0 (pid " in message
    assert "Last log:" in message
    assert alive(family) == [] and shm_files(server.shm_prefix) == []
