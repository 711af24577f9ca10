"""Wire tensors -> ModelRequest: every input, bad shapes and encodings, request parameters."""

import json

import numpy as np
import pytest

from streaming_backend import wire
from streaming_backend.adapter.request import parse_request
from streaming_backend.errors import InvalidRequest
from streaming_backend.sampling.settings import SamplingSettings


def _str(value: str | bytes) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


def _bool(value: bool) -> np.ndarray:
    return np.array([value], dtype=np.bool_)


def test_defaults_with_only_a_prompt():
    """A bare text_input: not streamed, the prompt kept in the answer, nothing extra returned."""
    request = parse_request({wire.TEXT_INPUT: _str("Hello")})
    assert request.text == "Hello" and request.messages is None and request.input_ids is None
    assert request.settings == SamplingSettings()
    assert not request.stream and not request.exclude_input and request.returns == frozenset()


def test_every_input_is_read():
    """Each input tensor lands in its field."""
    inputs = {
        wire.MESSAGES: _str('[{"role": "user", "content": "你好 🎉"}]'),
        wire.INPUT_IDS: np.array([[1, 2, 3]], dtype=np.int64),
        wire.SAMPLING_PARAMETERS: _str('{"temperature": 0.5, "max_tokens": "7", "stop": ["x"]}'),
        wire.STREAM: _bool(True),
        wire.EXCLUDE_INPUT_IN_OUTPUT: _bool(True),
    } | {flag: _bool(True) for flag in wire.RETURN_FLAGS}
    request = parse_request(inputs)
    assert request.messages == '[{"role": "user", "content": "你好 🎉"}]'
    assert request.input_ids == (1, 2, 3)
    assert request.settings == SamplingSettings(temperature=0.5, max_tokens=7, stop=("x",))
    assert request.stream and request.exclude_input
    assert all(request.wants(flag) for flag in wire.RETURN_FLAGS)


@pytest.mark.parametrize("flag", wire.RETURN_FLAGS)
def test_each_return_flag_alone(flag):
    """A return_* flag set true is wanted; one set false is not."""
    assert parse_request({flag: _bool(True)}).returns == {flag}
    assert parse_request({flag: _bool(False)}).returns == frozenset()


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"prompt": _str("x")}, "unknown input(s) prompt"),
        ({wire.TEXT_INPUT: np.array([b"a", b"b"], dtype=np.object_)}, "exactly one string, got 2"),
        ({wire.MESSAGES: np.array([], dtype=np.object_)}, "exactly one string, got 0"),
        ({wire.STREAM: np.array([True, False])}, "stream must hold exactly one boolean, got 2"),
        ({wire.TEXT_INPUT: _str(b"\xff\xfe bad")}, "text_input is not valid UTF-8"),
        ({wire.SAMPLING_PARAMETERS: _str(b"\xc3")}, "sampling_parameters is not valid UTF-8"),
        ({wire.SAMPLING_PARAMETERS: _str("{bad")}, "sampling_parameters is not valid JSON"),
        ({wire.SAMPLING_PARAMETERS: _str("[1, 2]")}, "sampling_parameters must be a JSON object"),
        ({wire.SAMPLING_PARAMETERS: _str('{"top_p": 0}')}, "top_p must be in (0, 1]"),
    ],
)
def test_bad_inputs_are_rejected(inputs, message):
    """Unknown names, wrong shapes, invalid UTF-8 and bad settings name the problem."""
    with pytest.raises(InvalidRequest) as info:
        parse_request(inputs)
    assert message in str(info.value)
    assert str(info.value).startswith("invalid request: ")


def test_empty_sampling_parameters_mean_defaults():
    """An empty or blank sampling_parameters string is no settings at all."""
    for text in ("", "  "):
        assert parse_request({wire.SAMPLING_PARAMETERS: _str(text)}).settings == SamplingSettings()


def test_request_parameters_carry_settings_and_the_stream_flag():
    """HTTP generate's "parameters": sampling keys and stream; Triton's own keys are ignored."""
    parameters = json.dumps(
        {"stream": True, "max_tokens": 4, "ignore_eos": "true", "triton_enable_empty_final": 1}
    )
    request = parse_request({wire.TEXT_INPUT: _str("x")}, parameters)
    assert request.stream
    assert request.settings == SamplingSettings(max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("value, stream", [("true", True), ("True", True), ("false", False)])
def test_string_booleans_in_request_parameters(value, stream):
    """A stream parameter sent as a string reads as the boolean it spells."""
    parameters = json.dumps({"stream": value})
    assert parse_request({wire.TEXT_INPUT: _str("x")}, parameters).stream is stream


def test_sampling_parameters_override_request_parameters():
    """Where both give a key, the sampling_parameters tensor wins; the stream tensor too."""
    inputs = {
        wire.SAMPLING_PARAMETERS: _str('{"max_tokens": 9}'),
        wire.STREAM: _bool(False),
    }
    request = parse_request(inputs, json.dumps({"max_tokens": 4, "seed": 1, "stream": True}))
    assert request.settings == SamplingSettings(max_tokens=9, seed=1)
    assert not request.stream


def test_unknown_request_parameter_is_rejected():
    """A request parameter that is no sampling key fails like an unknown sampling key."""
    with pytest.raises(InvalidRequest, match="unknown key"):
        parse_request({wire.TEXT_INPUT: _str("x")}, json.dumps({"temprature": 1}))
