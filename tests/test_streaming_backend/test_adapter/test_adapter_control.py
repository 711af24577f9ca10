"""adapter/control.py on its own, over a fake engine: which control requests are taken, what
drain and end do, and the health answer key by key (the outbox tests run it on a real engine)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from streaming_backend import wire
from streaming_backend.adapter.control import Control
from streaming_backend.errors import EngineStopped, InvalidRequest

KEY = "the admin key"


@dataclass
class Facts:
    """A value with as_dict(), as numerics, step reports and forward choices have."""

    name: str
    fingerprint: str = "fp_test"

    def as_dict(self) -> dict:
        return {"name": self.name}


@dataclass
class FakeEngine:
    """The engine's few members Control reads, each with a value of its own."""

    healthy: tuple[bool, str] = (True, "")
    waiting_streams: int = 3
    numerics: Facts = field(default_factory=lambda: Facts("numerics"))
    steps: Facts | None = field(default_factory=lambda: Facts("steps"))
    forward_choice: Facts = field(default_factory=lambda: Facts("forward"))
    memory: Facts | None = field(default_factory=lambda: Facts("memory"))
    shutdowns: int = 0

    def health(self) -> tuple[bool, str]:
        return self.healthy

    def step_report(self) -> Facts | None:
        return self.steps

    def memory_report(self) -> Facts | None:
        return self.memory

    def speculation_report(self) -> dict:
        return {"mode": "ngram", "drafted": 10, "accepted": 7, "rate": 0.7}

    def shutdown(self) -> None:
        self.shutdowns += 1


def raw(key: str = KEY, action: str = wire.CONTROL_HEALTH) -> str:
    return json.dumps({"key": key, "action": action})


@pytest.mark.parametrize("action", wire.CONTROL_ACTIONS)
def test_each_action_is_taken_with_the_admin_key(action):
    """A well-formed request with the admin key gives its action back."""
    assert Control(FakeEngine(), KEY).action(raw(action=action)) == action
    assert Control(FakeEngine(), KEY).action(raw(action=action).encode()) == action


@pytest.mark.parametrize(
    ("request_body", "admin_key", "message"),
    [
        ("not json", KEY, "must be JSON with key and action"),
        (json.dumps(["health"]), KEY, "must be JSON with key and action"),
        (json.dumps({"action": "health"}), KEY, "must be JSON with key and action"),
        (json.dumps({"key": KEY}), KEY, "must be JSON with key and action"),
        (raw(key="a guess"), KEY, "needs the server's admin key"),
        (raw(key=""), KEY, "needs the server's admin key"),
        (raw(), None, "needs the server's admin key"),  # no key in this process: none taken
        (raw(action="reboot"), KEY, "action must be"),
    ],
)
def test_other_requests_are_invalid(request_body, admin_key, message):
    """Malformed, keyless, wrongly keyed or unknown: an InvalidRequest that says which."""
    with pytest.raises(InvalidRequest, match=message):
        Control(FakeEngine(), admin_key).action(request_body)


def test_health_answers_without_draining():
    """The health action changes nothing: requests are still admitted."""
    control = Control(FakeEngine(), KEY)
    control.act(wire.CONTROL_HEALTH, active=0)
    control.admit()
    assert control.draining is False


def test_drain_refuses_new_requests_and_leaves_the_engine_running():
    """After drain, admit() raises EngineStopped (retry elsewhere); open streams go on."""
    engine = FakeEngine()
    control = Control(engine, KEY)
    answer = json.loads(control.act(wire.CONTROL_DRAIN, active=2))
    assert answer["draining"] is True and engine.shutdowns == 0
    with pytest.raises(EngineStopped, match="draining"):
        control.admit()


def test_end_drains_and_ends_every_open_stream():
    """end (the drain deadline) drains and shuts the engine down once."""
    engine = FakeEngine()
    control = Control(engine, KEY)
    answer = json.loads(control.act(wire.CONTROL_END, active=2))
    assert answer["draining"] is True and engine.shutdowns == 1
    with pytest.raises(EngineStopped):
        control.admit()


def test_the_health_answer_names_each_fact_under_its_key():
    """wire.HEALTH_KEYS in order, each from its source: the engine's health, the open and
    waiting streams, the fingerprint, numerics, step report, forward choice and memory."""
    engine = FakeEngine(healthy=(False, "the engine thread died"))
    health = Control(engine, KEY).health(active=5)
    assert list(health) == list(wire.HEALTH_KEYS)
    assert health == {
        "healthy": False,
        "reason": "the engine thread died",
        "draining": False,
        "active": 5,
        "waiting": 3,
        wire.SYSTEM_FINGERPRINT: "fp_test",
        wire.NUMERICS: {"name": "numerics"},
        wire.STEPS: {"name": "steps"},
        wire.FORWARD: {"name": "forward"},
        wire.MEMORY: {"name": "memory"},
        wire.SPECULATION: {"mode": "ngram", "drafted": 10, "accepted": 7, "rate": 0.7},
    }


def test_no_step_report_is_null():
    """Steps without a report (no adaptive threads) answer steps as null."""
    health = Control(FakeEngine(steps=None), KEY).health(active=0)
    assert health[wire.STEPS] is None


def test_no_memory_report_is_null():
    """A forward that does not tell its memory (Hugging Face's, a GPU) answers memory as null."""
    health = Control(FakeEngine(memory=None), KEY).health(active=0)
    assert health[wire.MEMORY] is None
