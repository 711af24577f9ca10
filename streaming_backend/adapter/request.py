"""Wire tensors -> parsed request: a request's input arrays (copied out of Triton) become one
validated ModelRequest. No Triton import, so it is tested in-process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streaming_backend.errors import InvalidRequest
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.wire import (
    BOOL_INPUTS,
    EXCLUDE_INPUT_IN_OUTPUT,
    INPUT_IDS,
    INPUT_NAMES,
    MESSAGES,
    RETURN_FLAGS,
    SAMPLING_PARAMETERS,
    STREAM,
    TEXT_INPUT,
    TOOLS,
)


@dataclass(frozen=True)
class ModelRequest:
    """One request's inputs, copied out of Triton's tensors and validated."""

    text: str | None = None
    messages: str | None = None
    input_ids: tuple[int, ...] | None = None
    tools: str | None = None  # JSON: the functions the model may call (with messages)
    settings: SamplingSettings = field(default_factory=SamplingSettings)
    stream: bool = False  # as the vLLM backend: one response unless asked to stream
    exclude_input: bool = False
    returns: frozenset[str] = frozenset()  # the return_* flags that were true

    def wants(self, flag: str) -> bool:
        """Whether the client set this return_* flag (a wire.RETURN_* name)."""
        return flag in self.returns


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
        tools=_string(TOOLS, inputs.get(TOOLS)),
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
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep JSON
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
