"""Tests for streaming_backend/launcher/startup.py: the models' `initialize returned` line and
telling a start that hangs from one still loading, without a server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import wait_for

from streaming_backend.launcher.processes import WAIT4, waited_for
from streaming_backend.launcher.startup import (
    StartWatch,
    initialized_line,
    load_failure,
    parse_initialized,
    stub_instance,
)


def args(instance: str, model: str, groups: list[dict]) -> dict[str, str]:
    """The `args` Triton's python backend gives initialize, as far as the line reads them."""
    config = {"name": model, "instance_group": groups}
    return {
        "model_config": json.dumps(config),
        "model_instance_name": instance,
        "model_name": model,
    }


def test_the_line_names_the_instance_its_model_and_how_many_instances_it_has() -> None:
    """Instances are counted over the groups, a GPU group's count once per GPU; the line reads
    back as what it said, also behind a log prefix."""
    line = initialized_line(args("chat_0_0", "chat", [{"kind": "KIND_CPU", "count": 1}]))
    assert line == "[tokenstream] initialize returned: chat_0_0 of chat (1 instance)"
    groups = [{"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]}, {"kind": "KIND_CPU", "count": 1}]
    line = initialized_line(args("dialogue_model_1_0", "dialogue_model", groups))
    seen = parse_initialized(f"W1205 prefix {line}\n", at=7.0)
    assert (seen.instance, seen.model, seen.instances, seen.at) == (
        "dialogue_model_1_0",
        "dialogue_model",
        5,
        7.0,
    )
    assert parse_initialized("[tokenstream] numerics fp_0123: model x", at=1.0) is None


def feed(watch: StartWatch, instance: str, model: str, count: int, at: float) -> None:
    groups = [{"kind": "KIND_CPU", "count": count}]
    watch.feed(initialized_line(args(instance, model, groups)), at)


def test_the_bound_starts_when_every_instance_of_every_loaded_model_returned() -> None:
    """No hang while an instance of a loaded model has not said so, however long; once all have,
    a hang `bound_s` after the last one, saying how overdue and after what."""
    watch = StartWatch(["chat", "dialogue_model"], bound_s=20.0)
    no_waits = os.getpid()  # a process that waits for no stub
    feed(watch, "chat_0_0", "chat", 1, at=10.0)
    feed(watch, "dialogue_model_0_0", "dialogue_model", 2, at=12.0)
    assert watch.all_initialized_at() is None
    assert watch.check(no_waits, now=500.0) is None  # one dialogue instance still loads
    feed(watch, "dialogue_model_0_1", "dialogue_model", 2, at=40.0)
    assert watch.all_initialized_at() == 40.0
    assert watch.check(no_waits, now=59.9) is None
    hang = watch.check(no_waits, now=61.0)
    assert hang.overdue_s == pytest.approx(21.0)
    assert hang.after == (
        "every model's initialize returned (chat_0_0, dialogue_model_0_0, dialogue_model_0_1)"
    )
    assert hang.cause == ""


def test_a_model_that_prints_nothing_never_starts_the_bound() -> None:
    """A loaded model that never prints the line (a repository of your own): the start is left
    to the startup timeout."""
    watch = StartWatch(["chat", "echo"], bound_s=1.0)
    feed(watch, "chat_0_0", "chat", 1, at=0.0)
    assert watch.check(os.getpid(), now=1000.0) is None
    assert StartWatch([], bound_s=1.0).all_initialized_at() is None


STUB_LIKE = (
    "import os, sys\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    # a child that looks like a stub: the instance name 8 arguments after the binary\n"
    "    os.execv(sys.executable, ['/x/triton_python_backend_stub', '-c',\n"
    "             'import time; time.sleep(60)', 'a', 'b', 'c', 'd', 'e', 'echo_0_0', 'DEFAULT'])\n"
    "print(pid, flush=True)\n"
    "os.waitpid(pid, 0)\n"
)


@pytest.mark.skipif(WAIT4 is None, reason="wait4's syscall number is known on x86_64 and aarch64")
def test_a_server_waiting_for_a_stub_whose_initialize_returned_is_a_hang_with_its_cause() -> None:
    """A process whose thread sits in waitpid() for a live stub (as tritonserver does when its
    python backend gave up launching it): found through /proc, named by the stub's instance; the
    bound then runs from whichever came later, the wait or the line, even while another model
    still loads."""
    parent = subprocess.Popen([sys.executable, "-c", STUB_LIKE], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        wait_for(lambda: waited_for(parent.pid) == {child}, timeout=10)
        wait_for(lambda: stub_instance(child) == "echo_0_0", timeout=10)
        watch = StartWatch(["echo", "chat"], bound_s=20.0)
        assert watch.check(parent.pid, now=100.0) is None  # no line yet: /proc is not read
        feed(watch, "echo_0_0", "echo", 1, at=105.0)
        assert watch.check(parent.pid, now=110.0) is None  # the wait is first seen now
        assert watch.check(parent.pid, now=129.0) is None
        hang = watch.check(parent.pid, now=131.0)
        assert hang.overdue_s == pytest.approx(21.0)
        assert hang.after.startswith("echo_0_0's initialize returned and tritonserver began")
        assert f"the model process echo_0_0 (pid {child}) to exit" in hang.cause
    finally:
        os.kill(child, signal.SIGKILL)  # the parent reaps it and exits
        parent.wait(timeout=10)
    assert stub_instance(os.getpid()) is None
    assert waited_for(os.getpid()) == set()


def test_no_such_process_waits_for_nothing() -> None:
    """A pid that is gone: no waits, no command line."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert waited_for(process.pid) == set() and stub_instance(process.pid) is None


def test_a_models_load_failure_is_read_from_the_log():
    """The error a model's initialize raised, from tritonserver's line (its stack left out); the
    last model's when several failed; "" when none did."""
    lines = [
        'I1205 16:28:38.100347 7351 server.cc:305] "Waiting for in-flight requests to complete."',
        "error: creating server: Invalid argument - load failed for model 'chat': version 1 is "
        "at UNAVAILABLE state: Internal: ValueError: the draft model o has another vocabulary",
        "",
        "At:",
        "  /x/streaming_backend/steps/draft_model.py(203): check_same_vocabulary",
    ]
    assert load_failure(lines) == "chat: ValueError: the draft model o has another vocabulary"
    assert load_failure(lines[:1]) == ""
