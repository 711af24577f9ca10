"""The request keys' table (streaming_backend/request_keys.py): its rows, and the settings that
take their fields from it."""

from __future__ import annotations

from dataclasses import fields

import pytest

from streaming_backend import wire
from streaming_backend.errors import InvalidRequest
from streaming_backend.request_keys import (
    INTEGER,
    NUMBER,
    REQUEST_KEYS,
    SAMPLING_KEYS,
    Range,
)
from streaming_backend.settings import SamplingSettings


def test_the_settings_have_a_field_per_row_with_its_default():
    """SamplingSettings' fields are the table's keys, in order, each with the row's default."""
    assert tuple(f.name for f in fields(SamplingSettings)) == SAMPLING_KEYS
    assert SamplingSettings() == SamplingSettings(**{row.key: row.default for row in REQUEST_KEYS})
    assert len(set(SAMPLING_KEYS)) == len(SAMPLING_KEYS)


@pytest.mark.parametrize("row", REQUEST_KEYS, ids=lambda row: row.key)
def test_every_row_is_consistent(row):
    """A range is given for numbers only and holds the default; an "off" value lies outside it;
    a dialogue tensor is one of the dialogue model's inputs."""
    if row.range is not None:
        assert row.kind in (NUMBER, INTEGER)
        assert row.default is None or row.range.check(row.key, row.default) == row.default
    if row.off is not None:
        with pytest.raises(InvalidRequest):
            row.range.check(row.key, row.off)
    assert row.dialogue is None or row.dialogue in wire.DIALOGUE_INPUT_NAMES
    assert row.models[0] == wire.CHAT_MODEL and (wire.DIALOGUE_MODEL in row.models) == bool(
        row.dialogue
    )


@pytest.mark.parametrize(
    "span, value, message",
    [
        (Range(0, 1, low_open=True), 0, "x must be in (0, 1], got 0"),
        (Range(0, 1, low_open=True), 1.5, "x must be in (0, 1], got 1.5"),
        (Range(1, 1_000_000), 1_000_001, "x must be in [1, 1e+06], got 1e+06"),
        (Range(0, 100), -1, "x must be in [0, 100], got -1"),
    ],
)
def test_a_range_refuses_what_lies_outside_it(span, value, message):
    """The message names the input, the range (short numbers) and the value."""
    with pytest.raises(InvalidRequest) as info:
        span.check("x", value)
    assert str(info.value) == f"invalid request: {message}"
