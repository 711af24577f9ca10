"""The request keys' table (streaming_backend/sampling/request_keys.py): what the settings, the
dialogue model and the docs take from it, and one range per key for both models."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
from conftest import REPO_ROOT

from streaming_backend import wire
from streaming_backend.dialogue.convert import parse_dialogue_request
from streaming_backend.errors import InvalidRequest
from streaming_backend.sampling.request_keys import (
    DIALOGUE_KEYS,
    INTEGER,
    NUMBER,
    REQUEST_KEYS,
    SAMPLING_KEYS,
    SEED,
    Range,
    markdown,
    shown,
)
from streaming_backend.sampling.settings import SamplingSettings

INTERFACE_DOC = REPO_ROOT / "docs" / "interface.md"


def test_the_settings_have_a_field_per_row_with_its_default():
    """SamplingSettings' fields are the table's keys, in order, each with the row's default."""
    assert tuple(f.name for f in fields(SamplingSettings)) == SAMPLING_KEYS
    assert SamplingSettings() == SamplingSettings(**{row.key: row.default for row in REQUEST_KEYS})
    assert len(set(SAMPLING_KEYS)) == len(SAMPLING_KEYS)


def test_docs_table_states_the_table():
    """docs/interface.md holds the table as request_keys.markdown() renders it; on a change,
    paste the message's table into the doc."""
    expected = markdown()
    assert expected in INTERFACE_DOC.read_text(), f"docs/interface.md needs:\n{expected}"


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
        (Range(1, 1_000_000), 1_000_001, "x must be in [1, 1000000], got 1000001"),
        (Range(0, 2), 2.25, "x must be in [0, 2], got 2.25"),
        (Range(0, 1), 1.0000001, "x must be in [0, 1], got 1.0000001"),
        (Range(0, 100), -1, "x must be in [0, 100], got -1"),
    ],
)
def test_a_range_refuses_what_lies_outside_it(span, value, message):
    """The message names the input, the range and the value, each number in the fewest digits
    that are still exactly it (never 1e+06 for 1000001)."""
    with pytest.raises(InvalidRequest) as info:
        span.check("x", value)
    assert str(info.value) == f"invalid request: {message}"


def _dialogue(row, value):
    """A dialogue_model request giving `value` on the row's tensor."""
    dtype = np.float32 if row.kind is NUMBER else np.int64
    inputs = {
        wire.DIALOGUE_INPUT_IDS: np.array([[1, 2]], dtype=np.int32),
        row.dialogue: np.array([[value]], dtype=dtype),
    }
    return parse_dialogue_request(inputs, default_output_len=4)


# random_seed is UINT64 on the dialogue model: values past 2**63 - 1 wrap instead of failing
SAME_HIGH_END = [row for row in DIALOGUE_KEYS if row.key != SEED]


@pytest.mark.parametrize("row", SAME_HIGH_END, ids=lambda row: row.key)
def test_both_models_take_the_same_range(row):
    """The chat model and the dialogue model take a key's highest value and refuse the next one,
    each naming its own input and the table's range (top_k once had no bound on one model)."""
    high, past = row.range.high, row.range.high * 2 if row.kind is NUMBER else row.range.high + 1
    SamplingSettings.parse({row.key: high})
    _dialogue(row, high)
    with pytest.raises(InvalidRequest) as chat:
        SamplingSettings.parse({row.key: past})
    assert f"sampling_parameters.{row.key} must be in {row.range}" in str(chat.value)
    with pytest.raises(InvalidRequest) as dialogue:
        _dialogue(row, past)
    assert f"{row.dialogue} must be in " in str(dialogue.value)
    assert str(dialogue.value).endswith(f"{shown(row.range.high)}], got {shown(past)}")
