"""Chunks -> OpenAI answers: the streamed chunk objects (as server-sent events) and the whole
response, for chat completions and completions alike.

No I/O here. Token counts are the model's own (num_input_tokens, num_output_tokens), so `usage`
is what the engine counted, not a guess from the text.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clients.bridge.openai_errors import ApiError
from clients.bridge.openai_request import CHAT
from clients.bridge.openai_tools import ToolCall, ToolCallParser
from clients.library.chunk import Chunk
from streaming_backend.wire import CANCELLED, FinishReason

SSE_DONE = b"data: [DONE]\n\n"
OPENAI_FINISH_REASONS = (FinishReason.STOP.value, FinishReason.LENGTH.value)
TOOL_CALLS = "tool_calls"  # the finish reason of an answer that calls tools


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
    index: int = 0  # the choice's index (n > 1)
    logprobs: bool = False  # the client asked for logprobs
    tools: ToolCallParser | None = None  # set when the model may call tools
    logprob_entries: list[dict] = field(default_factory=list)  # the server's, every token's
    new_calls: list[ToolCall] = field(default_factory=list)  # completed, not yet streamed
    new_logprobs: list[dict] = field(default_factory=list)  # not yet streamed
    content: list[str] = field(default_factory=list)  # the text outside tool calls
    system_fingerprint: str | None = None  # the model's, from its responses (seed's promise)

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == CHAT else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())

    def choice(self, index: int) -> Answer:
        """Another choice of the same answer (n > 1): same id, its own index and state."""
        parser = ToolCallParser(self.tools.names) if self.tools is not None else None
        return Answer(
            self.kind, self.model, self.include_usage, self.id, self.created,
            index=index, logprobs=self.logprobs, tools=parser,
            system_fingerprint=self.system_fingerprint,
        )  # fmt: skip

    def add(self, chunk: Chunk) -> str:
        """Account one chunk; the content to send now (text outside tool calls). A finish
        other than stop/length raises ApiError."""
        if chunk.num_input_tokens is not None:
            self.prompt_tokens = chunk.num_input_tokens
        self.system_fingerprint = chunk.system_fingerprint or self.system_fingerprint
        self.completion_tokens += chunk.tokens
        self.texts.append(chunk.text)
        if self.logprobs and chunk.logprobs:
            self.logprob_entries.extend(chunk.logprobs)
            self.new_logprobs.extend(chunk.logprobs)
        text = chunk.text
        if self.tools is not None:
            text, calls = self.tools.feed(chunk.text)
            if chunk.finish_reason is not None:
                text += self.tools.finish()
            self.new_calls.extend(calls)
        self.content.append(text)
        if chunk.finish_reason is not None:
            self.finish_reason = _finish_reason(chunk.finish_reason)
            if self.tools is not None and self.tools.calls:
                self.finish_reason = TOOL_CALLS
        return text

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
        "system_fingerprint": answer.system_fingerprint,
        "choices": [{"index": answer.index, **choice}],
    }
    return payload | ({"usage": None} if answer.include_usage else {})


def delta_chunks(answer: Answer, text: str) -> list[dict[str, Any]]:
    """What one model response adds to a stream: its text (with the logprobs of the tokens so
    far unsent), then each tool call completed by it."""
    payloads = []
    if text or (answer.new_logprobs and not answer.new_calls):
        payloads.append(text_chunk(answer, text))
    for call in answer.new_calls:
        for delta in call.deltas():
            payloads.append(
                _chunk(answer, {"delta": {"tool_calls": [delta]}, **_no_finish(answer)})
            )
    answer.new_calls = []
    return payloads


def _no_finish(answer: Answer) -> dict[str, Any]:
    return {"logprobs": _take_logprobs(answer), "finish_reason": None}


def _take_logprobs(answer: Answer) -> dict[str, Any] | None:
    """The logprobs object of the tokens not yet sent (None when not asked)."""
    if not answer.logprobs:
        return None
    entries, answer.new_logprobs = answer.new_logprobs, []
    return _logprobs_object(answer, entries, len("".join(answer.texts)))


def _logprobs_object(answer: Answer, entries: list[dict], end: int) -> dict[str, Any]:
    """OpenAI's logprobs: chat's {"content": [...]} or completions' parallel lists."""
    if answer.kind == CHAT:
        return {"content": [_chat_logprob(e) for e in entries], "refusal": None}
    tokens = [e.get("token", "") for e in entries]
    offsets, at = [], end - sum(len(t) for t in tokens)
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            {t["token"]: t["logprob"] for t in e.get("top_logprobs", ())} for e in entries
        ],
        "text_offset": offsets,
    }


def _chat_logprob(entry: dict) -> dict[str, Any]:
    token = entry.get("token", "")
    top = [
        {"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode())}
        for t in entry.get("top_logprobs", ())
    ]
    return {
        "token": token,
        "logprob": entry["logprob"],
        "bytes": list(token.encode()),
        "top_logprobs": top,
    }


def role_chunk(answer: Answer) -> dict[str, Any] | None:
    """The first chunk of a chat stream: the assistant role (None for completions)."""
    if answer.kind != CHAT:
        return None
    delta = {"role": "assistant", "content": ""}
    return _chunk(answer, {"delta": delta, "logprobs": None, "finish_reason": None})


def text_chunk(answer: Answer, text: str) -> dict[str, Any]:
    """One streamed piece of text (one per token the model produced)."""
    if answer.kind == CHAT:
        return _chunk(answer, {"delta": {"content": text}, **_no_finish(answer)})
    return _chunk(answer, {"text": text, **_no_finish(answer)})


def finish_chunk(answer: Answer) -> dict[str, Any]:
    """The chunk that carries the finish reason."""
    reason = answer.finish_reason or FinishReason.STOP.value
    logprobs = _take_logprobs(answer) if answer.new_logprobs else None
    if answer.kind == CHAT:
        return _chunk(answer, {"delta": {}, "logprobs": logprobs, "finish_reason": reason})
    return _chunk(answer, {"text": "", "logprobs": logprobs, "finish_reason": reason})


def usage_chunk(answer: Answer | Sequence[Answer]) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage: no choices, the usage."""
    answers = _choices(answer)
    payload = _chunk(answers[0], {})
    return payload | {"choices": [], "usage": usage(answers)}


def usage(answers: Sequence[Answer]) -> dict[str, int]:
    """The usage of every choice together: the prompt once, each choice's tokens."""
    prompt = answers[0].prompt_tokens
    completion = sum(a.completion_tokens for a in answers)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _choices(answer: Answer | Sequence[Answer]) -> Sequence[Answer]:
    return [answer] if isinstance(answer, Answer) else answer


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


# ---- not streamed: the whole answer ------------------------------------------------------------
def whole_response(answer: Answer | Sequence[Answer]) -> dict[str, Any]:
    """The non-streamed response: each choice's whole text, its finish reason; the usage."""
    answers = _choices(answer)
    first = answers[0]
    return {
        "id": first.id,
        "object": "chat.completion" if first.kind == CHAT else "text_completion",
        "created": first.created,
        "model": first.model,
        "system_fingerprint": first.system_fingerprint,
        "choices": [_whole_choice(a) for a in answers],
        "usage": usage(answers),
    }


def _whole_choice(answer: Answer) -> dict[str, Any]:
    text = "".join(answer.texts)
    reason = answer.finish_reason or FinishReason.STOP.value
    logprobs = None
    if answer.logprobs:
        logprobs = _logprobs_object(answer, answer.logprob_entries, len(text))
    if answer.kind != CHAT:
        return {"index": answer.index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if answer.tools is not None and answer.tools.calls:
        shown = "".join(answer.content)
        message = {
            "role": "assistant",
            "content": shown or None,
            "tool_calls": [c.message() for c in answer.tools.calls],
        }
    return {
        "index": answer.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": reason,
    }


def models_list(model: str, created: int) -> dict[str, Any]:
    """GET /v1/models: the one served model."""
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: str, created: int) -> dict[str, Any]:
    """One model object."""
    return {"id": model, "object": "model", "created": created, "owned_by": "tokenstream"}
