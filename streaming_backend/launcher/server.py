"""One tritonserver process on a runtime copy of a model repository, with a bounded stop().

Shutdown is owned here because a python-backend server can hang for its whole exit timeout and
leave its `triton_python_backend_stub` children and a /dev/shm region behind: stop() ends with
SIGKILL for the server's process group and every recorded descendant, deletes the shared-memory
files of its own unique prefix, and returns within 15 seconds. A start that cannot finish (every
model's initialize returned, the models still not ready: startup.py) raises StartHung from
wait_ready() within ServerConfig.hung_start_s.
"""

from __future__ import annotations

import collections
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from streaming_backend.configuration import endpoints
from streaming_backend.launcher.batching import DialogueBatching
from streaming_backend.launcher.binary import TritonBinary, find_tritonserver
from streaming_backend.launcher.processes import (
    descendants,
    is_alive,
    kill_processes,
    parent_death_prefix,
    remove_shm,
    wait_gone,
)
from streaming_backend.launcher.repository import make_runtime_repository
from streaming_backend.launcher.startup import Hang, StartWatch, load_failure
from streaming_backend.paths import default_repository
from streaming_backend.wire import ADMIN_HEADER, ADMIN_KEY_VARIABLE

ERROR_TAIL_LINES = 40  # the log lines a ServerDied quotes
MAX_EXIT_TIMEOUT_S = 10.0  # stop() adds at most ~4 s to this; the whole stop stays under 15 s
READY_POLL_S = 0.2
# Triton closes each client connection after this long (gRPC GOAWAY, jittered +-10 %; open
# streams finish on the old connection), so clients re-resolve a name and find new replicas.
GRPC_MAX_CONNECTION_AGE_S = 60.0


@dataclass(frozen=True)
class ServerConfig:
    """Everything needed to start one tritonserver on a model repository."""

    repository: Path = field(default_factory=default_repository)
    # config.pbtxt `parameters` set on the models (each on the models that take it: see
    # launcher/repository.py); what is not set keeps the repository's value
    model_parameters: Mapping[str, str] = field(default_factory=dict)
    models: tuple[str, ...] = ()  # models to load (explicit model control); (): every model
    dialogue: DialogueBatching = field(default_factory=DialogueBatching)
    host: str = endpoints.HOST
    http_port: int = endpoints.HTTP_PORT
    grpc_port: int = endpoints.GRPC_PORT
    metrics_port: int = endpoints.METRICS_PORT
    log_level: int = 0  # tritonserver --log-verbose
    grpc_max_connection_age_s: float | None = GRPC_MAX_CONNECTION_AGE_S  # None: no maximum
    exit_timeout_s: float = 5.0
    startup_timeout_s: float = 300.0
    # once every model's initialize returned (startup.py), the most the models may take to turn
    # ready before the start counts as hung (measured: well under a second when it is not)
    hung_start_s: float = 20.0
    tritonserver: Path | None = None  # explicit binary; None: find_tritonserver()
    # explicit model control: every model is loaded at start, and the supervisor (or an
    # operator holding the admin key) loads and unloads them through the repository API
    explicit_model_control: bool = False
    # Restricts Triton's model-repository API to requests carrying the header ADMIN_HEADER with
    # this value, and reaches the models as the environment variable ADMIN_KEY_VARIABLE (the
    # chat model accepts control requests only with it). None: repository API open, no control.
    admin_key: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.exit_timeout_s <= MAX_EXIT_TIMEOUT_S:
            raise ValueError(f"exit_timeout_s must be within 0..{MAX_EXIT_TIMEOUT_S:g} s")
        if self.startup_timeout_s <= 0 or self.hung_start_s <= 0:
            raise ValueError("startup_timeout_s and hung_start_s must be positive")
        if self.grpc_max_connection_age_s is not None and self.grpc_max_connection_age_s <= 0:
            raise ValueError("grpc_max_connection_age_s must be positive (None: no maximum)")

    def parameters(self) -> dict[str, str]:
        """The config.pbtxt `parameters` this config sets on the models."""
        return {key: str(value) for key, value in self.model_parameters.items()}

    @property
    def model(self) -> str:
        """The model it serves as --model gave it; empty: the repository's."""
        return self.model_parameters.get("model", "")


def model_control(models: tuple[str, ...]) -> list[str]:
    """Load only `models` (explicit model control); every model of the repository when empty."""
    if not models:
        return []
    return ["--model-control-mode=explicit"] + [f"--load-model={name}" for name in models]


def client_host(host: str) -> str:
    """The address a local client connects to for a server bound to `host`."""
    if host in ("", "0.0.0.0", "localhost"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _connection_age_flags(age_s: float | None) -> list[str]:
    """tritonserver's max connection age in ms; no grace flag, so open streams are never cut."""
    return [] if age_s is None else [f"--grpc-max-connection-age={round(age_s * 1000)}"]


class ServerDied(RuntimeError):
    """tritonserver exited while we waited for it; the message holds its last log lines."""


class StartHung(TimeoutError):
    """tritonserver will not finish its start (startup.py); the message says why, as far as it can
    be told, and holds its last log lines."""


class TritonServer:
    """One tritonserver process on a runtime copy of a repository, with a bounded stop()."""

    def __init__(
        self,
        config: ServerConfig | None = None,
        on_log: Callable[[str], None] | None = lambda line: print(line, flush=True),
    ) -> None:
        """`on_log` gets each server log line (default: our stdout); None keeps only the tail."""
        self.config = config or ServerConfig()
        self.shm_prefix = f"tokenstream_{os.getpid()}_{secrets.token_hex(4)}"
        self._on_log = on_log
        self._tail: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._runtime_repository: Path | None = None
        self._stopped = False
        self.killed: list[int] = []  # pids stop() had to SIGKILL: a hung server or its stubs
        self.started_at: float | None = None  # time.monotonic() at start()
        self.start_watch: StartWatch | None = None  # fed by the log reader from start()

    # ----- addresses and state

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP/REST endpoint, e.g. http://127.0.0.1:8000."""
        return f"http://{client_host(self.config.host)}:{self.config.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:port of the gRPC endpoint, as tritonclient.grpc expects it."""
        return f"{client_host(self.config.host)}:{self.config.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """URL of the Prometheus metrics page."""
        return f"http://{client_host(self.config.host)}:{self.config.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        """Process id of tritonserver, None before start()."""
        return self._process.pid if self._process else None

    @property
    def returncode(self) -> int | None:
        """Exit status of tritonserver, None while it runs (or before start())."""
        return self._process.poll() if self._process else None

    @property
    def runtime_repository(self) -> Path | None:
        """The patched temp copy of the repository the server runs on."""
        return self._runtime_repository

    def since_start(self) -> float:
        """Seconds since start(); 0 before it."""
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at

    def loaded_models(self) -> list[str]:
        """The models tritonserver loads at start: the config's, else every model of the
        repository (after start(): of its runtime copy)."""
        if self.config.models:
            return list(self.config.models)
        root = self._runtime_repository or self.config.repository
        return sorted(p.name for p in root.iterdir() if (p / "config.pbtxt").is_file())

    # ----- lifecycle

    def start(self) -> TritonServer:
        """Launch tritonserver in its own session; returns at once (see wait_ready)."""
        if self._process is not None or self._stopped:
            raise RuntimeError("a TritonServer starts once; make a new one")
        binary = find_tritonserver(self.config.tritonserver)
        self._runtime_repository = make_runtime_repository(
            self.config.repository, self.config.parameters(), self.config.dialogue.rewrites()
        )
        self.start_watch = StartWatch(self.loaded_models(), self.config.hung_start_s)
        self.started_at = time.monotonic()
        try:
            # a new session: Ctrl-C in a terminal does not reach the server behind our back, and
            # its stub children share one process group that stop() can kill as a whole
            self._process = subprocess.Popen(
                self.command(binary),
                env=self.environment(binary),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                encoding="utf-8",
                errors="replace",
                start_new_session=True,
            )
        except BaseException:
            self._remove_runtime_repository()
            raise
        self._reader = threading.Thread(target=self._read_log, name="tritonserver-log", daemon=True)
        self._reader.start()
        return self

    def command(self, binary: TritonBinary) -> list[str]:
        """The tritonserver command line for this config."""
        c = self.config
        command = parent_death_prefix() + [
            str(binary.binary),
            f"--model-repository={self._runtime_repository}",
            f"--backend-directory={binary.backend_dir}",
            f"--http-address={c.host}",
            f"--grpc-address={c.host}",
            f"--metrics-address={c.host}",
            f"--http-port={c.http_port}",
            f"--grpc-port={c.grpc_port}",
            f"--metrics-port={c.metrics_port}",
            f"--exit-timeout-secs={math.ceil(c.exit_timeout_s)}",
            f"--log-verbose={c.log_level}",
            # our configs are complete: without this the python backend starts a throwaway stub
            # per model just to ask it for a config (about 3 s of imports before every load)
            "--disable-auto-complete-config",
            *_connection_age_flags(c.grpc_max_connection_age_s),
            # our own shm name prefix, so stop() deletes exactly this server's regions
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        return command + self._control_options()

    def _control_options(self) -> list[str]:
        """Explicit model control (chosen models, or all of them) and the restricted repository
        API, as configured."""
        c = self.config
        options = model_control(c.models)
        if c.explicit_model_control and not options:
            options = ["--model-control-mode=explicit", "--load-model=*"]
        if c.admin_key is not None:
            restriction = f"model-repository:{ADMIN_HEADER}={c.admin_key}"
            options += [
                f"--http-restricted-api={restriction}",
                f"--grpc-restricted-protocol={restriction}",
            ]
        return options

    def environment(self, binary: TritonBinary) -> dict[str, str]:
        """The server process's environment: ours, the binary's, and the admin key if any."""
        env = {**os.environ, **binary.env}
        if self.config.admin_key is not None:
            env[ADMIN_KEY_VARIABLE] = self.config.admin_key
        return env

    def wait_ready(
        self,
        timeout: float | None = None,
        abort: threading.Event | None = None,
        on_poll: Callable[[], None] | None = None,
    ) -> bool:
        """Poll /v2/health/ready, then the metrics port: True when both answer, False if `abort`
        was set first. Triton starts its metrics service after HTTP (tens of ms, more on a busy
        machine), so a ready HTTP endpoint alone does not mean /metrics can be read yet.
        `on_poll` is called at each poll (the supervisor's heartbeat).

        Raises ServerDied if the process exits, StartHung once the start cannot finish
        (startup.py) and TimeoutError after `timeout` seconds (default: the startup timeout);
        each message says how long it waited since start().
        """
        if self._process is None:
            raise RuntimeError("start() the server first")
        timeout = self.config.startup_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        abort = abort or threading.Event()
        while not abort.is_set():
            if on_poll is not None:
                on_poll()
            if self._process.poll() is not None:
                raise self._died("before it was ready")
            if self.is_ready() and self.metrics_listening():
                return True
            watch = self.start_watch
            hang = watch.check(self._process.pid, time.monotonic()) if watch else None
            if hang is not None:
                raise self._hung(hang)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"tritonserver not ready {self.since_start():.1f} s after it started (the "
                    f"limit: {timeout:g} s). Last log:\n{self._tail_text()}"
                )
            abort.wait(READY_POLL_S)
        return False

    def is_ready(self) -> bool:
        """One GET /v2/health/ready: True on 200."""
        # no proxies: a proxy from the environment must not answer for our loopback server
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False  # not listening yet, or 400 while models load

    def metrics_listening(self) -> bool:
        """Whether the metrics port accepts a connection."""
        address = (client_host(self.config.host), self.config.metrics_port)
        try:
            socket.create_connection(address, timeout=2).close()
        except OSError:
            return False
        return True

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for tritonserver to exit; its exit status, or None on timeout."""
        if self._process is None:
            raise RuntimeError("start() the server first")
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, graceful: bool = True) -> float:
        """Stop the server, its stubs, its shm files and its repository copy; seconds taken.

        SIGTERM, up to exit_timeout_s + 1 s for a clean exit, then SIGKILL the process group and
        every recorded descendant. Idempotent; bounded to about exit_timeout_s + 4 s.
        `graceful=False` skips the SIGTERM: everything is killed at once (a dead model process,
        a second signal), and clients' open streams end right away with UNAVAILABLE.
        """
        if self._stopped:
            return 0.0
        self._stopped = True
        started = time.monotonic()
        try:
            if self._process is not None:
                self._terminate(self._process, graceful)
        finally:
            remove_shm(self.shm_prefix)
            self._remove_runtime_repository()
        return time.monotonic() - started

    @property
    def exited_cleanly(self) -> bool:
        """After stop(): tritonserver exited by itself with status 0 (no abort, no kill)."""
        return self._stopped and self.returncode == 0 and not self.killed

    def _terminate(self, process: subprocess.Popen[str], graceful: bool = True) -> None:
        """SIGTERM, bounded wait, SIGKILL what is left, reap."""
        # record the tree now: once the server dies its children are reparented and lost to us
        family = descendants(process.pid)
        if graceful and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(self.config.exit_timeout_s + 1.0)
            except subprocess.TimeoutExpired:
                family |= descendants(process.pid)
        self.killed = [pid for pid, start in family.items() if is_alive(pid, start)]
        if process.poll() is None:
            self.killed.insert(0, process.pid)
        try:
            # the group outlives its leader, and Linux never reuses the id while it exists
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the whole group is gone already
        kill_processes(family)
        process.wait()
        wait_gone(family, timeout=2.0)
        if self._reader is not None:
            self._reader.join(timeout=1.0)
        if process.stdout is not None:
            process.stdout.close()

    def _read_log(self) -> None:
        """Keep the log tail and forward lines to on_log (runs in the reader thread)."""
        assert self._process is not None and self._process.stdout is not None
        forward = self._on_log
        watch = self.start_watch
        for raw in self._process.stdout:
            line = raw.rstrip("\n")
            self._tail.append(line)
            if watch is not None:
                watch.feed(line, time.monotonic())
            if forward is None:
                continue
            try:
                forward(line)
            except Exception as error:  # e.g. a closed stdout: keep draining, or Triton blocks
                print(f"tokenstream: no longer forwarding Triton's log: {error}", file=sys.stderr)
                forward = None

    def _died(self, when: str) -> ServerDied:
        """A ServerDied for an exit `when`, after the reader has caught up with the log."""
        if self._reader is not None:
            self._reader.join(timeout=2.0)  # stub children may hold the pipe open: bounded
        code = self.returncode
        failed = load_failure(self._tail)
        cause = f": a model failed to load ({failed})" if failed else ""
        return ServerDied(
            f"tritonserver exited {when}, {self.since_start():.1f} s after it started (status "
            f"{code}){cause}. Last log:\n{self._tail_text()}"
        )

    def _hung(self, hang: Hang) -> StartHung:
        """The StartHung of `hang`, with the real time waited and the log's tail."""
        cause = f" Cause: {hang.cause}." if hang.cause else " What holds it is not known."
        return StartHung(
            f"tritonserver did not report the models ready {hang.overdue_s:.1f} s after "
            f"{hang.after}, {self.since_start():.1f} s after it started: its start hangs.{cause}"
            f" Last log:\n{self._tail_text()}"
        )

    def _tail_text(self) -> str:
        return "\n".join(self._tail)

    def _remove_runtime_repository(self) -> None:
        if self._runtime_repository is not None:
            shutil.rmtree(self._runtime_repository, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
