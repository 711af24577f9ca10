"""SamplingSettings.parse: strings converted, bad values rejected with the key and range named."""

import pytest

from streaming_backend.errors import InvalidRequest
from streaming_backend.sampling.settings import SamplingSettings


@pytest.mark.parametrize(
    "given, expected",
    [
        ({}, SamplingSettings()),
        (None, SamplingSettings()),
        ("", SamplingSettings()),
        ({"max_tokens": "32"}, SamplingSettings(max_tokens=32)),
        (
            '{"max_tokens": "32", "temperature": "0.7"}',
            SamplingSettings(temperature=0.7, max_tokens=32),
        ),
        ({"max_tokens": 32.0}, SamplingSettings(max_tokens=32)),
        ({"temperature": 0}, SamplingSettings(temperature=0.0)),
        ({"top_p": "1"}, SamplingSettings(top_p=1.0)),
        ({"top_k": -1}, SamplingSettings(top_k=0)),
        ({"top_k": "40"}, SamplingSettings(top_k=40)),
        ({"seed": "7"}, SamplingSettings(seed=7)),
        ({"stop": "###"}, SamplingSettings(stop=("###",))),
        ({"stop": ["a", "bc"]}, SamplingSettings(stop=("a", "bc"))),
        ({"stop": '["a", "bc"]'}, SamplingSettings(stop=("a", "bc"))),
        ({"ignore_eos": "true"}, SamplingSettings(ignore_eos=True)),
        ({"ignore_eos": "0"}, SamplingSettings(ignore_eos=False)),
        ({"min_tokens": "4", "max_tokens": "4"}, SamplingSettings(min_tokens=4, max_tokens=4)),
        ({"repetition_penalty": "1.2"}, SamplingSettings(repetition_penalty=1.2)),
    ],
)
def test_valid_settings_are_converted(given, expected):
    """Numbers and booleans may arrive as strings, as genai-perf sends them."""
    assert SamplingSettings.parse(given) == expected


@pytest.mark.parametrize(
    "given, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"temprature": 1}, "unknown key(s) 'temprature'"),
        ({"top_p": 2}, "top_p must be in (0, 1], got 2"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
        ({"temperature": -1}, "temperature must be in [0, 100], got -1"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"max_tokens": 0}, "max_tokens must be in [1, 1000000], got 0"),
        ({"max_tokens": "3.5"}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be a number"),
        ({"top_k": -2}, "top_k must be in [0, 1000000], got -2"),
        ({"seed": -1}, "seed must be in [0,"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 100]"),
        ({"stop": ""}, "each stop string must have 1 to 256 characters"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),
        ({"stop": ["x"] * 17}, "at most 16 strings"),
        ({"ignore_eos": "maybe"}, "ignore_eos must be true or false"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens (5) must not exceed max_tokens (4)"),
    ],
)
def test_invalid_settings_name_the_key_and_range(given, message):
    """Each bad value raises InvalidRequest whose message says what was wrong."""
    with pytest.raises(InvalidRequest) as info:
        SamplingSettings.parse(given)
    assert message in str(info.value)
    assert str(info.value).startswith("invalid request: ")


def test_settings_are_frozen():
    """The settings value cannot change after validation."""
    settings = SamplingSettings()
    with pytest.raises(AttributeError):
        settings.temperature = 2.0  # type: ignore[misc]
