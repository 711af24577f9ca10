"""The dialogue_model's converters (streaming_backend.dialogue.convert), without a server."""

from __future__ import annotations

import numpy as np
import pytest

from streaming_backend.dialogue.beam import Hypothesis
from streaming_backend.dialogue.convert import dialogue_outputs, parse_dialogue_request
from streaming_backend.dialogue.generation import GenerationResult
from streaming_backend.errors import InvalidRequest
from streaming_backend.wire import (
    BEAM_WIDTH,
    CUM_LOG_PROBS,
    DIALOGUE_INPUT_IDS,
    DIALOGUE_OUTPUT_IDS,
    DIALOGUE_TEMPERATURE,
    END_ID,
    LEN_PENALTY,
    PAD_ID,
    RANDOM_SEED,
    REQUEST_OUTPUT_LEN,
    RUNTIME_TOP_K,
    RUNTIME_TOP_P,
    SEQUENCE_LENGTH,
)


def ids(*values):
    return np.array([values], dtype=np.int32)  # [1, L], as Triton hands it over


def scalar(value, dtype=np.int32):
    return np.array([[value]], dtype=dtype)  # [1, 1]


def test_the_operators_request_parses_to_greedy_with_the_default_length():
    """input_ids [1, 32] alone: greedy, request_output_len from the model's default."""
    prompt = np.random.randint(0, 1000, [1, 32]).astype(np.int32)
    parsed = parse_dialogue_request({DIALOGUE_INPUT_IDS: prompt}, default_output_len=16)
    assert parsed.generation.prompt_ids == tuple(prompt[0].tolist())
    assert parsed.generation.max_new_tokens == 16
    assert parsed.generation.beam_width == 1
    assert parsed.generation.settings.greedy
    assert parsed.generation.end_ids is None and parsed.pad_id is None


def test_every_optional_input_is_read():
    inputs = {
        DIALOGUE_INPUT_IDS: ids(5, 6),
        REQUEST_OUTPUT_LEN: scalar(7),
        BEAM_WIDTH: scalar(3),
        DIALOGUE_TEMPERATURE: scalar(0.5, np.float32),
        RUNTIME_TOP_P: scalar(0.9, np.float32),
        RUNTIME_TOP_K: scalar(40),
        RANDOM_SEED: scalar(2**64 - 1, np.uint64),
        END_ID: scalar(2),
        PAD_ID: scalar(0),
        LEN_PENALTY: scalar(0.5, np.float32),
    }
    parsed = parse_dialogue_request(inputs, 16)
    g = parsed.generation
    assert (g.max_new_tokens, g.beam_width, g.end_ids, parsed.pad_id) == (7, 3, {2}, 0)
    assert g.settings.temperature == 0.5 and g.settings.top_k == 40
    assert g.settings.top_p == pytest.approx(0.9)
    assert g.length_penalty == 0.5
    assert 0 <= g.settings.seed < 2**63


@pytest.mark.parametrize(
    "inputs, sampled, temperature",
    [
        ({RUNTIME_TOP_P: scalar(0.9, np.float32)}, True, 1.0),
        ({RUNTIME_TOP_K: scalar(5)}, True, 1.0),
        ({DIALOGUE_TEMPERATURE: scalar(0.0, np.float32)}, False, 0.0),
        ({RUNTIME_TOP_P: scalar(0.0, np.float32)}, False, 0.0),  # TRT-LLM's "off"
    ],
)
def test_sampling_only_when_asked(inputs, sampled, temperature):
    parsed = parse_dialogue_request({DIALOGUE_INPUT_IDS: ids(1, 2), **inputs}, 4)
    assert parsed.generation.settings.greedy is not sampled
    assert parsed.generation.settings.temperature == temperature


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({}, "input_ids is required"),
        ({DIALOGUE_INPUT_IDS: np.array([[1.0, 2.0]])}, "input_ids must be INT32"),
        ({DIALOGUE_INPUT_IDS: np.array([[1, 2], [3, 4]], np.int32)}, "one prompt per request"),
        ({DIALOGUE_INPUT_IDS: ids(1), REQUEST_OUTPUT_LEN: scalar(0)}, "request_output_len must be"),
        ({DIALOGUE_INPUT_IDS: ids(1), BEAM_WIDTH: scalar(0)}, "beam_width must be at least 1"),
        (
            {DIALOGUE_INPUT_IDS: ids(1), DIALOGUE_TEMPERATURE: scalar(np.nan, np.float32)},
            "temperature must be a finite number",
        ),
        (
            {DIALOGUE_INPUT_IDS: ids(1), RUNTIME_TOP_P: scalar(1.5, np.float32)},
            "runtime_top_p must be in [0, 1]",
        ),
        ({DIALOGUE_INPUT_IDS: ids(1), END_ID: scalar(-1)}, "end_id must be at least 0"),
        ({DIALOGUE_INPUT_IDS: ids(1), BEAM_WIDTH: np.array([[1, 2]], np.int32)}, "one value"),
        ({DIALOGUE_INPUT_IDS: ids(1), "text_input": np.array([b"x"])}, "unknown input"),
    ],
)
def test_bad_inputs_get_clear_messages(inputs, message):
    with pytest.raises(InvalidRequest) as error:
        parse_dialogue_request(inputs, 4)
    assert message in str(error.value)
    assert str(error.value).startswith("invalid request: ")


def test_outputs_are_padded_to_the_requested_length():
    """output_ids [1, W, request_output_len] with pad_id after each beam's end; lengths; scores."""
    result = GenerationResult((Hypothesis((7, 8, 9), -1.5, -0.5), Hypothesis((7, 2), -2.0, -1.0)))
    out = dialogue_outputs(result, output_len=4, pad_id=0)
    assert out[DIALOGUE_OUTPUT_IDS].dtype == np.int32
    assert out[DIALOGUE_OUTPUT_IDS].tolist() == [[[7, 8, 9, 0], [7, 2, 0, 0]]]
    assert out[SEQUENCE_LENGTH].tolist() == [[3, 2]]
    assert out[SEQUENCE_LENGTH].dtype == np.int32
    assert out[CUM_LOG_PROBS].dtype == np.float32
    assert out[CUM_LOG_PROBS].tolist() == [[-1.5, -2.0]]
