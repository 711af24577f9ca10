"""launcher/watch.py: a served model is lost when tritonserver exits, when a stub dies (a zombie
seen twice), or when its canary goes unanswered, answers "not healthy" or reports the engine
unhealthy. Checked against a real zombie process and a fake Triton HTTP endpoint, no server."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import wait_for

from streaming_backend.launcher import watch as watch_module
from streaming_backend.launcher.watch import CanaryConfig, Failure, Watch
from streaming_backend.wire import CONTROL, HEALTH_KEYS, TEXT_OUTPUT

KEY = "admin-key"


@dataclass
class FakeServer:
    """What Watch reads of a TritonServer."""

    pid: int
    http_url: str = "http://127.0.0.1:9"  # nothing listens: only the canary tests give one
    returncode: int | None = None


class FakeTriton:
    """A generate_stream endpoint that answers control requests as each model is told to:
    'healthy', 'unhealthy', 'stub died' (Triton's error for a dead stub) or 'silent' (the
    connection closed with no answer, as a timeout ends it: no wait in the tests)."""

    def __init__(self):
        self.answers: dict[str, str] = {}
        self.asked: list[tuple[str, dict]] = []  # (model, control body) per request
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                model = self.path.split("/")[3]  # /v2/models/<model>/generate_stream
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.asked.append((model, json.loads(body[CONTROL])))
                answer = fake.answers[model]
                if answer == "silent":
                    self.close_connection = True
                    return
                if answer == "stub died":
                    self._send(400, {"error": "Stub process 'chat_0_0' is not healthy."})
                    return
                healthy = answer == "healthy"
                state = dict.fromkeys(HEALTH_KEYS)
                state |= {"healthy": healthy, "reason": "" if healthy else "engine stopped"}
                state |= {"draining": False, "active": 0, "waiting": 0}
                event = json.dumps({TEXT_OUTPUT: json.dumps(state)})
                self._send(200, f"data: {event}\n\n", "text/event-stream")

            def _send(self, code, body, kind="application/json"):
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def triton():
    fake = FakeTriton()
    # the watched server's pid: a process of our own with no children, so that the zombie look
    # finds none (pid 1 collects any orphan that died, and may hold one unreaped for a while)
    childless = subprocess.Popen(["sleep", "600"])
    fake.server_pid = childless.pid
    yield fake
    childless.kill()
    childless.wait()
    fake.close()


def watch_of(triton: FakeTriton, models, key=KEY, misses=2) -> Watch:
    """A Watch on the fake endpoint, asking every 10 ms."""
    canary = CanaryConfig(interval_s=0.01, timeout_s=30, misses=misses)
    return Watch(FakeServer(pid=triton.server_pid, http_url=triton.url), models, key, canary)


def test_a_server_that_exited_is_lost_at_once():
    """tritonserver's exit status makes check() say server_died, whatever else holds."""
    watch = Watch(FakeServer(pid=1, returncode=3), ["chat"], KEY, CanaryConfig())
    assert watch.check() == Failure("server_died", "tritonserver exited (status 3)")


ZOMBIE_PARENT = """
import os, sys
child = os.fork()
if child == 0:
    os._exit(0)
print(child, flush=True)
sys.stdin.read()  # never reaps the child: it stays a zombie until this process ends
"""


def test_a_dead_stub_is_a_zombie_seen_on_two_looks():
    """A child of the server that died unreaped is a dead stub on the second look, not the
    first (an unload's stub is reaped in between); the failure names its pid."""
    parent = subprocess.Popen(
        [sys.executable, "-c", ZOMBIE_PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        child = int(parent.stdout.readline())
        wait_for(lambda: Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] == "Z")
        watch = Watch(FakeServer(pid=parent.pid), [], None, CanaryConfig())
        assert watch.check() is None
        assert watch.check() == Failure(
            "stub_died", f"a model process (backend stub, pid {child}) died"
        )
    finally:
        parent.kill()
        parent.wait()


def test_a_zombie_gone_by_the_next_look_is_no_failure(monkeypatch):
    """Zombies that differ between two looks (each reaped in time) are no failure."""
    looks = iter([{101: 1}, {102: 1}, {102: 1}])
    monkeypatch.setattr(watch_module, "zombie_children", lambda pid: next(looks))
    watch = Watch(FakeServer(pid=1), [], None, CanaryConfig())
    assert watch.check() is None
    assert watch.check() is None  # 101 was reaped; 102 seen once
    assert watch.check().kind == "stub_died"


def test_a_healthy_canary_is_no_failure_and_its_answer_is_kept(triton):
    """Each model is asked with the admin key and the health action; healthy answers are kept."""
    triton.answers = {"chat": "healthy", "dialogue_model": "healthy"}
    watch = watch_of(triton, ["chat", "dialogue_model"])
    misses = {"chat": 0, "dialogue_model": 0}
    assert watch._ask("chat", misses) is None
    assert watch._ask("dialogue_model", misses) is None
    assert triton.asked == [
        ("chat", {"key": KEY, "action": "health"}),
        ("dialogue_model", {"key": KEY, "action": "health"}),
    ]
    assert set(watch.answers) == {"chat", "dialogue_model"} and watch.answers["chat"].healthy


def test_an_unhealthy_engine_is_lost_with_its_reason(triton):
    """A model that answers unhealthy is lost at once, with the reason it gave."""
    triton.answers = {"chat": "unhealthy"}
    failure = watch_of(triton, ["chat"])._ask("chat", {"chat": 0})
    assert failure == Failure("unhealthy", "model chat is unhealthy: engine stopped")


def test_tritons_not_healthy_is_a_dead_stub_at_once(triton):
    """Triton's 'not healthy' error is a dead stub on the first canary, no misses counted."""
    triton.answers = {"chat": "stub died"}
    failure = watch_of(triton, ["chat"], misses=5)._ask("chat", {"chat": 0})
    assert failure.kind == "stub_died" and "is not healthy" in failure.message


def test_unanswered_canaries_count_in_a_row(triton):
    """A silent model is unresponsive after `misses` canaries in a row; an answer in between
    starts the count again."""
    triton.answers = {"chat": "silent"}
    watch = watch_of(triton, ["chat"], misses=2)
    misses = {"chat": 0}
    assert watch._ask("chat", misses) is None and misses == {"chat": 1}
    triton.answers["chat"] = "healthy"
    assert watch._ask("chat", misses) is None and misses == {"chat": 0}
    triton.answers["chat"] = "silent"
    assert watch._ask("chat", misses) is None
    failure = watch._ask("chat", misses)
    assert failure.kind == "unresponsive" and "did not answer 2 canaries" in failure.message


def test_the_canary_thread_reports_and_resume_starts_afresh(triton):
    """Started, the canary thread sets check()'s verdict once a model is lost and stops asking;
    resume() clears the verdict and the answers."""
    triton.answers = {"chat": "unhealthy"}
    watch = watch_of(triton, ["chat"]).start()
    try:
        wait_for(lambda: watch.check() is not None)
        assert watch.check().kind == "unhealthy"
        watch._thread.join(5)
        assert not watch._thread.is_alive()
        watch.resume()
        assert watch.check() is None and watch.answers == {}
    finally:
        watch.close()


def test_without_the_admin_key_no_model_is_asked(triton):
    """Control requests need the admin key: without one the watch asks nothing."""
    triton.answers = {"chat": "unhealthy"}
    watch = watch_of(triton, ["chat"], key=None)
    assert watch.models == []
    assert watch.check() is None and triton.asked == []
