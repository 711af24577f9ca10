"""Prompts: raw text, chat messages (rendered with the tokenizer's chat template) or token ids.

Beside this module: tool_prompt.py (tools in a chat prompt) and prompt_limits.py (a prompt checked
against the model, for both models).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from streaming_backend.errors import InvalidRequest
from streaming_backend.prompts.tool_prompt import (
    generic_messages,
    parse_tool_calls,
    parse_tools,
    template_messages,
    template_takes_tools,
)
from streaming_backend.wire import INPUT_IDS, MESSAGES, ROLES, TEXT_INPUT, TOOLS

# Chat prompts shipped with the package (English, Chinese, emoji, multi-turn, a system prompt):
# the default workload of the benchmarks and the tests' real-text prompts.
DEFAULT_PROMPTS_FILE = Path(__file__).resolve().parent.parent / "data" / "chat_prompts.jsonl"


def parse_messages(messages: str | bytes | Sequence[Any]) -> list[dict[str, Any]]:
    """Validate chat messages (a JSON string or a list) into [{"role", "content"}], keeping an
    assistant's "tool_calls" and a tool result's "tool_call_id"."""
    if isinstance(messages, (str, bytes)):
        try:
            messages = json.loads(messages)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep JSON
            raise InvalidRequest(f"messages is not valid JSON: {exc}") from None
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty JSON list of {role, content} objects")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content")
        role, content = message.get("role"), message.get("content")
        if content is None and message.get("tool_calls"):
            content = ""  # an assistant message that only calls tools
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string")
        parsed.append({"role": role, "content": content} | _tool_fields(message, role, i))
    return parsed


def _tool_fields(message: dict[str, Any], role: str, i: int) -> dict[str, Any]:
    """The tool-call keys a message may carry: tool_calls (assistant), tool_call_id (tool)."""
    fields = {}
    if message.get("tool_calls") and role == "assistant":
        fields["tool_calls"] = parse_tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")
    if isinstance(message.get("tool_call_id"), str) and role == "tool":
        fields["tool_call_id"] = message["tool_call_id"]
    return fields


def encode_prompt(
    tokenizer: Any,
    *,
    text: str | None = None,
    messages: str | bytes | Sequence[Any] | None = None,
    input_ids: Sequence[int] | None = None,
    tools: str | bytes | Sequence[Any] | None = None,
) -> list[int]:
    """Token ids of the prompt given by exactly one of text, messages or input_ids (tools go
    with messages)."""
    given = [
        name
        for name, v in ((TEXT_INPUT, text), (MESSAGES, messages), (INPUT_IDS, input_ids))
        if v is not None
    ]
    if len(given) != 1:
        raise InvalidRequest(
            "give exactly one of text_input, messages or input_ids"
            + (f" (got {', '.join(given)})" if given else "")
        )
    if tools is not None and messages is None:
        raise InvalidRequest(f"{TOOLS} needs {MESSAGES}")
    if text is not None:
        if not text.strip():
            raise InvalidRequest("text_input is empty")
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    elif messages is not None:
        ids = render_chat(tokenizer, parse_messages(messages), parse_tools(tools))
    else:
        ids = [int(i) for i in input_ids]
        vocabulary = len(tokenizer)
        outside = [i for i in ids if not 0 <= i < vocabulary]
        if outside:
            raise InvalidRequest(f"input_ids must be in [0, {vocabulary}); got {outside[:5]}")
    if not ids:
        raise InvalidRequest("the prompt is empty")
    return list(ids)


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Apply the tokenizer's chat template, ready for the assistant's answer. Tools and tool
    calls go through the template when it takes `tools`, else in the generic format."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model has no chat template: send text_input instead")
    own = bool(tools) and template_takes_tools(tokenizer)
    extra = {"tools": tools} if own else {}
    messages = template_messages(messages) if own else generic_messages(messages, tools)
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **extra
        )
    except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
        raise InvalidRequest(f"the chat template rejected these messages: {exc}") from None
    # The template already holds the special tokens it wants.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def load_chat_prompts(path: Path | None = None) -> list[list[dict[str, str]]]:
    """The chat conversations of a JSONL file ({"messages": [...]} per line); default: ours."""
    lines = (path or DEFAULT_PROMPTS_FILE).read_text(encoding="utf-8").splitlines()
    return [parse_messages(json.loads(line)[MESSAGES]) for line in lines if line.strip()]
