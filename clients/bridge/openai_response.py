"""Chunks -> OpenAI answers: the streamed chunk objects (as server-sent events) and the whole
response, for chat completions and completions alike.

No I/O here. Token counts are the model's own (num_input_tokens, num_output_tokens), so `usage`
is what the engine counted, not a guess from the text.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from clients.bridge.openai_errors import ApiError
from clients.bridge.openai_request import CHAT
from clients.chunk import Chunk
from streaming_backend.wire import CANCELLED, FinishReason

SSE_DONE = b"data: [DONE]\n\n"
OPENAI_FINISH_REASONS = (FinishReason.STOP.value, FinishReason.LENGTH.value)


@dataclass
class Answer:
    """One answer as it is built: its id, the text and the token counts so far."""

    kind: str  # openai_request.CHAT or COMPLETION
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == CHAT else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())

    def add(self, chunk: Chunk) -> str:
        """Account one chunk; its text. A finish other than stop/length raises ApiError."""
        if chunk.num_input_tokens is not None:
            self.prompt_tokens = chunk.num_input_tokens
        self.completion_tokens += chunk.tokens
        self.texts.append(chunk.text)
        if chunk.finish_reason is not None:
            self.finish_reason = _finish_reason(chunk.finish_reason)
        return chunk.text

    def usage(self) -> dict[str, int]:
        """OpenAI's usage object."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _finish_reason(reason: str) -> str:
    if reason in OPENAI_FINISH_REASONS:
        return reason
    # "cancelled" reaches a client only when the engine itself stopped (shutdown, reload)
    message = f"{CANCELLED.prefix}: the server stopped this generation ({reason}); retry"
    raise ApiError(503, message, "server_error", None, CANCELLED.code, 1)


# ---- streamed: chunk objects ------------------------------------------------------------------
def _chunk(answer: Answer, choice: dict[str, Any]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if answer.kind == CHAT else "text_completion"
    payload = {
        "id": answer.id,
        "object": obj,
        "created": answer.created,
        "model": answer.model,
        "choices": [{"index": 0, **choice}],
    }
    return payload | ({"usage": None} if answer.include_usage else {})


def role_chunk(answer: Answer) -> dict[str, Any] | None:
    """The first chunk of a chat stream: the assistant role (None for completions)."""
    if answer.kind != CHAT:
        return None
    delta = {"role": "assistant", "content": ""}
    return _chunk(answer, {"delta": delta, "logprobs": None, "finish_reason": None})


def text_chunk(answer: Answer, text: str) -> dict[str, Any]:
    """One streamed piece of text (one per token the model produced)."""
    if answer.kind == CHAT:
        return _chunk(answer, {"delta": {"content": text}, "logprobs": None, "finish_reason": None})
    return _chunk(answer, {"text": text, "logprobs": None, "finish_reason": None})


def finish_chunk(answer: Answer) -> dict[str, Any]:
    """The chunk that carries the finish reason."""
    reason = answer.finish_reason or FinishReason.STOP.value
    if answer.kind == CHAT:
        return _chunk(answer, {"delta": {}, "logprobs": None, "finish_reason": reason})
    return _chunk(answer, {"text": "", "logprobs": None, "finish_reason": reason})


def usage_chunk(answer: Answer) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage: no choices, the usage."""
    payload = _chunk(answer, {})
    return payload | {"choices": [], "usage": answer.usage()}


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


# ---- not streamed: the whole answer ------------------------------------------------------------
def whole_response(answer: Answer) -> dict[str, Any]:
    """The non-streamed response: the whole text, the finish reason, the usage."""
    text = "".join(answer.texts)
    reason = answer.finish_reason or FinishReason.STOP.value
    if answer.kind == CHAT:
        choice = {
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": reason,
        }
        obj = "chat.completion"
    else:
        choice = {"text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    return {
        "id": answer.id,
        "object": obj,
        "created": answer.created,
        "model": answer.model,
        "choices": [{"index": 0, **choice}],
        "usage": answer.usage(),
    }


def models_list(model: str, created: int) -> dict[str, Any]:
    """GET /v1/models: the one served model."""
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: str, created: int) -> dict[str, Any]:
    """One model object."""
    return {"id": model, "object": "model", "created": created, "owned_by": "tokenstream"}
