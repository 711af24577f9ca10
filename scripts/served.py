"""A server that a benchmark measures, started the one way every benchmark script starts one.

    .venv/bin/python scripts/served.py --server ".venv/bin/tokenstream serve --no-bridge ..." \\
        --ready http://127.0.0.1:18003/ready --log bench-results/serve.log \\
        --run ".venv/bin/tokenstream bench ... > bench.txt" --run "..."

The server runs in a process group of its own, its output in --log, and is ready when every
--ready URL answers 200 (and holds --expect, where given: a model's name in /v1/models); it
exiting first, or --timeout passing, fails the start. Each --run command (a shell line) then runs
against it in turn, and the server is stopped: --stop-signal to it, and after STOP_TIMEOUT_S
SIGTERM to whatever of its group is left, at last SIGKILL; the /dev/shm files its processes'
OpenMP runtimes register go too (they go at a normal exit, not at a signal). Prints the seconds
until ready and the milliseconds the stop took; exits 2 when the server was not ready (nothing
run), 1 when a command failed (every command runs all the same), else 0. compare_peers.py,
measure_memory.py and soak.py use Served itself; measure.sh, measure_forward.sh and
gpu_check.sh this command line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 900
STOP_TIMEOUT_S = 30  # for the server's own process, then for each signal to its group
POLL_S = 0.5
NOT_READY = 2  # the command line's exit status when the server never became ready
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


@dataclass
class Served:
    """A server process to measure: `with Served(...) as served:` starts it and waits until it
    is ready (served.ready_s), and stops it however the block ends (served.stop_ms)."""

    command: list[str]
    ready: list[str]  # URLs that each answer 200 once it is ready
    name: str = "server"
    expect: str = ""  # a text each ready answer holds
    log: Path | None = None  # its stdout and stderr; None: this process's
    env: dict[str, str] | None = None
    ready_timeout_s: float = READY_TIMEOUT_S
    stop_signal: int = signal.SIGTERM
    process: subprocess.Popen | None = field(default=None, init=False)
    ready_s: float | None = field(default=None, init=False)
    stop_ms: float | None = field(default=None, init=False)

    def __enter__(self) -> Served:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> float:
        """Start the server and wait until it is ready -> the seconds it took; on failure, stop
        it and raise (RuntimeError: it exited; TimeoutError: not ready in time)."""
        out = self.log.open("w") if self.log else None
        errors = subprocess.STDOUT if out else None
        try:
            self.process = subprocess.Popen(
                self.command, cwd=REPO, env=self.env, stdout=out, stderr=errors,
                start_new_session=True,
            )  # fmt: skip
        finally:
            if out:
                out.close()  # the server holds its own copy
        try:
            self.ready_s = self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.ready_s

    def wait_ready(self) -> float:
        """Seconds until every ready URL answers 200 (holding `expect`)."""
        started = time.monotonic()
        waiting = list(self.ready)
        while waiting:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.process.returncode}")
            if time.monotonic() - started > self.ready_timeout_s:
                raise TimeoutError(f"{self.name} not ready after {self.ready_timeout_s:.0f} s")
            waiting = [url for url in waiting if not answers(url, self.expect)]
            if waiting:
                time.sleep(POLL_S)
        return time.monotonic() - started

    def stop(self) -> None:
        """Stop the server and whatever of its process group is left (see the module's doc)."""
        process = self.process
        if process is None or self.stop_ms is not None:
            return
        pids = {process.pid, *group(process.pid)}
        started = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(self.stop_signal)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_TIMEOUT_S)
        self.stop_ms = (time.monotonic() - started) * 1000
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = group(process.pid)
            if not left and process.poll() is not None:
                break
            pids.update(left)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while (group(process.pid) or process.poll() is None) and time.monotonic() < deadline:
                time.sleep(0.2)
        process.wait()
        for pid in pids:
            remove_openmp_registration(pid)


def answers(url: str, expect: str = "") -> bool:
    """Whether GET url answers 200 now, its body holding `expect`."""
    try:
        with OPENER.open(url, timeout=5) as response:
            return response.status == 200 and expect in response.read().decode()
    except OSError:
        return False


def group(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (Linux /proc; zombies left out)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            state, _, group_id = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(group_id) == pgid and state != "Z":
                pids.append(int(stat.parent.name))
    return pids


def remove_openmp_registration(pid: int) -> None:
    """Remove the /dev/shm file an LLVM or Intel OpenMP runtime (llama.cpp built with clang,
    vLLM's preloaded libiomp5) registers for process `pid`: it goes at a normal exit, not when
    the process is stopped by a signal."""
    for path in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the server's command line, one string")
    parser.add_argument("--ready", action="append", required=True, help="a URL (repeatable)")
    parser.add_argument("--expect", default="", help="a text each ready answer holds")
    parser.add_argument("--log", type=Path, help="the server's output (default: this one's)")
    parser.add_argument("--timeout", type=float, default=READY_TIMEOUT_S, help="until ready, s")
    parser.add_argument("--stop-signal", default="TERM", help="INT or TERM (default TERM)")
    parser.add_argument("--run", action="append", default=[], help="a shell line (repeatable)")
    args = parser.parse_args(argv)
    command = shlex.split(args.server)
    served = Served(
        command,
        args.ready,
        name=Path(command[0]).name,
        expect=args.expect,
        log=args.log,
        ready_timeout_s=args.timeout,
        stop_signal=signal.Signals[f"SIG{args.stop_signal.upper()}"],
    )
    status = 0
    try:
        with served:
            print(f"served: ready in {served.ready_s:.1f} s", flush=True)
            for line in args.run:
                if subprocess.run(line, shell=True, cwd=REPO).returncode != 0:
                    print(f"served: failed: {line}", file=sys.stderr, flush=True)
                    status = 1
    except (RuntimeError, TimeoutError) as exc:
        print(f"served: {exc} (see {args.log or 'its output'})", file=sys.stderr, flush=True)
        return NOT_READY
    print(f"served: stopped in {served.stop_ms:.0f} ms", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
