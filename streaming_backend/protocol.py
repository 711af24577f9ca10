"""The chat model's tensor interface (docs/interface.md) as plain Python: inputs -> request,
token events -> output arrays. No Triton import: repository/chat/1/model.py only wraps these
arrays in pb_utils tensors, so everything here is tested in-process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streaming_backend.errors import InvalidRequest
from streaming_backend.events import TokenEvent
from streaming_backend.settings import SamplingSettings

# Inputs (the vLLM backend's, then ours).
TEXT_INPUT = "text_input"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
MESSAGES = "messages"
INPUT_IDS = "input_ids"
RETURN_FINISH_REASON = "return_finish_reason"
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
RETURN_LOGPROBS = "return_logprobs"
RETURN_CUMULATIVE_LOGPROB = "return_cumulative_logprob"
RETURN_OUTPUT_IDS = "return_output_ids"
RETURN_TIMING = "return_timing"
RETURN_FLAGS = (
    RETURN_FINISH_REASON,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
    RETURN_LOGPROBS,
    RETURN_CUMULATIVE_LOGPROB,
    RETURN_OUTPUT_IDS,
    RETURN_TIMING,
)
BOOL_INPUTS = (STREAM, EXCLUDE_INPUT_IN_OUTPUT, *RETURN_FLAGS)
STRING_INPUTS = (TEXT_INPUT, SAMPLING_PARAMETERS, MESSAGES)
INPUT_NAMES = (*STRING_INPUTS, INPUT_IDS, *BOOL_INPUTS)

# Outputs.
TEXT_OUTPUT = "text_output"
FINISH_REASON = "finish_reason"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
LOGPROBS = "logprobs"
CUMULATIVE_LOGPROB = "cumulative_logprob"
OUTPUT_IDS = "output_ids"
TIMING = "timing"


@dataclass(frozen=True)
class ModelRequest:
    """One request's inputs, copied out of Triton's tensors and validated."""

    text: str | None = None
    messages: str | None = None
    input_ids: tuple[int, ...] | None = None
    settings: SamplingSettings = field(default_factory=SamplingSettings)
    stream: bool = False  # as the vLLM backend: one response unless asked to stream
    exclude_input: bool = False
    returns: frozenset[str] = frozenset()  # the return_* flags that were true

    def wants(self, flag: str) -> bool:
        """Whether the client set return_<flag>."""
        return f"return_{flag}" in self.returns


def parse_request(inputs: Mapping[str, np.ndarray], parameters: str | None = None) -> ModelRequest:
    """Build a ModelRequest from input arrays and the request's parameters JSON."""
    unknown = sorted(set(inputs) - set(INPUT_NAMES))
    if unknown:
        raise InvalidRequest(f"unknown input(s) {', '.join(unknown)}")
    flags = {name: _bool(name, inputs[name]) for name in BOOL_INPUTS if name in inputs}
    extra = _request_parameters(parameters)
    stream = flags.get(STREAM, extra.pop(STREAM, False))
    sampling = _string(SAMPLING_PARAMETERS, inputs.get(SAMPLING_PARAMETERS))
    settings = SamplingSettings.parse(extra | _json_object(sampling))
    ids = inputs.get(INPUT_IDS)
    return ModelRequest(
        text=_string(TEXT_INPUT, inputs.get(TEXT_INPUT)),
        messages=_string(MESSAGES, inputs.get(MESSAGES)),
        input_ids=tuple(int(i) for i in ids.reshape(-1)) if ids is not None else None,
        settings=settings,
        stream=bool(stream) if not isinstance(stream, str) else stream.lower() == "true",
        exclude_input=flags.get(EXCLUDE_INPUT_IN_OUTPUT, False),
        returns=frozenset(name for name in RETURN_FLAGS if flags.get(name)),
    )


def _string(name: str, array: np.ndarray | None) -> str | None:
    if array is None:
        return None
    if array.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one string, got {array.size}")
    value = array.reshape(-1)[0]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"{name} is not valid UTF-8") from None
    return str(value)


def _bool(name: str, array: np.ndarray) -> bool:
    if array.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one boolean, got {array.size}")
    return bool(array.reshape(-1)[0])


def _json_object(text: str | None) -> dict[str, Any]:
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"sampling_parameters is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequest("sampling_parameters must be a JSON object")
    return value


def _request_parameters(parameters: str | None) -> dict[str, Any]:
    """Request parameters (HTTP generate's "parameters"); Triton's own keys are left out."""
    if not parameters:
        return {}
    values = json.loads(parameters)
    return {k: v for k, v in values.items() if not k.startswith("triton_")}


@dataclass
class ResponseBuilder:
    """Turns one request's token events into output arrays (one per event when streaming)."""

    request: ModelRequest
    received_ns: int
    queued_ns: int = 0
    prompt_text: str = ""  # prepended to a non-streamed answer unless exclude_input_in_output
    _texts: list[str] = field(default_factory=list)
    _ids: list[int] = field(default_factory=list)
    _logprobs: list[float] = field(default_factory=list)
    _cumulative: float = 0.0

    def outputs(self, event: TokenEvent) -> dict[str, np.ndarray] | None:
        """Output arrays to send for this event; None while a non-streamed answer accumulates."""
        if event.logprobs:
            self._cumulative += sum(event.logprobs)
        if self.request.stream:
            return self._build(event, event.text, event.token_ids, event.logprobs or ())
        self._texts.append(event.text)
        self._ids.extend(event.token_ids)
        self._logprobs.extend(event.logprobs or ())
        if not event.final:
            return None
        text = "".join(self._texts)
        if not self.request.exclude_input:
            text = self.prompt_text + text
        return self._build(event, text, tuple(self._ids), tuple(self._logprobs))

    def _build(self, event, text, ids, logprobs) -> dict[str, np.ndarray]:
        out = {TEXT_OUTPUT: np.array([text.encode("utf-8")], dtype=np.object_)}
        want = self.request.wants
        if want("finish_reason") and event.final:
            out[FINISH_REASON] = np.array([event.finish_reason.value.encode()], dtype=np.object_)
        if want("num_input_tokens"):
            out[NUM_INPUT_TOKENS] = np.array([event.num_input_tokens], dtype=np.uint32)
        if want("num_output_tokens"):
            out[NUM_OUTPUT_TOKENS] = np.array([len(ids)], dtype=np.uint32)
        if want("output_ids"):
            out[OUTPUT_IDS] = np.array(ids, dtype=np.int64)
        if want("logprobs"):
            entries = [{"token_id": t, "logprob": p} for t, p in zip(ids, logprobs)]
            out[LOGPROBS] = np.array([json.dumps(entries).encode()], dtype=np.object_)
        if want("cumulative_logprob"):
            out[CUMULATIVE_LOGPROB] = np.array([self._cumulative], dtype=np.float32)
        if want("timing"):
            out[TIMING] = np.array([self._timing(event).encode()], dtype=np.object_)
        return out

    def _timing(self, event: TokenEvent) -> str:
        return json.dumps(
            {
                "clock": "monotonic",
                "received_ns": self.received_ns,
                "queued_ns": self.queued_ns or event.submitted_ns,
                "prefill_start_ns": event.scheduled_ns,
                "emitted_ns": event.emitted_ns,
                "wall_minus_monotonic_ns": time.time_ns() - time.monotonic_ns(),
            }
        )
