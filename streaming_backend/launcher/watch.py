"""Noticing that a served model is lost: its stub process died, tritonserver died, or the model
stopped answering its canary (or says its engine is unhealthy).

Triton 2.51 notices none of these by itself for a python-backend model: a dead stub stays a
zombie child of tritonserver, `/v2/models/<m>/ready` stays 200, open streams hang and every new
request fails with "Stub process ... is not healthy". So the watch looks at the processes and
asks the model itself.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from streaming_backend.launcher.control import ModelHealth, control
from streaming_backend.launcher.processes import zombie_children
from streaming_backend.launcher.server import TritonServer
from streaming_backend.wire import CONTROL_HEALTH


@dataclass(frozen=True)
class Failure:
    """Why the served models are lost: a metrics label and a sentence for the log."""

    kind: str  # stub_died | server_died | unresponsive | unhealthy
    message: str


@dataclass(frozen=True)
class CanaryConfig:
    """How often and how patiently the models are asked for their health."""

    interval_s: float = 5.0
    timeout_s: float = 10.0
    misses: int = 2  # unanswered canaries in a row that count as "stopped answering"


class Watch:
    """Checks one running TritonServer; check() returns a Failure once the models are lost."""

    def __init__(self, server: TritonServer, models: list[str], key: str | None, canary):
        self.server = server
        self.models = models if key else []  # control requests need the admin key
        self.key = key
        self.canary: CanaryConfig = canary
        self._zombies_seen: set[int] = set()
        self._verdict: Failure | None = None  # set by the canary thread
        self.answers: dict[str, ModelHealth] = {}  # each model's latest canary answer
        self._paused = threading.Event()  # set while a reload loads: slow answers are expected
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._canary_loop, name="canary", daemon=True)

    def start(self) -> Watch:
        """Start the canary thread (the process checks run in check())."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the canary thread."""
        self._stop.set()

    def pause(self) -> None:
        """Stop judging the canary (a reload makes the model slow to answer for a while)."""
        self._paused.set()

    def resume(self) -> None:
        """Judge the canary again, starting afresh (the models may have changed)."""
        self._verdict = None
        self.answers = {}
        self._paused.clear()

    def check(self) -> Failure | None:
        """One look at the processes, plus the canary's latest verdict."""
        code = self.server.returncode
        if code is not None:
            return Failure("server_died", f"tritonserver exited (status {code})")
        zombies = set(zombie_children(self.server.pid))
        # a stub ended by an unload is reaped at once; a crashed one stays a zombie: two looks
        dead = zombies & self._zombies_seen
        self._zombies_seen = zombies
        if dead:
            pids = ", ".join(str(pid) for pid in sorted(dead))
            return Failure("stub_died", f"a model process (backend stub, pid {pids}) died")
        return self._verdict

    def _canary_loop(self) -> None:
        """Ask each model for its health every interval; record a Failure when it is lost."""
        misses = dict.fromkeys(self.models, 0)
        while not self._stop.wait(self.canary.interval_s):
            if self._paused.is_set():
                misses = dict.fromkeys(self.models, 0)
                continue
            for model in self.models:
                failure = self._ask(model, misses)
                if failure is not None and not self._stop.is_set() and not self._paused.is_set():
                    self._verdict = failure
                    return

    def _ask(self, model: str, misses: dict[str, int]) -> Failure | None:
        """One canary for `model`; a Failure when it is lost."""
        started = time.monotonic()
        try:
            health = control(
                self.server.http_url, model, self.key, CONTROL_HEALTH, self.canary.timeout_s
            )
        except Exception as error:  # noqa: BLE001 - any failure to get an answer is a miss
            if "not healthy" in str(error):  # Triton's word for a dead stub
                return Failure("stub_died", f"model {model}: {error}")
            misses[model] += 1
            if misses[model] < self.canary.misses:
                return None
            waited = time.monotonic() - started
            return Failure(
                "unresponsive",
                f"model {model} did not answer {misses[model]} canaries (last: {error}; "
                f"{waited:.1f} s)",
            )
        misses[model] = 0
        self.answers = {**self.answers, model: health}  # a new dict: other threads read it
        if not health.healthy:
            return Failure("unhealthy", f"model {model} is unhealthy: {health.reason}")
        return None
