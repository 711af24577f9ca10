"""Keep tritonserver serving: restart it when a model is lost, reload a model without downtime,
and drain before a clean exit. Standard library only.

Recovery restarts tritonserver rather than reloading the model: checked on 2.51, a reload through
the repository API brings a model with a dead stub back, but the streams that were open on it stay
hung for good (their response senders died with the stub, and Triton never ends them); only
closing the clients' connections, i.e. a new tritonserver, ends them. Killing the old one at once
ends every open stream on every transport with UNAVAILABLE within the watch's poll interval.

A start that cannot finish (every model's initialize returned and the models are still not ready
after ServerConfig.hung_start_s: startup.py) is said so, its tritonserver and stubs killed and its
/dev/shm files removed, and the start is tried once more; at the first start and at every restart
alike. A second hung start fails that start (the first: serve exits; a restart: it counts against
the restart budget).

Drain: the model is told (a control request with the admin key) to refuse new requests; open
streams run on until the drain timeout, then the model ends the rest with a final error response;
only then does tritonserver get SIGTERM, so it never unloads a model under open decoupled streams
(Triton does not count those as in flight, and unloading under them aborted the server).
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from streaming_backend.launcher.control import (
    ControlError,
    control,
    load_model,
    model_ready,
    model_speculation,
)
from streaming_backend.launcher.repository import patch_parameters, read_parameters
from streaming_backend.launcher.server import ServerConfig, ServerDied, StartHung, TritonServer
from streaming_backend.launcher.watch import CanaryConfig, Failure, Watch
from streaming_backend.model.hardware import AUTO, DtypeChoice, host_dtype, host_quantize
from streaming_backend.wire import (
    CHAT_MODEL,
    CONTROL,
    CONTROL_DRAIN,
    CONTROL_END,
    CONTROL_HEALTH,
    DIALOGUE_MODEL,
    DIALOGUE_SPECULATION,
    FORWARD,
    MEMORY,
    NUMERICS,
    SPECULATION,
    STEPS,
    SYSTEM_FINGERPRINT,
)

POLL_S = 0.25  # process checks: a dead stub is seen within two polls
DRAIN_POLL_S = 0.1
CONTROL_TIMEOUT_S = 10.0
METRICS_TIMEOUT_S = 2.0  # a read of Triton's metrics port for /status
END_WAIT_S = 5.0  # after the drain deadline, for the ended streams' final responses to go out
RELOAD_TIMEOUT_S = 600.0  # a new model may take minutes to load
HUNG_START_TRIES = 2  # a start that hangs is tried once more
START_HUNG = "start_hung"  # the restarts' cause (/status, /metrics) for a hung start tried again

# states, as /status and the log name them
STARTING, READY, RECOVERING, RELOADING, DRAINING, STOPPED, FAILED = (
    "starting",
    "ready",
    "recovering",
    "reloading",
    "draining",
    "stopped",
    "failed",
)


@dataclass(frozen=True)
class RestartBudget:
    """At most `max_restarts` within `window_s`; waits grow from 0 s, doubling up to a cap."""

    max_restarts: int = 5
    window_s: float = 600.0
    first_backoff_s: float = 1.0  # before the second restart in the window (the first: none)
    max_backoff_s: float = 30.0

    def backoff(self, recent: int) -> float | None:
        """The wait before a restart when `recent` restarts (this one included) fall in the
        window; None when the budget is spent."""
        if recent > self.max_restarts:
            return None
        if recent <= 1:
            return 0.0
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** (recent - 2))


@dataclass(frozen=True)
class SupervisorConfig:
    """The server to keep running and how to watch, restart and drain it."""

    server: ServerConfig
    budget: RestartBudget = field(default_factory=RestartBudget)
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    drain_timeout_s: float = 30.0


def _dtype_choice(setting: str) -> DtypeChoice:
    """The precision the models load in on this host, by the rule they apply themselves; an
    unknown setting is shown as such (the models refuse it at load, with the same message)."""
    try:
        return host_dtype(setting)
    except ValueError as error:
        return DtypeChoice(setting, "", str(error))


class Supervisor:
    """Runs one tritonserver at a time, with explicit model control and a restricted repository
    API; the admin key is generated here unless the config names one."""

    def __init__(
        self,
        config: SupervisorConfig,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
        server_log: Callable[[str], None] | None = lambda line: print(line, flush=True),
    ):
        """`say` gets our event lines, `server_log` tritonserver's (None: only its tail kept)."""
        server = config.server
        key = server.admin_key or secrets.token_urlsafe(24)
        server = dataclasses.replace(server, explicit_model_control=True, admin_key=key)
        self.config = dataclasses.replace(config, server=server)
        self._say = say
        self._server_log = server_log
        self._lock = threading.RLock()  # one lifecycle change at a time: restart, reload, drain
        self.server: TritonServer | None = None
        self.state = STARTING
        self.reason = ""  # why the state is not ready (the last failure, the give-up reason)
        self.restarts: dict[str, int] = {}  # failure kind -> restarts it caused
        self.reloads = {"ok": 0, "failed": 0}
        self.heartbeat = time.monotonic()  # liveness: the supervising loop still turns
        self._restart_times: list[float] = []
        self._watch: Watch | None = None
        self._parts: dict[str, threading.Event] = {}  # more that readiness waits for (`require`)
        self.dtype = _dtype_choice(server.parameters().get("dtype", AUTO))
        # the weight format the models pick on this host, by their own rule (hardware.py)
        self.quantize = host_quantize(server.parameters().get("quantize", AUTO), self.dtype.dtype)

    @property
    def admin_key(self) -> str:
        """The key of Triton's restricted repository API and of the model's control requests."""
        return self.config.server.admin_key or ""

    # ---- readiness --------------------------------------------------------------------------

    def require(self, part: str) -> threading.Event:
        """An event that `part` (the bridge) sets once it serves and clears when it stops:
        readiness waits for it too, and /status shows it under "parts"."""
        return self._parts.setdefault(part, threading.Event())

    def models_ready(self) -> bool:
        """The models serve (also while a reload swaps one): not starting, recovering,
        draining or failed. Cheap (no request to Triton): the bridge asks per frame."""
        server = self.server
        return self.state in (READY, RELOADING) and server is not None and server.returncode is None

    def ready(self) -> bool:
        """Ready for traffic: the models serve and every required part (`require`) does."""
        return self.models_ready() and all(part.is_set() for part in self._parts.values())

    def status(self) -> dict:
        """State, reason, counters and endpoints, as /status shows them; the chat model's
        numerics, system fingerprint, steps, forward, memory and speculation as its latest
        canary told them (None before one did); the dialogue model's speculation as its
        counters on Triton's metrics port show them (None where it is not served)."""
        server = self.server
        watch = self._watch
        health = watch.answers.get(CHAT_MODEL) if watch is not None else None
        return {
            "state": self.state,
            "ready": self.ready(),
            "reason": self.reason,
            "parts": {name: part.is_set() for name, part in self._parts.items()},
            "restarts": dict(self.restarts),
            "reloads": dict(self.reloads),
            "model": self.config.server.model or "",
            "dtype": self.dtype.as_dict(),
            "quantize": self.quantize.as_dict(),
            "tritonserver_pid": server.pid if server else None,
            SYSTEM_FINGERPRINT: health.system_fingerprint if health else None,
            NUMERICS: health.numerics if health else None,
            STEPS: health.steps if health else None,
            FORWARD: health.forward if health else None,
            MEMORY: health.memory if health else None,
            SPECULATION: health.speculation if health else None,
            DIALOGUE_SPECULATION: self._dialogue_speculation(),
        }

    def _dialogue_speculation(self) -> dict | None:
        """The dialogue model's drafted and accepted tokens (it answers no canary): read from
        its counters on Triton's metrics port; None where it is not served."""
        server = self.server
        if server is None or server.returncode is not None:
            return None
        if DIALOGUE_MODEL not in self._served_models():
            return None
        return model_speculation(server.metrics_url, DIALOGUE_MODEL, METRICS_TIMEOUT_S)

    # ---- run --------------------------------------------------------------------------------

    def start(self, stop: threading.Event) -> bool:
        """Start tritonserver and wait until it is ready; False if `stop` came first.

        Raises ServerDied or TimeoutError when it cannot start at all (nothing is restarted
        before the models have been ready once: a model that never loads is a config error),
        StartHung when the start hung twice (a hung start is tried once more: _launch).
        """
        with self._lock:
            self.state = STARTING
            return self._launch(stop)

    def watch(self, stop: threading.Event) -> None:
        """Watch the server until `stop`; restart it whenever its models are lost."""
        while not stop.wait(POLL_S):
            self.heartbeat = time.monotonic()
            watch = self._watch
            failure = watch.check() if watch is not None and self.state == READY else None
            if failure is not None:
                self._recover(failure, stop)

    def drain(self, force: threading.Event) -> float:
        """Refuse new requests, let open streams finish up to the drain timeout, end the rest;
        seconds taken. `force` (a second signal) cuts it short."""
        with self._lock:
            return self._drain(force)

    def shutdown(self, graceful: bool = True) -> float:
        """Stop tritonserver (SIGTERM, bounded; or at once); seconds taken."""
        if self._watch is not None:
            self._watch.close()
        self.state = STOPPED
        return self.server.stop(graceful) if self.server is not None else 0.0

    # ---- recovery ---------------------------------------------------------------------------

    def _recover(self, failure: Failure, stop: threading.Event) -> None:
        """Kill the lost server (ending every open stream), then start a new one within budget."""
        with self._lock:
            started = time.monotonic()
            self.state, self.reason = RECOVERING, failure.message
            self.restarts[failure.kind] = self.restarts.get(failure.kind, 0) + 1
            self._say(f"tokenstream: {failure.message}; restarting tritonserver")
            self._kill()
            while not stop.is_set():
                wait = self._budget_wait()
                if wait is None:
                    return self._give_up(failure)
                if wait:
                    self._say(f"tokenstream: backing off {wait:.0f} s before the restart")
                if stop.wait(wait):
                    return
                try:
                    if self._launch(stop):
                        took = time.monotonic() - started
                        self._say(
                            f"tokenstream: serving again {took:.1f} s after: {failure.message}"
                        )
                    return
                except (ServerDied, TimeoutError) as error:
                    self._say(f"tokenstream: restart failed: {str(error).splitlines()[0]}")
                    self._kill()

    def _budget_wait(self) -> float | None:
        """Record a restart; the backoff before it, None once the budget is spent."""
        now = time.monotonic()
        window = self.config.budget.window_s
        self._restart_times = [t for t in self._restart_times if now - t < window] + [now]
        return self.config.budget.backoff(len(self._restart_times))

    def _give_up(self, failure: Failure) -> None:
        budget = self.config.budget
        self.state = FAILED
        self.reason = (
            f"gave up: {budget.max_restarts} restarts within {budget.window_s:g} s "
            f"did not keep the models serving; last failure: {failure.message}"
        )
        self._say(f"tokenstream: {self.reason}")

    def _kill(self) -> None:
        if self._watch is not None:
            self._watch.close()
        if self.server is not None:
            self.server.stop(graceful=False)

    def _launch(self, stop: threading.Event) -> bool:
        """A new TritonServer on the same ports, waited for; True once ready, False if `stop`
        came first. A start that hangs is killed and tried once more (StartHung the second
        time)."""
        started = time.monotonic()
        for attempt in range(1, HUNG_START_TRIES + 1):
            self.server = TritonServer(self.config.server, on_log=self._server_log)
            self.server.start()
            try:
                if not self.server.wait_ready(abort=stop, on_poll=self._beat):
                    return False
                break
            except StartHung as hung:
                self._say(f"tokenstream: {hung}")
                took = self.server.stop(graceful=False)  # its process group, stubs, shm files
                self._say(f"tokenstream: killed that tritonserver and its stubs in {took:.1f} s")
                if attempt == HUNG_START_TRIES:
                    raise StartHung(
                        f"the start of tritonserver hung {attempt} times in "
                        f"{time.monotonic() - started:.1f} s; not trying again"
                    ) from None
                self.restarts[START_HUNG] = self.restarts.get(START_HUNG, 0) + 1
                self._say("tokenstream: starting tritonserver once more")
        self._watch = Watch(
            self.server, self._controlled_models(), self.admin_key, self.config.canary
        )
        self._watch.start()
        self.state, self.reason = READY, ""
        return True

    def _beat(self) -> None:
        self.heartbeat = time.monotonic()

    def _controlled_models(self) -> list[str]:
        """Models of the repository that take control requests (their config has CONTROL)."""
        repository = self.config.server.repository
        return sorted(
            name
            for name in self._served_models()
            if f'"{CONTROL}"' in _read(repository / name / "config.pbtxt")
        )

    def _served_models(self) -> list[str]:
        """The models the server loads: those named, else every model of the repository."""
        server = self.config.server
        return list(server.models) or [path.name for path in server.repository.iterdir()]

    # ---- reload -----------------------------------------------------------------------------

    def reload(self, model: str | None = None, name: str = CHAT_MODEL) -> float:
        """Load `name` again (with `model` as its weights when given) while the old one serves;
        seconds taken. Raises ControlError when it fails; the old model then keeps serving."""
        with self._lock:
            server = self.server
            if self.state != READY or server is None or server.runtime_repository is None:
                raise ControlError(f"cannot reload while {self.state}: {self.reason}")
            config_path = server.runtime_repository / name / "config.pbtxt"
            if not config_path.is_file():
                raise ControlError(f"no model {name!r} in the repository")
            started = time.monotonic()
            self.state = RELOADING
            if self._watch is not None:
                self._watch.pause()
            try:
                self._swap(server, config_path, name, model)
            except ControlError:
                self.reloads["failed"] += 1
                raise
            finally:
                self.state = READY if self.state == RELOADING else self.state
                if self._watch is not None:
                    self._watch.resume()
            self.reloads["ok"] += 1
            return time.monotonic() - started

    def _swap(self, server: TritonServer, config_path: Path, name: str, model: str | None) -> None:
        """Rewrite the runtime config.pbtxt and load; on failure restore it."""
        old_text = config_path.read_text()
        new_text = patch_parameters(old_text, {"model": model}) if model else old_text
        # a fresh write changes the file's time, which is how Triton tells that it must reload
        config_path.write_text(new_text.rstrip("\n") + f"\n# reloaded at {time.time():.3f}\n")
        # what the runtime config named so far (empty: the bundled default model)
        served = read_parameters(old_text).get("model") or "the default"
        change = f": model {served} -> {model}" if model else ""
        self._say(f"tokenstream: reloading {name}{change}")
        try:
            load_model(server.http_url, name, self.admin_key, RELOAD_TIMEOUT_S)
        except ControlError as error:
            config_path.write_text(old_text)
            serving = model_ready(server.http_url, name)
            note = "the old model keeps serving" if serving else "the model is not ready"
            self._say(f"tokenstream: reload of {name} failed ({note}): {error}")
            raise ControlError(f"reload failed ({note}): {error}") from None
        if model:
            parameters = {**self.config.server.model_parameters, "model": model}
            server_config = dataclasses.replace(self.config.server, model_parameters=parameters)
            self.config = dataclasses.replace(self.config, server=server_config)
        self._say(f"tokenstream: reloaded {name}")

    # ---- drain ------------------------------------------------------------------------------

    def _drain(self, force: threading.Event) -> float:
        started = time.monotonic()
        server = self.server
        if self._watch is not None:
            self._watch.close()
        if server is None or server.returncode is not None or self.state == FAILED:
            self.state = DRAINING
            return 0.0
        self.state, self.reason = DRAINING, "shutting down"
        models = self._controlled_models()
        deadline = started + self.config.drain_timeout_s
        open_streams = self._tell(server, models, CONTROL_DRAIN)
        self._say(
            f"tokenstream: draining: new requests are refused; {open_streams} open streams "
            f"get up to {self.config.drain_timeout_s:g} s to finish"
        )
        left = self._wait_drained(server, models, deadline, force)
        if left != 0:  # None: a model did not answer in time, so streams may still be open
            count = "the" if left is None else str(left)
            self._say(f"tokenstream: drain deadline: ending {count} open streams")
            self._tell(server, models, CONTROL_END)
            self._wait_drained(server, models, time.monotonic() + END_WAIT_S, force)
        took = time.monotonic() - started
        self._say(f"tokenstream: drained in {took:.1f} s")
        return took

    def _tell(self, server: TritonServer, models: list[str], action: str) -> int:
        """Send `action` to every controlled model; the open streams they report."""
        total = 0
        for model in models:
            try:
                health = control(server.http_url, model, self.admin_key, action, CONTROL_TIMEOUT_S)
                total += health.active
            except ControlError as error:
                self._say(f"tokenstream: {model} did not take {action!r}: {error}")
        return total

    def _wait_drained(
        self, server: TritonServer, models: list[str], deadline: float, force: threading.Event
    ) -> int | None:
        """Poll until no model has open streams, the deadline or `force`; streams still open
        (None: unknown, a model did not answer the last poll in time)."""
        while True:
            self.heartbeat = time.monotonic()
            left = self._open_streams(server, models)
            if left == 0 or time.monotonic() >= deadline or force.wait(DRAIN_POLL_S):
                return left

    def _open_streams(self, server: TritonServer, models: list[str]) -> int | None:
        """Open streams over every controlled model. None when one gave no answer in time
        while tritonserver runs (a busy machine: its streams may still be open, so the drain
        goes on); 0 when one answered with an error or the server is gone (nothing can finish)."""
        total = 0
        for model in models:
            try:
                health = control(
                    server.http_url, model, self.admin_key, CONTROL_HEALTH, CONTROL_TIMEOUT_S
                )
            except ControlError as error:
                if error.unreachable and server.returncode is None:
                    return None
                return 0  # the model cannot answer: nothing more to wait for
            total += health.active
        return total


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
