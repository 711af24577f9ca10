"""The supervisor's calls into a running tritonserver: the model's health canary and drain, and
Triton's model-repository API. Standard library HTTP only (urllib), no proxies.

A control request goes through Triton's ordinary `generate_stream` endpoint with the wire.CONTROL
input: its answer comes from the model's outbox thread, so it proves that the stub, the engine
and the thread that sends every response are all alive.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from streaming_backend.wire import (
    ADMIN_HEADER,
    CONTROL,
    FORWARD,
    MEMORY,
    NUMERICS,
    SPEC_ACCEPTED_METRIC,
    SPEC_DRAFTED_METRIC,
    SPECULATION,
    STEPS,
    SYSTEM_FINGERPRINT,
    TEXT_OUTPUT,
    speculation_counts,
)

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy


class ControlError(RuntimeError):
    """A control or repository call failed; `unreachable` when no answer came at all."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(frozen=True)
class ModelHealth:
    """A model's answer to a control request (wire.HEALTH_KEYS)."""

    healthy: bool
    reason: str
    draining: bool
    active: int  # requests accepted and not yet sent their FINAL
    waiting: int  # of those, still waiting for an engine slot
    system_fingerprint: str | None = None  # what decides its numbers, in one value
    numerics: dict[str, Any] | None = (
        None  # the facts it names (streaming_backend/model/numerics.py)
    )
    steps: dict[str, Any] | None = None  # decode threads and pace (step_threads.StepReport)
    forward: dict[str, Any] | None = None  # which forward runs and why (steps/forward_choice.py)
    memory: dict[str, Any] | None = None  # its weights' and KV cache's bytes (wire.MEMORY)
    speculation: dict[str, Any] | None = None  # drafted and accepted tokens (wire.SPECULATION)


def control(http_url: str, model: str, key: str, action: str, timeout: float) -> ModelHealth:
    """Send one control request (wire.CONTROL_ACTIONS) and return the model's health."""
    body = {CONTROL: json.dumps({"key": key, "action": action})}
    events = _post_sse(f"{http_url}/v2/models/{model}/generate_stream", body, timeout)
    for event in events:
        if "error" in event:
            raise ControlError(str(event["error"]))
        state = json.loads(event[TEXT_OUTPUT])
        return ModelHealth(
            healthy=bool(state["healthy"]),
            reason=str(state["reason"]),
            draining=bool(state["draining"]),
            active=int(state["active"]),
            waiting=int(state["waiting"]),
            system_fingerprint=state.get(SYSTEM_FINGERPRINT),
            numerics=state.get(NUMERICS),
            steps=state.get(STEPS),
            forward=state.get(FORWARD),
            memory=state.get(MEMORY),
            speculation=state.get(SPECULATION),
        )
    raise ControlError(f"{model} answered a control request with no response")


def model_speculation(metrics_url: str, model: str, timeout: float) -> dict | None:
    """`model`'s speculative decoding counts (wire.speculation_counts) from its counters on
    Triton's metrics port, summed over its versions; None where the port shows none of them (the
    model not loaded) or does not answer."""
    try:
        with _OPENER.open(metrics_url, timeout=timeout) as response:
            text = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return None
    drafted, accepted = (
        counter_total(text, name, model) for name in (SPEC_DRAFTED_METRIC, SPEC_ACCEPTED_METRIC)
    )
    if drafted is None or accepted is None:
        return None
    return speculation_counts(int(drafted), int(accepted))


def counter_total(text: str, name: str, model: str) -> float | None:
    """The sum of metric `name`'s series labelled model="`model`" in Prometheus text; None when
    it has none."""
    pattern = rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$"
    label = f'model="{model}"'
    values = [
        float(value)
        for labels, value in re.findall(pattern, text, re.M)
        if label in labels.split(",")
    ]
    return sum(values) if values else None


def load_model(
    http_url: str, model: str, key: str | None, timeout: float, config: dict | None = None
) -> None:
    """POST Triton's repository load for `model` (a reload when it is loaded); raises on failure.

    `config` (a model config as JSON) overrides the repository's config.pbtxt for this load.
    """
    body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
    headers = {ADMIN_HEADER: key} if key else {}
    _post(f"{http_url}/v2/repository/models/{model}/load", body, timeout, headers)


def model_ready(http_url: str, model: str, timeout: float = 2.0) -> bool:
    """GET /v2/models/<model>/ready: True on 200."""
    try:
        with _OPENER.open(f"{http_url}/v2/models/{model}/ready", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _post(url: str, body: dict, timeout: float, headers: dict[str, str]) -> bytes:
    """POST JSON; the body of a 2xx answer, else ControlError with Triton's message."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as error:
        raise ControlError(_triton_message(error.read()) or f"HTTP {error.code}") from None
    except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out
        raise ControlError(f"no answer from {url}: {error}", unreachable=True) from None


def _post_sse(url: str, body: dict, timeout: float) -> list[dict]:
    """POST to a generate_stream endpoint; its `data:` events as dicts."""
    text = _post(url, body, timeout, {}).decode("utf-8", "replace")
    prefix = "data: "
    return [
        json.loads(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)
    ]


def _triton_message(body: bytes) -> str:
    """The "error" of Triton's JSON error body, else the body as text."""
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace").strip()
