"""Tests for streaming_backend/launcher.py: a real tritonserver on a tiny decoupled echo model."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from streaming_backend.launcher import (
    SHM_DIR,
    ServerConfig,
    ServerDied,
    TritonServer,
    add_arguments,
    config_from_args,
    descendants,
    free_port,
    glob_escape,
    is_alive,
    make_runtime_repository,
    patch_parameters,
)

STOP_LIMIT_S = 15.0

ECHO_CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
# parameters {{ key: "suffix" value: {{ string_value: "from a comment" }} }}
parameters {{ key: "suffix" value: {{ string_value: "!" }} }}
"""

# Echoes text_input + the "suffix" parameter in 3 responses, FINAL on the last.
ECHO_MODEL = """\
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        {init_line}
        params = json.loads(args["model_config"])["parameters"]
        self.suffix = params["suffix"]["string_value"]

    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0]
            sender = request.get_response_sender()
            for i in range(3):
                out = np.array([text.decode() + self.suffix], dtype=np.object_)
                response = pb_utils.InferenceResponse([pb_utils.Tensor("text_output", out)])
                sender.send(response, flags=final if i == 2 else 0)
        return None

    def finalize(self):
        {finalize_line}
"""


def write_echo_model(
    repository: Path, name: str = "echo", init_line: str = "pass", finalize_line: str = "pass"
) -> Path:
    """Write the echo model into `repository`; the two lines let a test break it on purpose."""
    model_dir = repository / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(ECHO_CONFIG.format(name=name))
    code = ECHO_MODEL.format(init_line=init_line, finalize_line=finalize_line)
    (model_dir / "1" / "model.py").write_text(code)
    return model_dir


def loopback_config(repository: Path, **overrides: object) -> ServerConfig:
    """A ServerConfig on free loopback ports."""
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    return ServerConfig(repository=repository, **(ports | overrides))


def shm_files(prefix: str) -> list[Path]:
    return sorted(SHM_DIR.glob(f"{glob_escape(prefix)}*"))


def alive(processes: dict[int, int]) -> list[int]:
    return [pid for pid, start in processes.items() if is_alive(pid, start)]


def stream(server: TritonServer, model: str, text: str) -> list[dict]:
    """POST generate_stream and return the SSE events as dicts."""
    body = json.dumps({"text_input": text}).encode()
    url = f"{server.http_url}/v2/models/{model}/generate_stream"
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        lines = response.read().decode().splitlines()
    return [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]


@pytest.fixture
def echo_repository(tmp_path: Path) -> Path:
    repository = tmp_path / "repository"
    write_echo_model(repository)
    return repository


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


PATCH_TABLE = [
    pytest.param(
        'parameters { key: "model" value: { string_value: "a" } }\n',
        {"model": "b"},
        'parameters { key: "model" value: { string_value: "b" } }\n',
        id="replace-existing",
    ),
    pytest.param(
        'parameters {\n  key: "dtype"\n  value: {\n    string_value: "auto"\n  }\n}\n',
        {"dtype": "float32"},
        'parameters {\n  key: "dtype"\n  value: {\n    string_value: "float32"\n  }\n}\n',
        id="replace-multiline",
    ),
    pytest.param(
        'parameters [ { key: "model", value: { string_value: "a" } } ]\n',
        {"model": "b"},
        'parameters [ { key: "model", value: { string_value: "b" } } ]\n',
        id="replace-in-list-form",
    ),
    pytest.param(
        'name: "chat"\n',
        {"max_streams": "4"},
        'name: "chat"\nparameters { key: "max_streams" value: { string_value: "4" } }\n',
        id="add-new-key",
    ),
    pytest.param(
        'parameters { key: "a" value: { string_value: "1" } }\n'
        'parameters { key: "b" value: { string_value: "2" } }\n',
        {"b": "3"},
        'parameters { key: "a" value: { string_value: "1" } }\n'
        'parameters { key: "b" value: { string_value: "3" } }\n',
        id="keep-other-keys",
    ),
    pytest.param(
        '# parameters { key: "model" value: { string_value: "old" } }\n',
        {"model": "new"},
        '# parameters { key: "model" value: { string_value: "old" } }\n'
        'parameters { key: "model" value: { string_value: "new" } }\n',
        id="ignore-commented-entry",
    ),
    pytest.param(
        'parameters { key: "model" value: { string_value: "say \\"hi\\"" } }',
        {"model": 'C:\\m "x"'},
        'parameters { key: "model" value: { string_value: "C:\\\\m \\"x\\"" } }',
        id="escape-quotes-and-backslashes",
    ),
]


@pytest.mark.parametrize(("text", "mapping", "expected"), PATCH_TABLE)
def test_patch_parameters(text: str, mapping: dict[str, str], expected: str) -> None:
    """patch_parameters replaces a key's string_value or appends an entry, leaving the rest."""
    assert patch_parameters(text, mapping) == expected


def test_config_parameters_skip_unset_and_add_extras() -> None:
    """Unset settings are left to the model's config; extra parameters are added as strings."""
    config = ServerConfig(max_streams=8, model_parameters={"test_first_token_delay_ms": "50"})
    assert config.parameters() == {
        "dtype": "auto",
        "max_streams": "8",
        "test_first_token_delay_ms": "50",
    }


def test_config_rejects_an_exit_timeout_that_breaks_the_stop_bound() -> None:
    """An exit timeout that would push stop() past 15 s is refused up front."""
    with pytest.raises(ValueError, match="exit_timeout_s"):
        ServerConfig(exit_timeout_s=60)


def test_runtime_repository_patches_config_and_links_the_rest(echo_repository: Path) -> None:
    """The runtime copy has patched configs, links to version folders, and leaves the source."""
    original = (echo_repository / "echo" / "config.pbtxt").read_text()
    runtime = make_runtime_repository(echo_repository, {"suffix": "?", "model": "m"})
    try:
        config = (runtime / "echo" / "config.pbtxt").read_text()
        assert 'string_value: "?"' in config and 'key: "model"' in config
        assert (runtime / "echo" / "1").resolve() == (echo_repository / "echo" / "1").resolve()
        assert (echo_repository / "echo" / "config.pbtxt").read_text() == original
    finally:
        shutil.rmtree(runtime)


def test_serve_options_map_to_config(tmp_path: Path) -> None:
    """Ports 0 mean the defaults 8000/8001/8002; --parameter adds model parameters."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--repository", str(tmp_path), "--grpc-port", "9001"])
    args_extra = parser.parse_args(["--parameter", "k=v=w", "--max-streams", "2"])
    config = config_from_args(args)
    assert (config.http_port, config.grpc_port, config.metrics_port) == (8000, 9001, 8002)
    assert config.repository == tmp_path and config.host == "127.0.0.1"
    assert config_from_args(args_extra).parameters()["k"] == "v=w"
    assert config_from_args(args_extra).max_streams == 2


def test_repository_defaults_to_the_checkout_or_the_variable(monkeypatch, tmp_path: Path) -> None:
    """The checkout's repository/ by default; $TOKENSTREAM_REPOSITORY (installed copies) wins."""
    monkeypatch.delenv("TOKENSTREAM_REPOSITORY", raising=False)
    assert ServerConfig().repository == Path(__file__).resolve().parent.parent / "repository"
    monkeypatch.setenv("TOKENSTREAM_REPOSITORY", str(tmp_path))
    assert ServerConfig().repository == tmp_path


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
            process.kill()
            process.wait()
            for pid, start_time in family.items():
                if is_alive(pid, start_time):
                    os.kill(pid, signal.SIGKILL)
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
    """With the bridge on, serve answers the chat page and health; SIGINT stops both cleanly."""
    pytest.importorskip("clients.bridge")
    write_echo_model(tmp_path, name="chat")  # the bridge's health asks for the "chat" model
    bridge_port = free_port()
    command = serve_command(tmp_path)
    command.remove("--no-bridge")
    process = cli_process([*command, f"--bridge-port={bridge_port}"])
    wait_for_line(process, "Triton is ready", timeout=120)
    deadline = time.monotonic() + 30
    while get_or_none(f"http://127.0.0.1:{bridge_port}/healthz") != 200:
        assert time.monotonic() < deadline, "the bridge never reported Triton ready"
        time.sleep(0.2)
    status, page = get(f"http://127.0.0.1:{bridge_port}/")
    assert status == 200 and b"<html" in page.lower()
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
