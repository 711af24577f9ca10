"""A start that cannot finish: the line each model prints when its `initialize` has returned, and
telling a tritonserver that will never report its models ready from one still loading them.

Triton 2.51's python backend gives up launching a model process (its stub) when one of the 1 s
health checks it makes while `initialize` runs fails (StubLauncher::ReceiveMessageFromStub: "Stub
process ... is not healthy"). Before it returns that error it waits for the stub to exit
(Launch's ScopedDefer -> WaitForStubProcess -> waitpid), but the stub goes on, finishes
`initialize` and then waits for commands: neither side moves, Triton logs nothing and never opens
its ports. Each of our models prints INITIALIZED as the last thing its `initialize` does; once
every instance of every model tritonserver loads has printed it, or once tritonserver is seen
waiting for a stub that has, the models must be ready within a short bound, or the start is hung.
A model that never prints the line (a repository of your own) is waited for up to the startup
timeout instead. Standard library only: the models import it too.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from streaming_backend.launcher.processes import command_line, waited_for

INITIALIZED = "[tokenstream] initialize returned:"
# tritonserver's words for a model whose initialize raised: its name, then the error's type and
# message (the python backend adds "At:" and the stack on the lines after)
_LOAD_FAILED = re.compile(
    r"load failed for model '([^']+)': version \S+ is at UNAVAILABLE state: (?:Internal: )?(.+)"
)
_LINE = re.compile(re.escape(INITIALIZED) + r" (\S+) of (\S+) \((\d+) instances?\)$")
STUB = "triton_python_backend_stub"
STUB_NAME_ARG = 8  # the stub's command line: binary, model path, shm name, sizes, ..., name


def initialized_line(args: Mapping[str, str]) -> str:
    """The line a model prints when its `initialize` (called with `args`) has returned: its
    instance, its model and how many instances that model has."""
    groups = json.loads(args["model_config"]).get("instance_group") or [{}]
    count = sum(int(g.get("count", 1)) * max(1, len(g.get("gpus") or ())) for g in groups)
    instances = f"{count} instance" if count == 1 else f"{count} instances"
    return f"{INITIALIZED} {args['model_instance_name']} of {args['model_name']} ({instances})"


def announce_initialized(args: Mapping[str, str]) -> None:
    """Print initialized_line on stderr, which reaches Triton's log and the launcher: the last
    call of a model's `initialize`."""
    print(initialized_line(args), file=sys.stderr, flush=True)


def load_failure(lines: Iterable[str]) -> str:
    """What the last model that failed to load said, from tritonserver's log lines: "chat:
    ValueError: ..." (the error's own line, without its stack); "" when no model failed."""
    found = ""
    for line in lines:
        match = _LOAD_FAILED.search(line)
        if match is not None:
            found = f"{match.group(1)}: {match.group(2).strip()}"
    return found


@dataclass(frozen=True)
class Initialized:
    """One instance's INITIALIZED line, and when it came (time.monotonic())."""

    instance: str
    model: str
    instances: int  # of its model
    at: float


def parse_initialized(line: str, at: float) -> Initialized | None:
    """The Initialized of an INITIALIZED line (anywhere in a log line), None for any other."""
    start = line.find(INITIALIZED)
    match = _LINE.match(line[start:].rstrip()) if start >= 0 else None
    if match is None:
        return None
    return Initialized(match.group(1), match.group(2), int(match.group(3)), at)


@dataclass(frozen=True)
class Hang:
    """A start that will not finish: how long since it should have, after what, and why."""

    overdue_s: float  # seconds since the moment the models should have turned ready
    after: str  # what had happened by then: "every model's initialize returned (chat_0_0)"
    cause: str  # what holds tritonserver, as far as /proc tells; "" when it does not


class StartWatch:
    """Reads tritonserver's log lines as they come (`feed`) and tells whether its start hangs
    (`check`): every model's instances have printed INITIALIZED, or tritonserver waits for a stub
    that has, and the models are still not ready `bound_s` later."""

    def __init__(self, models: Iterable[str], bound_s: float):
        self.models = frozenset(models)  # the models tritonserver loads at start
        self.bound_s = bound_s
        self._seen: dict[str, Initialized] = {}  # instance -> its line (fed by the log reader)
        self._waits: dict[int, float] = {}  # stub pid tritonserver waits for -> first seen

    def feed(self, line: str, at: float) -> None:
        """One log line of tritonserver, read at `at`."""
        initialized = parse_initialized(line, at)
        if initialized is not None:
            self._seen[initialized.instance] = initialized

    @property
    def initialized(self) -> list[Initialized]:
        """The instances whose initialize returned, in the order they said so."""
        return sorted(self._seen.values(), key=lambda seen: seen.at)

    def all_initialized_at(self) -> float | None:
        """When the last instance of every model loaded said its initialize returned; None while
        one has not (or while a model has printed nothing)."""
        seen = self.initialized
        count: dict[str, int] = {}
        expected: dict[str, int] = {}
        for line in seen:
            count[line.model] = count.get(line.model, 0) + 1
            expected[line.model] = line.instances
        if not self.models or any(count.get(m, 0) < expected.get(m, 1) for m in self.models):
            return None
        return max(line.at for line in seen if line.model in self.models)

    def check(self, server_pid: int, now: float) -> Hang | None:
        """A Hang once the models are `bound_s` overdue; None while the start may still finish."""
        waits = self._stub_waits(server_pid, now)
        moments = [
            (
                max(first, self._seen[name].at),
                f"{name}'s initialize returned and tritonserver began waiting for it to exit",
            )
            for name, first in waits.values()
        ]
        initialized_at = self.all_initialized_at()
        if initialized_at is not None:
            names = ", ".join(line.instance for line in self.initialized)
            moments.append((initialized_at, f"every model's initialize returned ({names})"))
        if not moments:
            return None
        at, what = min(moments)
        if now - at < self.bound_s:
            return None
        return Hang(now - at, what, _cause(waits))

    def _stub_waits(self, server_pid: int, now: float) -> dict[int, tuple[str, float]]:
        """Stubs that tritonserver waits for (waitpid) and whose initialize returned: pid ->
        (instance, when the wait was first seen). Read from /proc only once a line came."""
        if not self._seen:
            return {}
        found = {}
        for pid in waited_for(server_pid):
            name = stub_instance(pid)
            if name in self._seen:
                found[pid] = (name, self._waits.setdefault(pid, now))
        return found


def stub_instance(pid: int) -> str | None:
    """The model instance a triton_python_backend_stub process runs (from its command line);
    None for another process."""
    args = command_line(pid)
    for index, arg in enumerate(args):
        if arg.endswith(STUB) and len(args) > index + STUB_NAME_ARG:
            return args[index + STUB_NAME_ARG]
    return None


def _cause(waits: Mapping[int, tuple[str, float]]) -> str:
    """What holds tritonserver, from the stubs it waits for."""
    if not waits:
        return ""
    stubs = ", ".join(f"{name} (pid {pid})" for pid, (name, _) in sorted(waits.items()))
    return (
        f"tritonserver waits for the model process {stubs} to exit: its python backend gave up "
        "launching it (a health check of the stub that failed while initialize ran does that) "
        "and waits for it to end, while the stub finished initialize and waits for commands"
    )
