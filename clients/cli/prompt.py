"""A terminal prompt that Ctrl-C always ends at once, readline's line editing kept.

Why: CPython's readline waits for a keystroke in select() and learns of a signal only when that
select() fails with EINTR. A SIGINT that lands after the prompt is printed but before select()
starts (or that the kernel hands to another thread) is only recorded by CPython's C handler, and
select() then sleeps until the next keystroke: Ctrl-C at the prompt seems ignored.

How: `signal.set_wakeup_fd` makes the C handler write the signal's number to a pipe. A watcher
thread reads it; when a SIGINT came while the prompt waits, it interrupts the main thread with
KICK_SIGNAL (a no-op handler) until the prompt has returned. Each kick makes select() fail with
EINTR, CPython runs the pending SIGINT handler, and input() raises KeyboardInterrupt.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

KICK_SIGNAL = signal.SIGUSR1
KICK_INTERVAL_S = 0.05
MAX_KICKS = 100  # 5 s: far longer than the few microseconds between prompt and select()


class InterruptiblePrompt:
    """`read_line(prompt)` is `input(prompt)` whose wait a Ctrl-C always ends (main thread only)."""

    def __init__(self, read: Callable[[str], str] = input) -> None:
        self._read = read
        self._main = threading.get_ident()
        self._waiting = threading.Event()
        self._closing = threading.Event()
        self._prompts = 0  # prompts started; a SIGINT is about the prompt open when it came
        self._old_kick = self._old_wakeup = None
        self._rfd = self._wfd = -1
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> InterruptiblePrompt:
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)  # set_wakeup_fd requires it
        self._old_kick = signal.signal(KICK_SIGNAL, _ignore)
        self._old_wakeup = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="prompt-ctrl-c", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._closing.set()
        os.write(self._wfd, b"\0")  # wake the watcher
        self._watcher.join()
        signal.set_wakeup_fd(self._old_wakeup)
        signal.signal(KICK_SIGNAL, self._old_kick)  # no kick can come any more: watcher joined
        os.close(self._rfd)
        os.close(self._wfd)

    def read_line(self, prompt: str) -> str:
        """One line typed at `prompt`; KeyboardInterrupt on Ctrl-C, EOFError on Ctrl-D."""
        try:
            self._prompts += 1
            self._waiting.set()
            return self._read(prompt)
        finally:
            self._waiting.clear()

    def _watch(self) -> None:
        """Read signal numbers from the wakeup pipe until closed; act on SIGINT."""
        while not self._closing.is_set():
            numbers = os.read(self._rfd, 64)
            if signal.SIGINT in numbers and self._waiting.is_set():
                self._kick(self._prompts)

    def _kick(self, prompt: int) -> None:
        """Interrupt the main thread's wait until the prompt that was open has returned."""
        for _ in range(MAX_KICKS):
            # First give the normal path (select() got EINTR) its chance: no kick needed then.
            if self._closing.wait(KICK_INTERVAL_S):
                return
            if not self._waiting.is_set() or self._prompts != prompt:
                return
            signal.pthread_kill(self._main, KICK_SIGNAL)


def _ignore(signum, frame) -> None:
    """KICK_SIGNAL's handler: its only job is to interrupt a blocking system call."""
