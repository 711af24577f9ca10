"""The dialogue_model's converters (token ids in and out): a request's input arrays ->
GenerationRequest, and a GenerationResult -> output arrays. No Triton import (repository/
dialogue_model/1/model.py moves the arrays in and out of pb_utils), so both are tested in-process.

Every input carries Triton's batch dimension first: input_ids [1, L], each scalar [1, 1]. The
inputs that carry request keys (max_tokens, temperature, ...: request_keys.DIALOGUE_KEYS) are
checked against the table's ranges, as the chat model checks the same keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from streaming_backend.dialogue.generation import GenerationRequest, GenerationResult
from streaming_backend.errors import InvalidRequest
from streaming_backend.sampling.request_keys import (
    DIALOGUE_KEYS,
    MAX_SEED,
    MAX_TOKENS,
    NUMBER,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    RequestKey,
)
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.wire import (
    BEAM_WIDTH,
    CUM_LOG_PROBS,
    DIALOGUE_INPUT_IDS,
    DIALOGUE_INPUT_NAMES,
    DIALOGUE_OUTPUT_IDS,
    END_ID,
    LEN_PENALTY,
    PAD_ID,
    SEQUENCE_LENGTH,
)


@dataclass(frozen=True)
class DialogueRequest:
    """One parsed request: what to generate, and the id that pads its output."""

    generation: GenerationRequest
    pad_id: int | None  # None: the end id


def parse_dialogue_request(
    inputs: Mapping[str, np.ndarray], default_output_len: int
) -> DialogueRequest:
    """Validate one request's input arrays (copied out of Triton) into a DialogueRequest."""
    unknown = sorted(set(inputs) - set(DIALOGUE_INPUT_NAMES))
    if unknown:
        raise InvalidRequest(f"unknown input(s) {', '.join(unknown)}")
    ids = _prompt_ids(inputs.get(DIALOGUE_INPUT_IDS))
    scalar = {
        name: _scalar(name, array) for name, array in inputs.items() if name != DIALOGUE_INPUT_IDS
    }
    end_id = _integer(scalar, END_ID, None, low=0)
    keys = _request_keys(scalar)
    generation = GenerationRequest(
        prompt_ids=ids,
        max_new_tokens=keys.pop(MAX_TOKENS, default_output_len),
        beam_width=_integer(scalar, BEAM_WIDTH, 1, low=1),
        settings=_sampling(keys),
        end_ids=frozenset({end_id}) if end_id is not None else None,
        length_penalty=_finite(scalar, LEN_PENALTY, 1.0),
    )
    return DialogueRequest(generation, _integer(scalar, PAD_ID, None))


def dialogue_outputs(
    result: GenerationResult, output_len: int, pad_id: int
) -> dict[str, np.ndarray]:
    """Output arrays of one request: output_ids [1, W, output_len] padded with pad_id, etc."""
    beams = result.beams
    ids = np.full((1, len(beams), output_len), pad_id, dtype=np.int32)
    for row, beam in enumerate(beams):
        ids[0, row, : len(beam.tokens)] = beam.tokens
    return {
        DIALOGUE_OUTPUT_IDS: ids,
        SEQUENCE_LENGTH: np.array([[len(b.tokens) for b in beams]], dtype=np.int32),
        CUM_LOG_PROBS: np.array([[b.cum_log_prob for b in beams]], dtype=np.float32),
    }


def _prompt_ids(array: np.ndarray | None) -> tuple[int, ...]:
    """input_ids [1, L] (or [L]) -> the prompt; one prompt per request."""
    if array is None:
        raise InvalidRequest(f"{DIALOGUE_INPUT_IDS} is required")
    if not np.issubdtype(array.dtype, np.integer):
        raise InvalidRequest(f"{DIALOGUE_INPUT_IDS} must be INT32, got {array.dtype}")
    if array.ndim == 2 and array.shape[0] != 1:
        raise InvalidRequest(
            f"send one prompt per request: {DIALOGUE_INPUT_IDS} has shape {list(array.shape)}, "
            "expected [1, L] (Triton batches requests itself)"
        )
    if array.ndim > 2:
        raise InvalidRequest(
            f"{DIALOGUE_INPUT_IDS} must have shape [1, L], got {list(array.shape)}"
        )
    return tuple(int(i) for i in array.reshape(-1))


def _scalar(name: str, array: np.ndarray) -> float | int:
    if array.size != 1:
        raise InvalidRequest(f"{name} must hold one value (shape [1, 1]), got {array.size}")
    value = array.reshape(-1)[0]
    return value.item() if hasattr(value, "item") else value


def _integer(scalar, name: str, default: int | None, low: int | None = None) -> int | None:
    if name not in scalar:
        return default
    value = scalar[name]
    if isinstance(value, float) and value != int(value):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise InvalidRequest(f"{name} must be at least {low}, got {value}")
    return value


def _finite(scalar, name: str, default: float) -> float:
    value = float(scalar.get(name, default))
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value}")
    return value


def _request_keys(scalar) -> dict[str, Any]:
    """Request key -> value of each input given that carries one, in our terms and checked
    against the table's range under the input's name; an "off" value is left out."""
    keys = {}
    for row in DIALOGUE_KEYS:
        if row.dialogue in scalar:
            read = _finite if row.kind is NUMBER else _integer
            value = _checked(row, read(scalar, row.dialogue, 0))
            if value is not None:
                keys[row.key] = value
    return keys


def _checked(row: RequestKey, value: float | int) -> float | int | None:
    """A value in TensorRT-LLM's terms -> ours, checked against the row's range; None: off."""
    if row.key == TOP_P:  # runtime_top_p 0 = off (ours: 1.0), so the input takes [0, 1]
        value = replace(row.range, low_open=False).check(row.dialogue, value)
        return value if value > 0 else None
    if row.key == SEED and value > MAX_SEED:  # random_seed is UINT64: past our range it wraps
        value %= MAX_SEED + 1
    return row.range.check(row.dialogue, value)


def _sampling(keys: dict[str, Any]) -> SamplingSettings:
    """Greedy unless temperature is given, or runtime_top_p > 0 or runtime_top_k > 0 asks to
    sample (then temperature 1.0 unless given)."""
    asked = TEMPERATURE in keys or TOP_P in keys or keys.get(TOP_K, 0) > 0
    return SamplingSettings(**keys) if asked else SamplingSettings(**{**keys, TEMPERATURE: 0.0})
