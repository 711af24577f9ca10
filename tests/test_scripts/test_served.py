"""scripts/served.py: a server started in its own process group, ready when its URLs answer,
stopped whole however the block ends; and its command line, which runs commands against it."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from streaming_backend.launcher import free_port


@pytest.fixture
def served(load_script):
    """The script as a module."""
    return load_script("served")


def http_server(port: int, folder: Path) -> list[str]:
    """A real HTTP server on loopback serving `folder`'s files."""
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    return [*command, "--directory", str(folder)]


def test_a_server_is_ready_once_its_url_answers_with_the_text_and_is_stopped_whole(
    served, tmp_path
):
    """Ready when GET answers 200 holding the expected text (a file appearing late); after the
    block the server and its group are gone and the stop was timed."""
    port = free_port()
    (tmp_path / "models").write_text('{"data": [{"id": "other"}]}')
    server = served.Served(
        http_server(port, tmp_path), [f"http://127.0.0.1:{port}/models"], expect='"chat"',
        log=tmp_path / "server.log",
    )  # fmt: skip
    with pytest.raises(TimeoutError, match="not ready after 2 s"):
        server.ready_timeout_s = 2
        server.start()
    assert server.process.poll() is not None and served.group(server.process.pid) == []
    (tmp_path / "models").write_text('{"data": [{"id": "chat"}]}')
    again = served.Served(server.command, server.ready, expect='"chat"')
    with again:
        assert again.ready_s is not None and again.process.poll() is None
    assert again.process.returncode == -signal.SIGTERM and again.stop_ms is not None
    assert served.group(again.process.pid) == []
    assert "GET /models" in (tmp_path / "server.log").read_text()


def test_a_server_that_exits_first_fails_its_start_at_once(served):
    """Its exit status, not a wait for the whole timeout."""
    server = served.Served([sys.executable, "-c", "raise SystemExit(3)"], ["http://127.0.0.1:1/"])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with status 3"), server:
        pass
    assert time.monotonic() - started < 30


def test_stop_ends_the_servers_whole_process_group(served, tmp_path, monkeypatch):
    """A server whose child ignores SIGTERM: the server goes at SIGTERM, its child at the group's
    SIGKILL, and nothing of the group is left."""
    monkeypatch.setattr(served, "STOP_TIMEOUT_S", 2)
    ready = tmp_path / "ready"
    child = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "pathlib.Path(sys.argv[1]).touch()\n"
        "time.sleep(60)\n"
    )
    server = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', *sys.argv[1:]])"
    server += "\ntime.sleep(60)"
    process = served.Served([sys.executable, "-c", server, child, str(ready)], ready=[])
    process.start()  # no URL: ready at once
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(served.group(process.process.pid)) == 2  # the server and its child
    process.stop()
    assert process.process.returncode == -signal.SIGTERM
    assert served.group(process.process.pid) == []


def test_the_command_line_runs_every_line_against_the_server_then_stops_it(
    served, tmp_path, capsys
):
    """Each --run line runs in turn while the server is up (one that fails does not stop the
    next, and makes the exit status 1); SIGINT stops it; ready and stop times are printed. A
    server that never gets ready: status 2."""
    port = free_port()
    (tmp_path / "hello").write_text("hello")
    url = f"http://127.0.0.1:{port}/hello"
    fetch = f"import urllib.request; print(urllib.request.urlopen('{url}').read().decode())"
    status = served.main(
        [
            "--server", " ".join(http_server(port, tmp_path)), "--ready", url,
            "--log", str(tmp_path / "log"), "--stop-signal", "INT",
            "--run", "exit 3",
            "--run", f'{sys.executable} -c "{fetch}" > {tmp_path / "fetched"}',
        ]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 1 and "served: failed: exit 3" in err
    assert (tmp_path / "fetched").read_text() == "hello\n"
    assert "served: ready in" in out and "served: stopped in" in out
    assert served.main(["--server", "true", "--ready", url, "--timeout", "5"]) == 2  # not ready
