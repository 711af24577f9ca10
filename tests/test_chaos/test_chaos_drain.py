"""Chaos: SIGTERM to `tokenstream serve` with gRPC streams and websocket generations open.

Short streams finish, long ones end with a final error at the drain deadline, new requests are
refused as "draining", readiness drops at once, tritonserver exits by itself with status 0 (no
abort: the model has no open stream when Triton unloads it), and nothing is left behind.

Measured on 2.51: a gRPC stream that a client keeps open after its last response holds the model
in Triton until the exit timeout (then the launcher kills it), so clients here close theirs.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import GrpcStream, alive, kill_all, shm_files, wait_for, ws_generation

from streaming_backend.launcher import free_port
from streaming_backend.launcher.processes import descendants

pytestmark = [pytest.mark.chaos, pytest.mark.server]

DRAIN_S = 3.0
SHORT, LONG = 10, 240  # tokens; 20 ms apart, so a long one outlives the drain timeout


class Output:
    """The CLI's output lines, read in the background; wait for one holding a needle."""

    def __init__(self, process: subprocess.Popen[str]):
        self.lines: list[str] = []
        self._new = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process) -> None:
        for line in process.stdout:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()

    def wait(self, needle: str, timeout: float) -> float:
        """Block until a line holds `needle`; when it was seen (monotonic)."""
        with self._new:
            found = self._new.wait_for(lambda: any(needle in x for x in self.lines), timeout)
        assert found, f"{needle!r} not seen; output:\n{''.join(self.lines[-60:])}"
        return time.monotonic()

    def text(self) -> str:
        self._thread.join(timeout=10)
        return "".join(self.lines)


def ready_status(port: int, path: str = "/ready") -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def test_sigterm_drains_then_exits_cleanly(tiny_model_dir: Path) -> None:
    """Drain: short streams finish, long ones end at the deadline with an error, new requests
    are refused, and tritonserver exits with status 0 leaving nothing behind."""
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "bridge", "supervisor")}
    command = [sys.executable, "-m", "clients.cli", "serve", f"--model={tiny_model_dir}"]
    command += ["--dtype=float32", "--parameter=test_token_delay_ms=20", "--max-streams=16"]
    command += [f"--{name}-port={port}" for name, port in ports.items()]
    command += [f"--drain-timeout={DRAIN_S}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = Output(process)
    family: dict[int, int] = {}
    try:
        output.wait("Triton is ready", timeout=300)
        wait_for(lambda: ready_status(ports["supervisor"]) == 200, timeout=30)
        # the supervisor's /ready is the models'; the bridge's thread binds its port after it
        wait_for(lambda: ready_status(ports["bridge"], "/healthz") == 200, timeout=30)
        family = descendants(process.pid)
        grpc_url = f"127.0.0.1:{ports['grpc']}"
        short = [GrpcStream(grpc_url, max_tokens=SHORT).start() for _ in range(4)]
        long = [GrpcStream(grpc_url, max_tokens=LONG).start() for _ in range(4)]
        sockets = [{} for _ in range(2)]
        workers = [
            threading.Thread(target=ws_generation, args=(ports["bridge"], n, r), daemon=True)
            for n, r in zip((SHORT, LONG), sockets)
        ]
        for worker in workers:
            worker.start()
        wait_for(lambda: all(s.tokens > 0 for s in long) and sockets[1].get("started"), 60)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        output.wait("draining:", timeout=30)
        not_ready = ready_status(ports["supervisor"])
        refused = GrpcStream(grpc_url, max_tokens=SHORT).start()
        assert refused.ended.wait(30)
        # each client closes its stream once it ended, as grpc_client and the bridge do: an
        # idle stream a client keeps open holds the model in Triton past the exit timeout
        for stream in [refused, *short, *long]:
            assert stream.ended.wait(DRAIN_S + 30)
            stream.close()
        for worker in workers:
            worker.join(timeout=DRAIN_S + 30)
        code = process.wait(timeout=DRAIN_S + 30)
        exited = time.monotonic()
        text = output.text()
    finally:
        kill_all(process, family)
    ends = [s.ended_at - signalled for s in long]
    print(
        f"\ndrain: long streams ended {min(ends):.2f}-{max(ends):.2f} s after SIGTERM with "
        f"{long[0].error}; serve exited after {exited - signalled:.1f} s; refused: {refused.error}"
    )
    assert code == 0, text
    assert not_ready == 503
    assert "draining" in str(refused.error) and not refused.final
    assert [(s.final, s.tokens) for s in short] == [(True, SHORT)] * 4, [s.error for s in short]
    assert all(not s.final and "shutting down" in str(s.error) for s in long)
    assert all(DRAIN_S - 0.5 < end < DRAIN_S + 5 for end in ends), ends
    assert sockets[0]["last"]["type"] == "done" and sockets[0]["tokens"] == SHORT, sockets[0]
    assert sockets[1]["last"]["type"] == "error", sockets[1]
    assert "shutting down" in sockets[1]["last"]["message"]
    assert "tritonserver exited cleanly" in text, text[-3000:]
    for sign in ("malloc", "Aborted", "Segmentation fault", "SIGSEGV", "SIGABRT"):
        assert sign not in text
    assert alive(family) == []
    assert shm_files(f"tokenstream_{process.pid}_") == []


def test_a_second_signal_stops_at_once(tiny_model_dir: Path) -> None:
    """SIGTERM starts a 60 s drain; a second SIGTERM ends it at once and nothing is left."""
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "supervisor")}
    command = [sys.executable, "-m", "clients.cli", "serve", f"--model={tiny_model_dir}"]
    command += ["--dtype=float32", "--parameter=test_token_delay_ms=20", "--no-bridge"]
    command += [f"--{name}-port={port}" for name, port in ports.items()]
    command += ["--drain-timeout=60"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = Output(process)
    family: dict[int, int] = {}
    try:
        output.wait("Triton is ready", timeout=300)
        family = descendants(process.pid)
        stream = GrpcStream(f"127.0.0.1:{ports['grpc']}", max_tokens=LONG).start()
        wait_for(lambda: stream.tokens > 0, timeout=60)
        process.send_signal(signal.SIGTERM)
        output.wait("draining:", timeout=30)
        second = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
        took = time.monotonic() - second
        assert stream.ended.wait(10)
        stream.close()
        text = output.text()
    finally:
        kill_all(process, family)
    print(f"\nsecond signal: serve exited {took:.1f} s after it; the stream got {stream.error}")
    assert code == 0 and "stopping at once" in text
    assert took < 15
    assert stream.error is not None and not stream.final
    assert alive(family) == []
    assert shm_files(f"tokenstream_{process.pid}_") == []
