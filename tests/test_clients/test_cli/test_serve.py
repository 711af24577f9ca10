"""Tests for clients/cli/serve.py: `tokenstream serve` runs Triton (and the bridge), stops
cleanly."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import alive, kill_all, shm_files, write_echo_model

from clients.cli.serve import add_arguments, config_from_args
from streaming_backend.configuration.models import ModelSettings
from streaming_backend.launcher import free_port
from streaming_backend.launcher.processes import descendants

STOP_LIMIT_S = 15.0


def parse(*argv: str) -> argparse.Namespace:
    """Parse `tokenstream serve` options."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_serve_options_map_to_config(tmp_path: Path) -> None:
    """Ports 0 mean the defaults 8000/8001/8002; --parameter adds model parameters."""
    config = config_from_args(parse("--repository", str(tmp_path), "--grpc-port", "9001"))
    server = config.server
    assert (server.http_port, server.grpc_port, server.metrics_port) == (8000, 9001, 8002)
    assert server.repository == tmp_path and server.host == "127.0.0.1"
    assert config.bridge_port == 8080
    extra = config_from_args(parse("--parameter", "k=v=w", "--max-streams", "2", "--no-bridge"))
    assert extra.server.parameters() == {"k": "v=w", "max_streams": "2"}
    assert extra.bridge_port == 0
    assert config.server.parameters() == {}  # unset options keep the repository's values


def test_serve_refuses_a_bad_parameter_value_before_starting() -> None:
    """A value a model would refuse stops `serve` at once with the key in the message."""
    with pytest.raises(SystemExit, match="max_streams='0'"):
        config_from_args(parse("--max-streams", "0"))
    with pytest.raises(SystemExit, match="prefix_cache='maybe'"):
        config_from_args(parse("--parameter", "prefix_cache=maybe"))


def test_serve_options_take_their_defaults_from_the_model_settings() -> None:
    """The help of each model option states the table's default and the models it applies to."""
    defaults = ModelSettings()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {action.dest: action.help for action in parser._actions}
    assert helps["max_streams"].endswith(f"(default {defaults.engine.max_streams}); chat")
    assert helps["queue_limit"].endswith(f"(default {defaults.engine.queue_limit}); chat")
    assert helps["dtype"].endswith(f"(default {defaults.dtype}); chat and dialogue_model")
    assert helps["forward"].endswith(
        f"(default {defaults.engine.forward}); chat and dialogue_model"
    )


def serve_command(repository: Path, *extra: str) -> list[str]:
    """`tokenstream serve` on free loopback ports, run with this interpreter."""
    ports = [f"--{name}-port={free_port()}" for name in ("http", "grpc", "metrics")]
    cli = [sys.executable, "-m", "clients.cli", "serve", f"--repository={repository}"]
    return cli + ports + ["--no-bridge", *extra]


def wait_for_line(process: subprocess.Popen[str], needle: str, timeout: float) -> list[str]:
    """Read the process's output until a line holds `needle`; the lines read."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break  # the process closed its output: it exited
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not seen; output:\n{''.join(lines)}")


@pytest.fixture
def cli_process():
    """Start `tokenstream serve` subprocesses; kill what is left of them afterwards."""
    started: list[subprocess.Popen[str]] = []

    def start(command: list[str]) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        started.append(process)
        return process

    try:
        yield start
    finally:
        for process in started:
            # only a CLI that still runs has a tree we can trust to be ours
            family = descendants(process.pid) if process.poll() is None else {}
            kill_all(process, family)
            process.stdout.close()


@pytest.mark.server
def test_serve_cli_stops_cleanly_on_sigint(echo_repository: Path, cli_process) -> None:
    """`tokenstream serve` exits 0 within 15 s of SIGINT, leaving no process and no shm."""
    process = cli_process(serve_command(echo_repository))
    wait_for_line(process, "Triton is ready", timeout=120)
    family = descendants(process.pid)
    assert family, "tritonserver and its stub should run under the CLI"
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=STOP_LIMIT_S)
    print(f"serve exited {time.monotonic() - started:.2f} s after SIGINT")
    assert process.returncode == 0, output
    assert "stopped in" in output
    assert alive(family) == []
    assert shm_files(f"tokenstream_{process.pid}_") == []


@pytest.mark.server
def test_serve_cli_stops_cleanly_on_sigint_while_loading(tmp_path: Path, cli_process) -> None:
    """SIGINT before the models are loaded: exit 0 within 15 s, nothing left behind."""
    write_echo_model(tmp_path, init_line="time.sleep(60)")  # stays "loading" for a minute
    process = cli_process(serve_command(tmp_path))
    deadline = time.monotonic() + 60
    while len(family := descendants(process.pid)) < 2:  # tritonserver and the loading stub
        assert time.monotonic() < deadline, "the model never started loading"
        time.sleep(0.1)
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=STOP_LIMIT_S)
    print(f"serve exited {time.monotonic() - started:.2f} s after SIGINT while loading")
    assert process.returncode == 0, output
    assert "Triton is ready" not in output
    assert alive(family) == []
    assert shm_files(f"tokenstream_{process.pid}_") == []


@pytest.mark.server
def test_serve_cli_killed_takes_triton_with_it(echo_repository: Path, cli_process) -> None:
    """Even a SIGKILLed `serve` leaves no server behind: tritonserver has a parent-death signal."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs util-linux setpriv")
    process = cli_process(serve_command(echo_repository))
    wait_for_line(process, "Triton is ready", timeout=120)
    family = descendants(process.pid)
    runtime = [arg for pid in family for arg in cmdline(pid) if "--model-repository=" in arg]
    process.kill()
    process.wait()
    try:
        deadline = time.monotonic() + STOP_LIMIT_S
        while alive(family):  # the stub notices its server's death by itself
            assert time.monotonic() < deadline, f"left running: {alive(family)}"
            time.sleep(0.1)
    finally:  # what stop() would have removed, had it run
        for path in shm_files(f"tokenstream_{process.pid}_"):
            path.unlink()
        for arg in runtime:
            shutil.rmtree(arg.partition("=")[2], ignore_errors=True)


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


@pytest.mark.server
def test_serve_cli_exits_nonzero_when_the_model_fails(tmp_path: Path, cli_process) -> None:
    """`tokenstream serve` prints the server's last log lines and exits 1 if Triton dies."""
    write_echo_model(tmp_path, init_line='raise RuntimeError("broken on purpose")')
    process = cli_process(serve_command(tmp_path))
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 1
    assert "broken on purpose" in output
    assert shm_files(f"tokenstream_{process.pid}_") == []


def get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    """GET a URL: (status, body), for error statuses too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.server
def test_serve_cli_runs_the_bridge_in_process(tmp_path: Path, cli_process) -> None:
    """With the bridge on, serve answers the chat page and health, and its readiness waits for
    the bridge; SIGINT stops both cleanly."""
    pytest.importorskip("clients.bridge")
    write_echo_model(tmp_path, name="chat")  # the bridge's health asks for the "chat" model
    bridge_port = free_port()
    command = serve_command(tmp_path)
    command.remove("--no-bridge")
    supervisor_port = free_port()
    process = cli_process(
        [*command, f"--bridge-port={bridge_port}", f"--supervisor-port={supervisor_port}"]
    )
    wait_for_line(process, "Triton is ready", timeout=120)
    deadline = time.monotonic() + 30
    while get_or_none(f"http://127.0.0.1:{bridge_port}/healthz") != 200:
        assert time.monotonic() < deadline, "the bridge never reported Triton ready"
        time.sleep(0.2)
    status, page = get(f"http://127.0.0.1:{bridge_port}/")
    assert status == 200 and b"<html" in page.lower()
    # the supervisor's readiness waited for the bridge: it listens by now
    status, body = get(f"http://127.0.0.1:{supervisor_port}/status")
    assert json.loads(body)["parts"] == {"bridge": True}
    assert get(f"http://127.0.0.1:{supervisor_port}/ready")[0] == 200
    family = descendants(process.pid)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=STOP_LIMIT_S)
    assert process.returncode == 0, output
    assert alive(family) == []
    assert shm_files(f"tokenstream_{process.pid}_") == []


def get_or_none(url: str) -> int | None:
    """The status of GET `url`, None while nothing listens there."""
    try:
        return get(url, timeout=2)[0]
    except OSError:
        return None
