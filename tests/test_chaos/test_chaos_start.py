"""Chaos: a start that cannot finish (launcher/startup.py), at the first start and at a restart.

Triton 2.51's python backend gives up launching a model process whose health check fails while
its `initialize` runs, then waits for that process to exit, while the process finishes
`initialize` and waits for commands: neither side moves (a real start hung so for six minutes).
The model of tests/hung_start.py stops its own process for 4 s inside `initialize`, so that its
health thread misses the backend's 1 s checks, which makes Triton take that very path. `serve`
catches it within the 20 s bound after the `initialize returned` line, says so with the real time
waited and the cause, kills that tritonserver and its stubs, removes their /dev/shm files and
tries once more: it serves when the second start works, exits with status 1 when it hangs too,
and a restart by the supervisor does the same. Each prints what it measured.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import alive, shm_files, stub_pids, supervised_server, wait_for
from hung_start import hanging_repository

from streaming_backend.launcher import free_port
from streaming_backend.launcher.processes import SHM_DIR, descendants
from streaming_backend.launcher.startup import INITIALIZED

pytestmark = [pytest.mark.chaos, pytest.mark.server]

CAUGHT_WITHIN_S = 30.0  # from the `initialize returned` line to the hang being said
HUNG = "its start hangs"


class ServeRun:
    """`tokenstream serve --no-bridge` on a repository, its output lines with when each came,
    and every process it started (tritonservers, stubs, their helpers) with its start time."""

    def __init__(self, repository: Path):
        self.ports = {name: free_port() for name in ("http", "grpc", "metrics", "supervisor")}
        command = [sys.executable, "-m", "clients.cli", "serve", f"--repository={repository}"]
        command += ["--no-bridge"] + [f"--{name}-port={p}" for name, p in self.ports.items()]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[tuple[float, str]] = []
        self.family: dict[int, int] = {}
        self._threads = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._record_family, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def _record_family(self) -> None:
        while self.process.poll() is None:
            self.family |= descendants(self.process.pid)
            time.sleep(0.05)

    def when(self, needle: str, timeout: float, after: float = 0.0) -> float:
        """When the first line holding `needle` came (after `after`), waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        while not self.seen(needle, after):
            assert time.monotonic() < deadline, f"{needle!r} not seen; output:\n{self.tail()}"
            time.sleep(0.05)
        return self.seen(needle, after)[0]

    def seen(self, needle: str, after: float = 0.0) -> list[float]:
        """When each line holding `needle` came (after `after`); a hang's message repeats the
        log's tail, so a log line may come twice."""
        return [at for at, line in list(self.lines) if needle in line and at > after]

    def text(self) -> str:
        return "\n".join(line for _, line in list(self.lines))

    def tail(self) -> str:
        return "\n".join(line for _, line in list(self.lines)[-40:])

    def stop(self) -> int:
        """SIGTERM (a no-op once it exited) and its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        for thread in self._threads:
            thread.join(timeout=10)
        return code

    def leftovers(self) -> tuple[list[int], list[Path]]:
        """Processes it started that still run, and /dev/shm files of its own prefix."""
        shm = sorted(SHM_DIR.glob(f"tokenstream_{self.process.pid}_*"))
        return alive(self.family), shm


def hang_lines(run: ServeRun) -> list[str]:
    return [line for _, line in run.lines if HUNG in line]


def test_a_start_that_hangs_is_caught_killed_and_started_once_more(tmp_path: Path) -> None:
    """The first start hangs, the second works: `serve` says the first hangs (the real time, the
    stub Triton waits for), kills it, starts once more and serves; /status counts a start_hung
    restart; after SIGTERM nothing is left."""
    repository, _ = hanging_repository(tmp_path, hangs="1")
    run = ServeRun(repository)
    try:
        initialized = run.when(INITIALIZED, timeout=120)
        caught = run.when(HUNG, timeout=120)
        killed = run.when("killed that tritonserver", timeout=30)
        again = run.when("starting tritonserver once more", timeout=30)
        initialized_again = run.when(INITIALIZED, timeout=120, after=again)
        ready = run.when("Triton is ready", timeout=120)
        body = json.dumps({"text_input": "hi"}).encode()
        url = f"http://127.0.0.1:{run.ports['http']}/v2/models/echo/generate_stream"
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=30) as answer:
            text = answer.read().decode()
        status_url = f"http://127.0.0.1:{run.ports['supervisor']}/status"
        with urllib.request.urlopen(status_url, timeout=10) as answer:
            status = json.loads(answer.read())
    finally:
        code = run.stop()
    processes, shm = run.leftovers()
    print(
        f"\nhung start: caught {caught - initialized:.1f} s after the initialize line; killed "
        f"{killed - caught:.2f} s later; ready again {ready - killed:.1f} s after; "
        f"{len(run.family)} processes seen in all; exit status {code}\n"
        f"{hang_lines(run)[0][:400]}"
    )
    assert caught - initialized <= CAUGHT_WITHIN_S
    (said,) = hang_lines(run)
    assert "s after it started" in said and "waits for the model process echo_0_0" in said
    assert ready - initialized_again < CAUGHT_WITHIN_S
    assert '"text_output":"hi!"' in text
    assert status["restarts"] == {"start_hung": 1} and status["state"] == "ready"
    assert code == 0
    assert (processes, shm) == ([], [])


def test_a_start_that_always_hangs_fails_clearly_and_leaves_nothing(tmp_path: Path) -> None:
    """Both starts hang: each is said and killed, then `serve` exits with status 1 saying that
    the start hung twice and how long it tried; no process or /dev/shm file is left."""
    repository, _ = hanging_repository(tmp_path, hangs="always")
    run = ServeRun(repository)
    started = time.monotonic()
    try:
        code = run.process.wait(timeout=240)
    finally:
        run.stop()
    took = time.monotonic() - started
    processes, shm = run.leftovers()
    caught = run.seen(HUNG)
    again = run.seen("starting tritonserver once more")
    initialized = [run.seen(INITIALIZED)[0]] + [run.seen(INITIALIZED, after=t)[0] for t in again]
    print(
        f"\nalways hung: caught {caught[0] - initialized[0]:.1f} s and "
        f"{caught[1] - initialized[1]:.1f} s after the initialize lines; serve exited with "
        f"{code} after {took:.1f} s; last line: {run.lines[-1][1]}"
    )
    assert code == 1
    assert len(initialized) == len(caught) == 2
    assert all(c - i <= CAUGHT_WITHIN_S for c, i in zip(caught, initialized))
    assert "the start of tritonserver hung 2 times in" in run.text()
    assert "Triton is ready" not in run.text()
    assert (processes, shm) == ([], [])


def test_a_restart_that_hangs_is_caught_the_same_way(tmp_path: Path) -> None:
    """Serving, the model process is killed; the supervisor's restart hangs: it is caught, killed
    and tried once more, and the model serves again (restarts: stub_died and start_hung). The
    lost server and the hung one leave no process and no /dev/shm file."""
    repository, hangs = hanging_repository(tmp_path, hangs="0")
    others = descendants(os.getpid())  # what this test process ran before (other fixtures)
    with supervised_server(None, repository=repository) as (supervisor, health_url, events):
        servers = {id(supervisor.server): supervisor.server}  # every TritonServer it ran
        family = descendants(os.getpid())  # their processes, recorded all along
        watching = threading.Event()

        def record() -> None:
            while not watching.is_set():
                servers[id(supervisor.server)] = supervisor.server
                family.update(descendants(os.getpid()))
                time.sleep(0.05)

        recorder = threading.Thread(target=record, daemon=True)
        recorder.start()
        hangs.write_text("1")
        killed_at = time.monotonic()
        os.kill(stub_pids(supervisor.server)[0], signal.SIGKILL)
        try:
            wait_for(lambda: any(HUNG in line for line in events), timeout=120)
            caught_at = time.monotonic()
            wait_for(lambda: supervisor.state == "ready" and len(servers) == 3, timeout=120)
            back_at = time.monotonic()
        finally:
            watching.set()
            recorder.join(timeout=10)
        with urllib.request.urlopen(f"{health_url}/status", timeout=10) as answer:
            status = json.loads(answer.read())
        serving = supervisor.server
        gone = [server for server in servers.values() if server is not serving]
        left = set(alive(family)) - set(others) - {serving.pid} - set(descendants(serving.pid))
    print(
        f"\nhung restart: caught {caught_at - killed_at:.1f} s after the kill, serving again "
        f"{back_at - killed_at:.1f} s after it; restarts {status['restarts']}; "
        f"{len(family)} processes seen"
    )
    assert status["restarts"] == {"stub_died": 1, "start_hung": 1}
    assert sum(HUNG in line for line in events) == 1
    assert any("starting tritonserver once more" in line for line in events)
    assert len(gone) == 2 and all(server.returncode is not None for server in gone)
    assert left == set()
    assert [shm_files(server.shm_prefix) for server in gone] == [[], []]
