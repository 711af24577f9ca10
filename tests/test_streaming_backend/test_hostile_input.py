"""Hostile input the chaos suite found failing with `internal error`: absurdly deep JSON and
prompt ids outside the vocabulary are the client's mistake, refused as invalid requests."""

from __future__ import annotations

import numpy as np
import pytest

from streaming_backend.adapter.request import parse_request
from streaming_backend.errors import InvalidRequest
from streaming_backend.prompts import encode_prompt, parse_messages
from streaming_backend.wire import SAMPLING_PARAMETERS, TEXT_INPUT

DEEP_JSON = "[" * 100_000 + "]" * 100_000


def test_deep_sampling_parameters_are_an_invalid_request():
    """sampling_parameters nested 100,000 deep: InvalidRequest, not a RecursionError."""
    inputs = {
        TEXT_INPUT: np.array([b"hi"], dtype=np.object_),
        SAMPLING_PARAMETERS: np.array([DEEP_JSON.encode()], dtype=np.object_),
    }
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_request(inputs)


def test_deep_messages_are_an_invalid_request():
    """messages nested 100,000 deep: InvalidRequest."""
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_messages(DEEP_JSON)


@pytest.mark.parametrize("ids", [[10**9], [-5], [1, 2, -1]])
def test_prompt_ids_outside_the_vocabulary_are_an_invalid_request(tiny_loaded, ids):
    """input_ids beyond the tokenizer's vocabulary (or negative) are refused before use."""
    with pytest.raises(InvalidRequest, match="input_ids must be in"):
        encode_prompt(tiny_loaded.tokenizer, input_ids=ids)
