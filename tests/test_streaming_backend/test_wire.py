"""The wire contract: one definition of names and codes, consistent with the model and errors."""

import json
import re

import pytest
from conftest import REPO_ROOT

from streaming_backend import wire
from streaming_backend.errors import (
    Cancelled,
    EngineStopped,
    InvalidRequest,
    MaskFailed,
    NonFiniteLogits,
    Overloaded,
    StreamingError,
)

# pb_utils.TritonError's codes (triton_python_backend_utils is only importable inside the stub).
TRITON_CODES = {"UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED"}
TRITON_CODES |= {"ALREADY_EXISTS", "CANCELLED"}


def _config_names(section: str, model: str = wire.CHAT_MODEL) -> list[str]:
    """Tensor names of a model's config.pbtxt `input` or `output` section."""
    text = (REPO_ROOT / "repository" / model / "config.pbtxt").read_text()
    body = re.search(rf"^{section} \[(.*?)^\]", text, re.M | re.S).group(1)
    return re.findall(r'name: "([^"]+)"', body)


def test_tensor_names_match_the_model_config():
    """The model config declares exactly the wire's inputs (and the control input) and outputs."""
    assert sorted(_config_names("input")) == sorted((*wire.INPUT_NAMES, wire.CONTROL))
    assert sorted(_config_names("output")) == sorted(wire.OUTPUT_NAMES)
    assert len(set(wire.INPUT_NAMES)) == len(wire.INPUT_NAMES)
    assert set(wire.PROMPT_INPUTS) <= set(wire.INPUT_NAMES)


def test_dialogue_tensor_names_match_its_model_config():
    """The dialogue model's config declares exactly the wire's dialogue inputs and outputs."""
    inputs = _config_names("input", wire.DIALOGUE_MODEL)
    assert sorted(inputs) == sorted(wire.DIALOGUE_INPUT_NAMES)
    assert len(set(wire.DIALOGUE_INPUT_NAMES)) == len(wire.DIALOGUE_INPUT_NAMES)
    outputs = (wire.DIALOGUE_OUTPUT_IDS, wire.SEQUENCE_LENGTH, wire.CUM_LOG_PROBS)
    assert sorted(_config_names("output", wire.DIALOGUE_MODEL)) == sorted(outputs)


@pytest.mark.parametrize("kind", wire.ERROR_KINDS, ids=lambda k: k.code)
def test_error_code_reads_back_every_prefix(kind):
    """A message that starts with a kind's prefix reads back as that kind, in any case."""
    assert wire.error_code(f"{kind.prefix}: details") == kind.code
    assert wire.error_code(f"{kind.prefix.upper()}: details", "StatusCode.INTERNAL") == kind.code
    assert kind.triton_code in TRITON_CODES


@pytest.mark.parametrize(
    "message, status, code",
    [
        ("connection refused", "StatusCode.UNAVAILABLE", "unavailable"),
        ("too slow", "StatusCode.DEADLINE_EXCEEDED", "unavailable"),
        ("Locally cancelled by application!", None, "cancelled"),
        ("stream closed", "StatusCode.CANCELLED", "cancelled"),
        ("something odd", None, "internal"),
        ("", "", "internal"),
        # Triton's words for a model unloaded under a stopping or reloading server
        ("Request for unknown model: 'chat' has no available versions", None, "unavailable"),
        ("Request for unknown model: 'nope' is not found", None, "internal"),
    ],
)
def test_error_code_falls_back_to_the_rpc_status(message, status, code):
    """Without a known prefix the RPC status decides; anything else is internal."""
    assert wire.error_code(message, status) == code


@pytest.mark.parametrize(
    "error, code, triton_code",
    [
        (StreamingError("x"), "internal", "INTERNAL"),
        (InvalidRequest("x"), "invalid_request", "INVALID_ARG"),
        (Overloaded("x"), "overloaded", "UNAVAILABLE"),
        (EngineStopped("x"), "unavailable", "UNAVAILABLE"),
        (Cancelled(), "cancelled", "CANCELLED"),
        (NonFiniteLogits("x"), "internal", "INTERNAL"),
        (MaskFailed("x"), "internal", "INTERNAL"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None,
)
def test_every_error_carries_its_kind(error, code, triton_code):
    """Each StreamingError's message reads back as its code and goes out with its Triton code."""
    assert error.kind.triton_code == triton_code
    assert wire.error_code(str(error)) == code
    assert str(error).startswith(error.category)


def test_every_error_class_is_covered():
    """No StreamingError subclass without a kind of its own (or an entry above)."""
    subclasses = {cls.__name__ for cls in StreamingError.__subclasses__()}
    expected = {
        "InvalidRequest",
        "Overloaded",
        "EngineStopped",
        "Cancelled",
        "NonFiniteLogits",
        "MaskFailed",
    }
    assert subclasses == expected
    assert {cls.kind for cls in StreamingError.__subclasses__()} <= set(wire.ERROR_KINDS)


def test_server_timing_round_trips_through_json():
    """to_json -> from_json gives the same record, every field read back (each set to a value of
    its own, none left at a default); the text holds exactly TIMING_KEYS and names its clock."""
    timing = wire.ServerTiming(*range(1, len(wire.TIMING_KEYS) + 1))
    text = timing.to_json()
    assert wire.ServerTiming.from_json(text) == timing
    assert wire.ServerTiming.from_json(text.encode()) == timing
    assert list(json.loads(text)) == ["clock", *wire.TIMING_KEYS]
    assert '"clock": "monotonic"' in text


def test_server_timing_absent_or_without_offset():
    """No timing tensor gives None; an older record without the wall offset reads as 0."""
    for absent in (None, "", b""):
        assert wire.ServerTiming.from_json(absent) is None
    record = {"received_ns": "1", "queued_ns": 2, "prefill_start_ns": 3, "emitted_ns": 4}
    assert wire.ServerTiming.from_json(record) == wire.ServerTiming(1, 2, 3, 4, 0)


def test_finish_reasons_are_the_vllm_strings():
    """Finish reasons travel as these strings."""
    assert [r.value for r in wire.FinishReason] == ["stop", "length", "cancelled", "error"]
