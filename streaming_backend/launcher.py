"""Start a real tritonserver on a model repository, and stop it without leaving anything behind.

`tokenstream serve` lives here too: start Triton, wait for readiness, print the endpoints, run the
websocket bridge in the same process when it is available, and stop everything on SIGINT/SIGTERM.

Shutdown is owned here because a python-backend server can hang for its whole exit timeout and
leave its `triton_python_backend_stub` children and a /dev/shm region behind (see
shared/triton-on-cpu.md). Only processes we started, and their descendants, are ever signalled.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from streaming_backend import serve_models

CHECKOUT_REPOSITORY = Path(__file__).resolve().parent.parent / "repository"  # a source checkout
REPOSITORY_VARIABLE = "TOKENSTREAM_REPOSITORY"  # where an installed (non-editable) copy looks
NGC_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")
SHM_DIR = Path("/dev/shm")
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
LOG_TAIL_LINES = 200
ERROR_TAIL_LINES = 40
MAX_EXIT_TIMEOUT_S = 10.0  # stop() adds at most ~4 s to this; the whole stop stays under 15 s
READY_POLL_S = 0.2


# --------------------------------------------------------------------------- configuration


def default_repository() -> Path:
    """$TOKENSTREAM_REPOSITORY if set, else the checkout's repository/ folder."""
    return Path(os.environ.get(REPOSITORY_VARIABLE) or CHECKOUT_REPOSITORY)


@dataclass(frozen=True)
class ServerConfig:
    """Everything needed to start one tritonserver on a model repository."""

    repository: Path = field(default_factory=default_repository)
    model: str | None = None  # HF directory, GGUF file or hub id; None: the model's default
    dtype: str = "auto"
    max_streams: int | None = None
    queue_limit: int | None = None
    model_parameters: Mapping[str, str] = field(default_factory=dict)  # extra config.pbtxt keys
    models: tuple[str, ...] = ()  # models to load (explicit model control); (): every model
    dialogue: serve_models.DialogueBatching = field(default_factory=serve_models.DialogueBatching)
    host: str = "127.0.0.1"
    http_port: int = DEFAULT_PORTS["http"]
    grpc_port: int = DEFAULT_PORTS["grpc"]
    metrics_port: int = DEFAULT_PORTS["metrics"]
    log_level: int = 0  # tritonserver --log-verbose
    exit_timeout_s: float = 5.0
    startup_timeout_s: float = 300.0
    tritonserver: Path | None = None  # explicit binary; None: find_tritonserver()

    def __post_init__(self) -> None:
        if not 0 <= self.exit_timeout_s <= MAX_EXIT_TIMEOUT_S:
            raise ValueError(f"exit_timeout_s must be within 0..{MAX_EXIT_TIMEOUT_S:g} s")
        if self.startup_timeout_s <= 0:
            raise ValueError("startup_timeout_s must be positive")

    def parameters(self) -> dict[str, str]:
        """The config.pbtxt `parameters` this config sets on the models."""
        settings = {"model": self.model, "dtype": self.dtype}
        settings |= {"max_streams": self.max_streams, "queue_limit": self.queue_limit}
        chosen = {key: str(value) for key, value in settings.items() if value is not None}
        return chosen | {key: str(value) for key, value in self.model_parameters.items()}


# --------------------------------------------------------------------------- the binary


@dataclass(frozen=True)
class TritonBinary:
    """A tritonserver executable, its backend folder and the environment it needs."""

    binary: Path
    backend_dir: Path
    env: Mapping[str, str]  # set on top of os.environ for the server process


def find_tritonserver(explicit: Path | None = None) -> TritonBinary:
    """Locate tritonserver: explicit path, PATH, the NGC image, else the nvidia-pytriton wheel."""
    on_path = shutil.which("tritonserver")
    for candidate in (explicit, Path(on_path) if on_path else None, NGC_TRITONSERVER):
        if candidate is not None and candidate.is_file():
            # installed layout: <root>/bin/tritonserver beside <root>/backends
            return TritonBinary(candidate, candidate.parent.parent / "backends", _python_env())
    if explicit is not None:
        raise FileNotFoundError(f"no tritonserver at {explicit}")
    return _wheel_tritonserver()


def _python_env() -> dict[str, str]:
    """PATH and PYTHONPATH so the backend stub imports this virtual environment's packages."""
    if sys.prefix == sys.base_prefix:
        return {}  # a system interpreter: the stub already sees its site-packages
    paths = sysconfig.get_paths()
    site = list(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    return {
        "PATH": _join_paths([str(Path(sys.prefix) / "bin")], "PATH"),
        "PYTHONPATH": _join_paths(site, "PYTHONPATH"),
    }


def _join_paths(first: list[str], variable: str) -> str:
    """`first` followed by the current value of an os.pathsep-separated variable."""
    current = os.environ.get(variable)
    return os.pathsep.join(first + ([current] if current else []))


def _wheel_tritonserver() -> TritonBinary:
    """The tritonserver of the nvidia-pytriton wheel, prepared once in our cache folder."""
    spec = importlib.util.find_spec("pytriton")  # finds the folder without importing pytriton
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "tritonserver not found: put it on PATH, use the NGC image, or install the wheel "
            "(pip install 'tokenstream[server]', i.e. nvidia-pytriton)"
        )
    source = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    version = importlib.metadata.version("nvidia-pytriton")
    target = _cache_dir() / f"tritonserver-{version}-py{python}"
    if not (target / "backends" / "python" / "triton_python_backend_stub").is_file():
        _copy_wheel_server(source, target, python)
    libs = [sysconfig.get_config_var("LIBDIR"), str(source.parent.parent / "nvidia_pytriton.libs")]
    env = _python_env() | {"LD_LIBRARY_PATH": _join_paths(libs, "LD_LIBRARY_PATH")}
    return TritonBinary(target / "bin" / "tritonserver", target / "backends", env)


def _cache_dir() -> Path:
    """~/.cache/tokenstream (or under $XDG_CACHE_HOME)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "tokenstream"


def _copy_wheel_server(source: Path, target: Path, python: str) -> None:
    """Copy the wheel's server tree with our Python's stub; atomic, so racing copies are safe."""
    stub = source / "python_backend_stubs" / python / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(f"nvidia-pytriton has no python backend stub for Python {python}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-", dir=target.parent))
    try:
        tree = staging / "tree"
        skip_stubs = shutil.ignore_patterns("python_backend_stubs")
        shutil.copytree(source, tree, symlinks=True, ignore=skip_stubs)
        shutil.copy2(stub, tree / "backends" / "python" / stub.name)
        if target.exists():  # a half-made copy from an older layout: replace it
            shutil.rmtree(target)
        try:
            os.rename(tree, target)
        except OSError:
            if not (target / "bin" / "tritonserver").is_file():
                raise  # not a concurrent copy that won the race: a real failure
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------- the repository

_COMMENT = re.compile(r'"(?:[^"\\\n]|\\.)*"|#[^\n]*')


def _mask_comments(text: str) -> str:
    """`text` with every # comment blanked out, same length, so offsets stay valid."""
    return _COMMENT.sub(lambda m: m.group() if m.group()[0] == '"' else " " * len(m.group()), text)


def _pbtxt_string(value: str) -> str:
    """A protobuf text-format string literal."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def patch_parameters(config_text: str, mapping: Mapping[str, str]) -> str:
    """Set string `parameters` entries of a config.pbtxt: replace a key's value or append it."""
    for key, value in mapping.items():
        pattern = re.compile(
            r"(key\s*:\s*" + re.escape(_pbtxt_string(key)) + r"\s*,?\s*"
            r"value\s*:\s*\{\s*string_value\s*:\s*)" + r'"(?:[^"\\\n]|\\.)*"'
        )
        # match on a comment-free copy so a commented-out example is never taken for the entry
        matches = list(pattern.finditer(_mask_comments(config_text)))
        for match in reversed(matches):
            start = match.start() + len(match.group(1))
            config_text = config_text[:start] + _pbtxt_string(value) + config_text[match.end() :]
        if not matches:
            entry = f"parameters {{ key: {_pbtxt_string(key)} "
            entry += f"value: {{ string_value: {_pbtxt_string(value)} }} }}\n"
            config_text = config_text.rstrip("\n") + "\n" + entry
    return config_text


def make_runtime_repository(
    source: Path,
    parameters: Mapping[str, str],
    rewrites: Mapping[str, Callable[[str], str]] | None = None,
) -> Path:
    """A temp copy of a model repository with `parameters` set in every model's config.pbtxt
    (and `rewrites[model]` applied to that model's)."""
    if not source.is_dir():
        raise FileNotFoundError(f"model repository {source} does not exist")
    runtime = Path(tempfile.mkdtemp(prefix="tokenstream-repo-"))
    try:
        for model_dir in sorted(source.iterdir()):
            if model_dir.is_dir() and not model_dir.name.startswith("."):
                rewrite = (rewrites or {}).get(model_dir.name, lambda text: text)
                _copy_model(model_dir, runtime / model_dir.name, parameters, rewrite)
    except BaseException:
        shutil.rmtree(runtime, ignore_errors=True)
        raise
    return runtime


def _copy_model(
    source: Path, target: Path, parameters: Mapping[str, str], rewrite: Callable[[str], str]
) -> None:
    """Patch config.pbtxt into `target`; link everything else (version folders, files)."""
    target.mkdir()
    for entry in source.iterdir():
        if entry.name == "config.pbtxt":
            text = rewrite(patch_parameters(entry.read_text(), parameters))
            (target / entry.name).write_text(text)
        else:
            (target / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())


# --------------------------------------------------------------------------- processes


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the command name may hold spaces and ")"
    return fields[0], int(fields[1]), int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """Every live descendant of `pid`: pid -> start time, so a reused pid is never taken for one."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    starts: dict[int, int] = {}
    for name in os.listdir("/proc"):
        stat = _stat(int(name)) if name.isdigit() else None
        if stat is not None and stat[0] != "Z":
            children[stat[1]].append(int(name))
            starts[int(name)] = stat[2]
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child in children.pop(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def is_alive(pid: int, start_time: int) -> bool:
    """Whether that very process (same pid and start time) still runs; zombies count as gone."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == start_time


def _kill_processes(processes: Mapping[int, int]) -> None:
    """SIGKILL each process that is still the one we recorded."""
    for pid, start_time in processes.items():
        if is_alive(pid, start_time):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # exited between the check and the kill


def _wait_gone(processes: Mapping[int, int], timeout: float) -> None:
    """Wait until none of `processes` runs any more, or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while any(is_alive(p, t) for p, t in processes.items()) and time.monotonic() < deadline:
        time.sleep(0.05)


def remove_shm(prefix: str) -> list[Path]:
    """Delete /dev/shm files whose name starts with `prefix`; returns what was removed."""
    removed = sorted(SHM_DIR.glob(f"{glob_escape(prefix)}*"))
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def glob_escape(text: str) -> str:
    """`text` with glob metacharacters escaped."""
    return re.sub(r"([*?\[])", r"[\1]", text)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _client_host(host: str) -> str:
    """The address a local client connects to for a server bound to `host`."""
    if host in ("", "0.0.0.0", "localhost"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _parent_death_prefix() -> list[str]:
    """`setpriv --pdeathsig KILL --` when usable: tritonserver dies with us even on our SIGKILL."""
    # the signal follows the thread that forked, not the process: only the main thread qualifies
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return []
    return [setpriv, "--pdeathsig", "KILL", "--"]


# --------------------------------------------------------------------------- the server


class ServerDied(RuntimeError):
    """tritonserver exited while we waited for it; the message holds its last log lines."""


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
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._runtime_repository: Path | None = None
        self._stopped = False
        self.killed: list[int] = []  # pids stop() had to SIGKILL: a hung server or its stubs

    # ----- addresses and state

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP/REST endpoint, e.g. http://127.0.0.1:8000."""
        return f"http://{_client_host(self.config.host)}:{self.config.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:port of the gRPC endpoint, as tritonclient.grpc expects it."""
        return f"{_client_host(self.config.host)}:{self.config.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """URL of the Prometheus metrics page."""
        return f"http://{_client_host(self.config.host)}:{self.config.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        """Process id of tritonserver, None before start()."""
        return self._process.pid if self._process else None

    @property
    def returncode(self) -> int | None:
        """Exit status of tritonserver, None while it runs (or before start())."""
        return self._process.poll() if self._process else None

    @property
    def log_lines(self) -> list[str]:
        """The last log lines of the server (at most LOG_TAIL_LINES)."""
        return list(self._tail)

    @property
    def runtime_repository(self) -> Path | None:
        """The patched temp copy of the repository the server runs on."""
        return self._runtime_repository

    # ----- lifecycle

    def start(self) -> TritonServer:
        """Launch tritonserver in its own session; returns at once (see wait_ready)."""
        if self._process is not None or self._stopped:
            raise RuntimeError("a TritonServer starts once; make a new one")
        binary = find_tritonserver(self.config.tritonserver)
        self._runtime_repository = make_runtime_repository(
            self.config.repository, self.config.parameters(), self.config.dialogue.rewrites()
        )
        try:
            # a new session: Ctrl-C in a terminal does not reach the server behind our back, and
            # its stub children share one process group that stop() can kill as a whole
            self._process = subprocess.Popen(
                self.command(binary),
                env={**os.environ, **binary.env},
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
        command = _parent_death_prefix() + [
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
            # our own shm name prefix, so stop() deletes exactly this server's regions
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        return command + _model_control(c.models)

    def wait_ready(
        self, timeout: float | None = None, abort: threading.Event | None = None
    ) -> bool:
        """Poll /v2/health/ready: True when ready, False if `abort` was set first.

        Raises ServerDied if the process exits and TimeoutError after `timeout` seconds.
        """
        if self._process is None:
            raise RuntimeError("start() the server first")
        timeout = self.config.startup_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        abort = abort or threading.Event()
        while not abort.is_set():
            if self._process.poll() is not None:
                raise self._died("before it was ready")
            if self.is_ready():
                return True
            if time.monotonic() >= deadline:
                tail = self._tail_text()
                raise TimeoutError(f"tritonserver not ready after {timeout:g} s. Last log:\n{tail}")
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

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for tritonserver to exit; its exit status, or None on timeout."""
        if self._process is None:
            raise RuntimeError("start() the server first")
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def died_error(self) -> ServerDied:
        """A ServerDied describing the exit, with the last log lines."""
        return self._died("unexpectedly")

    def stop(self) -> float:
        """Stop the server, its stubs, its shm files and its repository copy; seconds taken.

        SIGTERM, up to exit_timeout_s + 1 s for a clean exit, then SIGKILL the process group and
        every recorded descendant. Idempotent; bounded to about exit_timeout_s + 4 s.
        """
        if self._stopped:
            return 0.0
        self._stopped = True
        started = time.monotonic()
        try:
            if self._process is not None:
                self._terminate(self._process)
        finally:
            remove_shm(self.shm_prefix)
            self._remove_runtime_repository()
        return time.monotonic() - started

    def _terminate(self, process: subprocess.Popen[str]) -> None:
        """SIGTERM, bounded wait, SIGKILL what is left, reap."""
        # record the tree now: once the server dies its children are reparented and lost to us
        family = descendants(process.pid)
        if process.poll() is None:
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
        _kill_processes(family)
        process.wait()
        _wait_gone(family, timeout=2.0)
        if self._reader is not None:
            self._reader.join(timeout=1.0)
        if process.stdout is not None:
            process.stdout.close()

    def _read_log(self) -> None:
        """Keep the log tail and forward lines to on_log (runs in the reader thread)."""
        assert self._process is not None and self._process.stdout is not None
        forward = self._on_log
        for raw in self._process.stdout:
            line = raw.rstrip("\n")
            self._tail.append(line)
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
        return ServerDied(
            f"tritonserver exited {when} (status {code}). Last log:\n{self._tail_text()}"
        )

    def _tail_text(self) -> str:
        return "\n".join(list(self._tail)[-ERROR_TAIL_LINES:])

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


def _model_control(models: tuple[str, ...]) -> list[str]:
    """Load only `models` (explicit model control); every model when empty."""
    if not models:
        return []
    return ["--model-control-mode=explicit"] + [f"--load-model={name}" for name in models]


# --------------------------------------------------------------------------- tokenstream serve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tokenstream serve`."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    for name, port in DEFAULT_PORTS.items():
        parser.add_argument(f"--{name}-port", type=int, default=0, help=f"0: {port}")
    parser.add_argument("--model", help="HF model dir, GGUF file or hub id (default SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--max-streams", type=int, help="streams decoded together")
    parser.add_argument("--queue-limit", type=int, help="waiting requests before refusing")
    parser.add_argument("--log-level", type=int, default=0, help="tritonserver --log-verbose")
    parser.add_argument(
        "--parameter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config.pbtxt parameter for the models (repeatable)",
    )
    parser.add_argument("--bridge-port", type=int, default=8080, help="0 disables the bridge")
    parser.add_argument("--no-bridge", action="store_true", help="do not run the bridge")
    parser.add_argument("--repository", type=Path, default=None, help=argparse.SUPPRESS)
    serve_models.add_arguments(parser)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig for parsed `tokenstream serve` options."""
    extra = dict(_key_value(item) for item in args.parameter)
    return ServerConfig(
        repository=args.repository or default_repository(),
        model=args.model,
        dtype=args.dtype,
        max_streams=args.max_streams,
        queue_limit=args.queue_limit,
        model_parameters=extra,
        models=serve_models.models_from_args(args),
        dialogue=serve_models.batching_from_args(args),
        host=args.host,
        http_port=args.http_port or DEFAULT_PORTS["http"],
        grpc_port=args.grpc_port or DEFAULT_PORTS["grpc"],
        metrics_port=args.metrics_port or DEFAULT_PORTS["metrics"],
        log_level=args.log_level,
    )


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--parameter expects KEY=VALUE, got {item!r}")
    return key, value


def main(args: argparse.Namespace) -> int:
    """Run `tokenstream serve` until SIGINT/SIGTERM; non-zero if the server dies."""
    config = config_from_args(args)
    bridge_port = 0 if args.no_bridge else args.bridge_port
    stop = threading.Event()
    restore = _handle_signals(stop)
    server = TritonServer(config)
    try:
        return _serve(server, bridge_port, stop)
    finally:
        seconds = server.stop()
        print(f"tokenstream: stopped in {seconds:.1f} s", flush=True)
        restore()


def _handle_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGINT/SIGTERM set `stop`; returns a function restoring the previous handlers."""

    def on_signal(signum: int, frame: object) -> None:
        # set from another thread: Event.set() here could deadlock on the lock wait() holds
        threading.Thread(target=stop.set, daemon=True).start()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _serve(server: TritonServer, bridge_port: int, stop: threading.Event) -> int:
    """Start, wait for readiness, serve until `stop`; the exit status."""
    print(f"tokenstream: starting tritonserver on {server.config.repository}", flush=True)
    server.start()
    try:
        if not server.wait_ready(abort=stop):
            return 0  # interrupted while the models loaded
    except (ServerDied, TimeoutError) as error:
        print(f"tokenstream: {error}", file=sys.stderr, flush=True)
        return 1
    died = threading.Event()
    threading.Thread(target=_watch, args=(server, died, stop), daemon=True).start()
    bridge = _load_bridge() if bridge_port else None
    _print_endpoints(server, bridge_port if bridge else 0)
    if bridge is not None:
        if _run_bridge(bridge, server, bridge_port, stop):
            return 1
        if not stop.is_set():
            print("tokenstream: the bridge ended; Triton keeps serving", flush=True)
    stop.wait()
    if died.is_set():
        print(f"tokenstream: {server.died_error()}", file=sys.stderr, flush=True)
        return 1
    return 0


def _watch(server: TritonServer, died: threading.Event, stop: threading.Event) -> None:
    """Set `died` and `stop` when tritonserver exits on its own."""
    server.wait()
    if not stop.is_set():
        died.set()
        stop.set()


def _print_endpoints(server: TritonServer, bridge_port: int) -> None:
    models = server.config.models or sorted(
        p.name for p in server.config.repository.iterdir() if p.is_dir()
    )
    lines = [
        "tokenstream: Triton is ready",
        f"  models   {', '.join(models)}",
        f"  HTTP     {server.http_url}   (e.g. POST /v2/models/<model>/generate_stream)",
        f"  gRPC     {server.grpc_url}",
        f"  metrics  {server.metrics_url}",
    ]
    if bridge_port:
        lines.append(f"  chat     http://{_client_host(server.config.host)}:{bridge_port}/")
    lines.append("  Ctrl-C stops everything")
    print("\n".join(lines), flush=True)


# --------------------------------------------------------------------------- bridge integration
# The websocket bridge (clients/bridge.py) is optional here: imported lazily, and `serve` goes on
# without it (with a warning) when it or its dependencies are missing. Its contract as used:
# `BridgeConfig(triton_url=, host=, port=)` and `async serve_bridge(cfg, stop: asyncio.Event)`.


def _load_bridge() -> ModuleType | None:
    """The clients.bridge module, or None with a warning when it cannot be used."""
    try:
        module = importlib.import_module("clients.bridge")
    except ImportError as error:
        print(f"tokenstream: warning: websocket bridge not started ({error})", flush=True)
        return None
    if not all(hasattr(module, name) for name in ("BridgeConfig", "serve_bridge")):
        print("tokenstream: warning: clients.bridge lacks BridgeConfig/serve_bridge; not started")
        return None
    return module


def _run_bridge(bridge: ModuleType, server: TritonServer, port: int, stop: threading.Event) -> int:
    """Run the bridge in this thread until `stop` is set; 1 if it fails, else 0."""
    # the bridge logs through `logging`; without a handler its warnings would be lost
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # not a line per health probe
    cfg = bridge.BridgeConfig(triton_url=server.grpc_url, host=server.config.host, port=port)
    try:
        asyncio.run(_bridge_until(bridge.serve_bridge, cfg, stop))
    except Exception as error:  # the bridge failed (port taken, ...): Triton is stopped too
        print(f"tokenstream: bridge failed: {error!r}", file=sys.stderr, flush=True)
        return 1
    return 0


async def _bridge_until(serve_bridge: Callable, cfg: object, stop: threading.Event) -> None:
    """Await serve_bridge(cfg, event) with an asyncio event that follows the threading `stop`."""
    loop = asyncio.get_running_loop()
    bridge_stop = asyncio.Event()

    def relay() -> None:
        stop.wait()
        with contextlib.suppress(RuntimeError):  # the loop is closed: the bridge ended already
            loop.call_soon_threadsafe(bridge_stop.set)

    threading.Thread(target=relay, name="bridge-stop", daemon=True).start()
    await serve_bridge(cfg, bridge_stop)
