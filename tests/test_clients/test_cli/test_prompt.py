"""Tests of clients/cli/prompt.py: Ctrl-C ends the prompt's wait even when the wait missed it."""

from __future__ import annotations

import os
import pty
import select
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from clients.cli.prompt import KICK_SIGNAL, InterruptiblePrompt

REPO_ROOT = Path(__file__).resolve().parents[3]


def _sigint_to_watcher_once_waiting(prompt: InterruptiblePrompt) -> threading.Thread:
    """A thread that, once the prompt waits, sends SIGINT to the prompt's watcher thread: the
    main thread's wait is not interrupted, as when the signal lands just before the wait."""

    def send():
        while not prompt._waiting.is_set():
            time.sleep(0.001)
        signal.pthread_kill(prompt._watcher.ident, signal.SIGINT)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_sigint_that_misses_the_wait_still_ends_it():
    """A blocking wait (select on a silent pipe) that the SIGINT did not interrupt is interrupted
    by the watcher, and the prompt raises KeyboardInterrupt at once, not at the wait's end."""
    silent_r, silent_w = os.pipe()

    def wait_for_a_key(prompt_text: str) -> str:
        select.select([silent_r], [], [], 20.0)  # a keystroke that never comes
        return "timed out"

    try:
        with InterruptiblePrompt(read=wait_for_a_key) as prompt:
            sender = _sigint_to_watcher_once_waiting(prompt)
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                prompt.read_line("> ")
            sender.join()
        assert time.monotonic() - start < 5.0
    finally:
        os.close(silent_r)
        os.close(silent_w)


def test_signal_state_restored_and_lines_pass_through():
    """Lines come back as read; afterwards the kick signal's handler and the wakeup fd are the
    ones from before."""
    before = signal.getsignal(KICK_SIGNAL)
    with InterruptiblePrompt(read=lambda text: text + "answer") as prompt:
        assert prompt.read_line("q: ") == "q: answer"
        assert signal.getsignal(KICK_SIGNAL) is not before
    assert signal.getsignal(KICK_SIGNAL) is before
    assert signal.set_wakeup_fd(-1) == -1  # none was left behind


CHILD = """
import readline, sys
from clients.cli.prompt import InterruptiblePrompt
with InterruptiblePrompt() as prompt:
    try:
        print("got", repr(prompt.read_line("ask> ")), flush=True)
        prompt.read_line("ask> ")
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    except EOFError:
        print("eof", flush=True)
"""


def _read_until(fd: int, needle: bytes, timeout: float = 20.0) -> bytes:
    out, deadline = b"", time.monotonic() + timeout
    while needle not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} not seen in {out!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                out += os.read(fd, 4096)
            except OSError:  # the child exited
                break
    assert needle in out, out
    return out


def _exit_code(pid: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    raise TimeoutError("the prompt did not end")


@pytest.mark.parametrize("how", ["keystroke", "missed_by_select", "eof"])
def test_readline_prompt_in_a_terminal(how):
    """With the real readline in a pseudo-terminal: a line is read; then ^C (typed, or a SIGINT
    that readline's select() does not see) interrupts the prompt, ^D ends it."""
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(REPO_ROOT)
        os.execv(sys.executable, [sys.executable, "-c", CHILD])
    try:
        _read_until(fd, b"ask> ")
        os.write(fd, "héllo\r".encode())
        out = _read_until(fd, b"ask> ")
        assert "got 'héllo'".encode() in out
        if how == "keystroke":
            os.write(fd, b"\x03")
        elif how == "eof":
            os.write(fd, b"\x04")
        else:  # to the watcher thread: the main thread's select() is not interrupted
            watcher = max(int(t) for t in os.listdir(f"/proc/{pid}/task"))
            assert watcher != pid
            os.kill(watcher, signal.SIGINT)
        _read_until(fd, b"eof" if how == "eof" else b"interrupted")
        assert _exit_code(pid) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
