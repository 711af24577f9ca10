"""Processes and leftovers: /proc walking, killing a process tree, /dev/shm files, free ports.

Only processes we started, and their descendants, are ever signalled: each one is recorded with
its start time, so a pid the kernel has since reused is never taken for ours.
"""

from __future__ import annotations

import collections
import os
import platform
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path

SHM_DIR = Path("/dev/shm")
# wait4's number in /proc/<pid>/syscall (glibc's waitpid calls it); None: not known here
WAIT4 = {"x86_64": 61, "aarch64": 260}.get(platform.machine())


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


def zombie_children(pid: int) -> dict[int, int]:
    """Children of `pid` that died and were not reaped: pid -> start time."""
    found = {}
    for name in os.listdir("/proc"):
        stat = _stat(int(name)) if name.isdigit() else None
        if stat is not None and stat[0] == "Z" and stat[1] == pid:
            found[int(name)] = stat[2]
    return found


def waited_for(pid: int) -> set[int]:
    """The processes that threads of `pid` wait for in waitpid (wait4) right now, as
    /proc/<pid>/task/*/syscall tells it; empty where it does not (another CPU, no permission)."""
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split()
        except OSError:
            continue
        # "61 0x29c9 ..." while in wait4(10697, ...); "running" or another number otherwise
        if WAIT4 is not None and len(fields) > 1 and fields[0] == str(WAIT4):
            target = int(fields[1], 16)
            if 0 < target < 2**31:  # a pid, not -1 (any child) or a process group
                found.add(target)
    return found


def command_line(pid: int) -> list[str]:
    """The arguments a process was started with; [] when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1]


def is_alive(pid: int, start_time: int) -> bool:
    """Whether that very process (same pid and start time) still runs; zombies count as gone."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == start_time


def kill_processes(processes: Mapping[int, int]) -> None:
    """SIGKILL each process that is still the one we recorded."""
    for pid, start_time in processes.items():
        if is_alive(pid, start_time):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # exited between the check and the kill


def wait_gone(processes: Mapping[int, int], timeout: float) -> None:
    """Wait until none of `processes` runs any more, or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while any(is_alive(p, t) for p, t in processes.items()) and time.monotonic() < deadline:
        time.sleep(0.05)


def parent_death_prefix() -> list[str]:
    """`setpriv --pdeathsig KILL --` when usable: a child dies with us even on our SIGKILL."""
    # the signal follows the thread that forked, not the process: only the main thread qualifies
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return []
    return [setpriv, "--pdeathsig", "KILL", "--"]


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
