"""Tests of clients/cli/chat.py: stats, history handling, and the real CLI in a pseudo-terminal."""

from __future__ import annotations

import argparse
import io
import os
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from clients.cli import chat
from clients.library.chunk import Chunk
from clients.library.grpc_client import GenerationError

REPO_ROOT = Path(__file__).resolve().parents[3]


def _chunk(text: str, t_ns: int, n: int | None = 1, final=False, reason=None) -> Chunk:
    return Chunk.delta(text, n, t_ns, request_id="r", finish_reason=reason, final=final)


def test_measure_ttft_first_text_and_decode_rate():
    """TTFT runs to the first response, the first text to the first printable text; the rate is
    tokens after the first response per second after it."""
    chunks = [
        _chunk("", 150_000_000),  # a token whose text is held back (half a character)
        _chunk("b", 250_000_000),
        _chunk("c", 350_000_000, n=2),
    ]
    stats = chat.measure(100_000_000, chunks, "length")
    assert stats.ttft_s == pytest.approx(0.05)
    assert stats.first_text_s == pytest.approx(0.15)
    assert stats.tokens == 4
    assert stats.decode_tokens_per_s == pytest.approx(3 / 0.2)


def test_measure_without_tokens():
    """An answer whose only response has no token has a TTFT, but no first text and no rate."""
    assert chat.measure(0, [_chunk("", 5_000_000, n=0)], "cancelled") == chat.AnswerStats(
        0.005, None, 0, None, "cancelled"
    )


def test_format_stats():
    """The stats line is one bracketed line; the first text shows only when it came later."""
    line = chat.format_stats(chat.AnswerStats(0.0421, 0.0419, 64, 118.25, "length"))
    assert line == "[TTFT 42 ms · 118.2 tok/s · 64 tokens · length]"
    line = chat.format_stats(chat.AnswerStats(0.0421, 0.0484, 64, 118.25, "length"))
    assert line == "[TTFT 42 ms · first text 48 ms · 118.2 tok/s · 64 tokens · length]"


def test_config_from_args_keeps_only_given_options():
    """Only sampling flags given on the command line are sent."""
    parser = argparse.ArgumentParser()
    chat.add_arguments(parser)
    args = parser.parse_args(["--temperature", "0", "--max-tokens", "5", "--stop", "\n"])
    cfg = chat.config_from_args(args)
    assert cfg.sampling == {"temperature": 0.0, "max_tokens": 5, "stop": ["\n"]}
    assert cfg.url == "127.0.0.1:8001" and cfg.model == "chat"


def test_run_chat_keeps_history_and_drops_failed_turns(monkeypatch):
    """Answers join the history; a failed question does not; EOF ends the loop."""
    sent = []

    def fake_stream(url, request, model):
        sent.append([dict(m) for m in request.messages])
        if request.messages[-1]["content"] == "bad":
            raise GenerationError("invalid request: nope", "invalid_request")
        yield _chunk("hi ", time.monotonic_ns())
        yield _chunk("there", time.monotonic_ns(), final=True, reason="stop")

    monkeypatch.setattr(chat, "stream_generate", fake_stream)
    lines = iter(["hello", "bad", "again"])

    def read_line(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    chat.run_chat(chat.ChatConfig(system="be brief"), read_line, out)
    assert sent[2] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "again"},
    ]
    text = out.getvalue()
    assert "hi there\n[TTFT" in text and "error (invalid_request): invalid request: nope" in text


# ---------------------------------------------------------------- the real CLI in a pty


class Terminal:
    """`tokenstream chat` running in a pseudo-terminal, so Ctrl-C is a real ^C keystroke."""

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: becomes the CLI
            os.chdir(REPO_ROOT)
            os.execv(sys.executable, [sys.executable, "-m", "clients.cli", "chat", *argv])
        self.output = ""

    def read_until(self, needle: str, timeout: float = 60.0, start: int = 0) -> str:
        """Read output until `needle` appears after `start`; the output so far."""
        deadline = time.monotonic() + timeout
        while needle not in self.output[start:]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{needle!r} not seen; output:\n{self.output}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # the child exited
                    raise TimeoutError(f"{needle!r} not seen; output:\n{self.output}") from None
                self.output += data.decode("utf-8", "replace")
        return self.output

    def read_at_least(self, size: int, timeout: float = 60.0) -> str:
        """Read until the output holds at least `size` characters."""
        deadline = time.monotonic() + timeout
        while len(self.output) < size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"output stayed short:\n{self.output}")
            if select.select([self.fd], [], [], 0.1)[0]:
                self.output += os.read(self.fd, 4096).decode("utf-8", "replace")
        return self.output

    def write(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def wait(self, timeout: float = 20.0) -> int:
        """The exit status of the CLI."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            with_output = select.select([self.fd], [], [], 0.1)[0]
            if with_output:
                try:
                    self.output += os.read(self.fd, 4096).decode("utf-8", "replace")
                except OSError:
                    pass
        raise TimeoutError("the CLI did not exit")

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


@pytest.mark.server
def test_chat_cli_streams_two_turns_then_eof(triton_server):
    """Each answer streams and ends with a stats line; Ctrl-D at the prompt exits 0."""
    term = Terminal(["--url", triton_server.grpc_url, "--max-tokens", "8", "--seed", "1"])
    try:
        for question in ("Hello there", "And again"):
            mark = len(term.read_until(chat.PROMPT))
            term.write(question + "\r")
            out = term.read_until("tok/s", timeout=120, start=mark)
            assert "[TTFT" in out[mark:] and "8 tokens · length]" in out[mark:]
            term.output = out[out.index("tok/s", mark) :]  # forget what was matched
        term.read_until(chat.PROMPT)
        term.write("\x04")
        assert term.wait() == 0
    finally:
        term.close()


def sigint_missing_the_prompts_wait(pid: int) -> None:
    """Deliver SIGINT the way that a Ctrl-C racing the prompt arrives: the signal is recorded but
    the main thread's wait for a keystroke (readline's select()) never sees it.

    A keystroke that lands between readline printing the prompt and its select() starting does
    that on a busy machine, by chance; delivering the signal to another thread of the process
    (kill() on a thread id picks that thread when it does not block the signal) does it every
    time: CPython's C handler records it, and the main thread is not interrupted.
    """
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        blocked = int(re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
        if tid != pid and not blocked & (1 << (signal.SIGINT - 1)):
            os.kill(tid, signal.SIGINT)
            return
    raise AssertionError("the CLI has no thread besides the main one that takes SIGINT")


@pytest.mark.server
@pytest.mark.parametrize("prompt_ctrl_c", ["keystroke", "missed_by_select"])
def test_chat_cli_ctrl_c_cancels_answer_not_program(triton_server, prompt_ctrl_c):
    """^C during an answer stops it (marked cancelled) and returns to the prompt; ^C at the
    prompt exits at once, also when it lands outside readline's wait for a keystroke."""
    # greedy: a sampled answer of the random model could end at EOS before the ^C
    term = Terminal(["--url", triton_server.grpc_url, "--max-tokens", "190", "--temperature", "0"])
    try:
        term.read_until(chat.PROMPT)
        term.write("Tell me a long story\r")
        echoed = len(term.read_until("long story\r\n"))
        term.read_at_least(echoed + 8)  # the answer has begun
        term.write("\x03")
        out = term.read_until("cancelled]", start=echoed)
        stats = out[out.index("[TTFT", echoed) :]
        assert "190 tokens" not in stats
        term.read_until(chat.PROMPT, start=out.index("cancelled]", echoed))
        if prompt_ctrl_c == "keystroke":
            term.write("\x03")  # the instant the prompt shows: it may race readline's select()
        else:
            sigint_missing_the_prompts_wait(term.pid)
        assert term.wait(timeout=10) == 0
    finally:
        term.close()
