"""The one client-side type of a generation request and its inputs by wire tensor name; the
gRPC client turns these into tensors, the SSE client into a JSON body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streaming_backend.wire import (
    EXCLUDE_INPUT_IN_OUTPUT,
    INPUT_IDS,
    MESSAGES,
    RETURN_FINISH_REASON,
    RETURN_LOGPROBS,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
    RETURN_OUTPUT_IDS,
    RETURN_SYSTEM_FINGERPRINT,
    RETURN_TIMING,
    SAMPLING_PARAMETERS,
    STREAM,
    TEXT_INPUT,
    TOOLS,
)


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: exactly one of prompt, messages, input_ids, plus settings and flags."""

    prompt: str | None = None
    messages: Sequence[Mapping[str, str]] | None = None
    input_ids: Sequence[int] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None  # OpenAI's function tools (with messages)
    sampling: Mapping[str, Any] = field(default_factory=dict)
    stream: bool = True
    exclude_input_in_output: bool = True
    return_finish_reason: bool = True
    return_num_input_tokens: bool = True
    return_num_output_tokens: bool = True
    return_output_ids: bool = False
    return_logprobs: bool = False  # each token's logprob (and top_logprobs when asked)
    return_timing: bool = False
    return_system_fingerprint: bool = False  # what decides the numbers, on every response

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.prompt, self.messages, self.input_ids)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, messages, input_ids")
        # Copies, so a caller mutating its list afterwards cannot change a sent request.
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))
        if self.input_ids is not None:
            object.__setattr__(self, "input_ids", tuple(int(t) for t in self.input_ids))
        if self.tools is not None:
            object.__setattr__(self, "tools", tuple(dict(t) for t in self.tools))
        object.__setattr__(self, "sampling", dict(self.sampling))


def request_inputs(request: GenerateRequest) -> dict[str, str | bool | tuple[int, ...]]:
    """Input tensor name -> value: str for STRING inputs, bool for BOOL, a tuple for INPUT_IDS."""
    inputs: dict[str, str | bool | tuple[int, ...]] = {}
    if request.prompt is not None:
        inputs[TEXT_INPUT] = request.prompt
    elif request.messages is not None:
        inputs[MESSAGES] = json.dumps(list(request.messages), ensure_ascii=False)
        if request.tools:
            inputs[TOOLS] = json.dumps(list(request.tools), ensure_ascii=False)
    else:
        inputs[INPUT_IDS] = tuple(request.input_ids)
    if request.sampling:
        inputs[SAMPLING_PARAMETERS] = json.dumps(dict(request.sampling))
    inputs |= {
        STREAM: request.stream,
        EXCLUDE_INPUT_IN_OUTPUT: request.exclude_input_in_output,
        RETURN_FINISH_REASON: request.return_finish_reason,
        RETURN_NUM_INPUT_TOKENS: request.return_num_input_tokens,
        RETURN_NUM_OUTPUT_TOKENS: request.return_num_output_tokens,
        RETURN_OUTPUT_IDS: request.return_output_ids,
        RETURN_LOGPROBS: request.return_logprobs,
        RETURN_TIMING: request.return_timing,
        RETURN_SYSTEM_FINGERPRINT: request.return_system_fingerprint,
    }
    return inputs
