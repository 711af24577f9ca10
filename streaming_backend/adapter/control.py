"""Control requests: the supervisor's canary and drain (wire.CONTROL).

A control request carries {"key": <admin key>, "action": <wire.CONTROL_ACTIONS>}. It is taken only
with the admin key the launcher put in the model process's environment, and answered with the
model's health as JSON: wire.HEALTH_KEYS (its state, the system fingerprint and the numerics it
names, which forward runs and why, what its memory costs now). The outbox answers it, so an
answer proves that the outbox thread, the engine and the stub all still work.
"""

from __future__ import annotations

import hmac
import json
import logging

from streaming_backend.errors import EngineStopped, InvalidRequest
from streaming_backend.wire import (
    CONTROL,
    CONTROL_ACTIONS,
    CONTROL_DRAIN,
    CONTROL_END,
    DRAINING,
    HEALTH_KEYS,
)

log = logging.getLogger("tokenstream.model")


class Control:
    """The admin key, the drain state and the model's health, over one engine."""

    def __init__(self, engine, admin_key: str | None):
        """`admin_key` None: every control request is refused."""
        self.engine = engine
        self.admin_key = admin_key
        self.draining = False  # set by a drain or end action: new requests are refused

    def action(self, raw: bytes | str) -> str:
        """The action a control request asks for; InvalidRequest for a malformed request, no
        admin key or a wrong one, or an unknown action."""
        try:
            body = json.loads(raw)
            key, action = str(body["key"]), body["action"]
        except (ValueError, TypeError, KeyError):
            raise InvalidRequest(f"{CONTROL} must be JSON with key and action") from None
        if self.admin_key is None or not hmac.compare_digest(key, self.admin_key):
            raise InvalidRequest(f"{CONTROL} needs the server's admin key")
        if action not in CONTROL_ACTIONS:
            raise InvalidRequest(f"{CONTROL} action must be {CONTROL_ACTIONS}")
        return action

    def admit(self) -> None:
        """Raise EngineStopped (unavailable, retry elsewhere) while draining."""
        if self.draining:
            raise EngineStopped(DRAINING)

    def act(self, action: str, active: int) -> str:
        """Do what `action` asks, then the model's health as JSON, `active` streams open."""
        if action in (CONTROL_DRAIN, CONTROL_END):
            self.draining = True
        if action == CONTROL_END:
            log.warning("ending every open stream: the drain deadline passed")
            self.engine.shutdown()  # each stream's final error event comes back through the outbox
        return json.dumps(self.health(active))

    def health(self, active: int) -> dict:
        """The model's health (wire.HEALTH_KEYS), as the supervisor's canary reads it."""
        healthy, reason = self.engine.health()
        numerics, steps = self.engine.numerics, self.engine.step_report()
        memory = self.engine.memory_report()
        values = (
            healthy, reason, self.draining, active, self.engine.waiting_streams,
            numerics.fingerprint, numerics.as_dict(), steps.as_dict() if steps else None,
            self.engine.forward_choice.as_dict(), memory.as_dict() if memory else None,
            self.engine.speculation_report(),
        )  # fmt: skip
        return dict(zip(HEALTH_KEYS, values, strict=True))
