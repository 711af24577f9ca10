"""Tests for streaming_backend/launcher/processes.py: process trees, /dev/shm files, ports."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess

from conftest import alive, shm_files, wait_for

from streaming_backend.launcher.processes import (
    SHM_DIR,
    descendants,
    free_port,
    is_alive,
    kill_processes,
    remove_shm,
    wait_gone,
)


def test_descendants_are_found_and_killed() -> None:
    """descendants() sees grandchildren; kill_processes() ends exactly the recorded ones."""
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        wait_for(lambda: len(descendants(shell.pid)) == 2)
        family = descendants(shell.pid)
        assert all(is_alive(pid, start) for pid, start in family.items())
        kill_processes(family)
        wait_gone(family, timeout=10)
        assert alive(family) == []
        assert shell.wait(timeout=10) == 0  # its children gone, `wait` returns and sh exits
    finally:
        shell.kill()
        shell.wait()


def test_a_process_is_known_by_its_pid_and_start_time() -> None:
    """is_alive() is false for another start time (a reused pid) and once the process is gone."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        start = descendants(os.getpid())[child.pid]
        assert is_alive(child.pid, start)
        assert not is_alive(child.pid, start + 1)
    finally:
        child.kill()
        child.wait()
    assert not is_alive(child.pid, start)


def test_remove_shm_deletes_only_its_prefix() -> None:
    """Files of the prefix go, a file of another prefix stays; glob characters are literal."""
    prefix = f"tokenstream_test_{secrets.token_hex(4)}_[*]"
    ours = [SHM_DIR / f"{prefix}a", SHM_DIR / f"{prefix}b"]
    other = SHM_DIR / f"{prefix[:-3]}x"  # would match if "[*]" were taken as a pattern
    try:
        for path in [*ours, other]:
            path.write_bytes(b"")
        assert remove_shm(prefix) == ours
        assert shm_files(prefix) == [] and other.exists()
    finally:
        for path in [*ours, other]:
            path.unlink(missing_ok=True)


def test_free_port_can_be_bound() -> None:
    """free_port() gives a loopback port nobody holds."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
