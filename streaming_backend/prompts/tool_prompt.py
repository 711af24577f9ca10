"""Tools in a chat prompt: through the model's chat template when it takes `tools`, else in a
generic format any chat model can follow (docs/openai.md).

The generic format describes the functions in the system message (one JSON object each) and asks
for one line per call, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; an assistant's
earlier calls are written back in that form and tool results stay `tool` messages. The bridge
parses the answer back into calls (clients/bridge/openai_tools.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from streaming_backend.errors import InvalidRequest
from streaming_backend.wire import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOLS

MAX_TOOLS = 128


def parse_tools(tools: str | bytes | Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """Validate the tools input (OpenAI's function tools, as JSON or a list); None when absent."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes)):
        try:
            tools = json.loads(tools)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequest(f"{TOOLS} is not valid JSON: {exc}") from None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"{TOOLS} must be a JSON list of at most {MAX_TOOLS} function tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            shape = '{"type": "function", "function": {"name": ..., "parameters": ...}}'
            raise InvalidRequest(f"{TOOLS}[{i}] must be {shape}")
        if "parameters" in function:
            check_parameters(function["parameters"], f"{TOOLS}[{i}].function.parameters")
    return tools or None


def check_parameters(schema: Any, where: str) -> None:
    """A function's parameters must be a JSON schema that compiles, as response_format's must,
    whatever tool_choice says: InvalidRequest naming `where` if not."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where} must be a JSON schema object")
    problem = _schema_problem(json.dumps(schema, sort_keys=True))
    if problem:
        raise InvalidRequest(f"{where} is not a valid JSON schema: {problem}")


@functools.lru_cache(maxsize=256)  # an agent sends the same tools with every turn
def _schema_problem(schema: str) -> str:
    """What llguidance finds wrong with a JSON schema (its text); "" when it compiles."""
    import llguidance

    from streaming_backend.sampling.grammar import JSON_OPTIONS

    build = llguidance.LLMatcher
    try:
        source = build.grammar_from_json_schema(json.loads(schema), defaults=JSON_OPTIONS)
    except Exception as exc:  # llguidance's own errors (ValueError, RuntimeError)
        return str(exc).strip()
    return build.validate_grammar(source).strip()


def parse_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls: [{"id"?, "type"?, "function": {name, arguments}}]."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where} must be a list")
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            function = {}
        named = isinstance(function.get("name"), str)
        if not (named and isinstance(function.get("arguments", {}), (str, dict))):
            raise InvalidRequest(f"{where}[{i}] must be {{function: {{name, arguments}}}}")
    return calls


def template_takes_tools(tokenizer: Any) -> bool:
    """True when the model's chat template reads the `tools` variable."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a chat template that takes tools: each call's arguments as an object.

    Templates write `tool_call.function.arguments | tojson` (Qwen 2.5, Llama 3.1), which would
    encode OpenAI's JSON text a second time; arguments that are not valid JSON stay as given.
    """
    return [_with_parsed_arguments(m) if m.get("tool_calls") else m for m in messages]


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = call["function"]
        arguments = _parsed(function.get("arguments", {}))
        calls.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": calls}


def _parsed(arguments: str | Mapping[str, Any]) -> Any:
    """JSON text as the value it encodes; anything else (an object, broken JSON) as given."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            pass  # written back as given: the model made it so
    return arguments


def generic_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, str]]:
    """Messages as plain {role, content}: calls written out, the tools in the system message."""
    plain = [{"role": m["role"], "content": _text_of(m)} for m in messages]
    if not tools:
        return plain
    described = instructions(tools)
    if plain[0]["role"] == "system":
        plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{described}"}
        return plain
    return [{"role": "system", "content": described}, *plain]


def instructions(tools: list[dict[str, Any]]) -> str:
    """The system message's description of the tools and of how to call them."""
    return "\n".join(
        [
            "You can call the following functions. Each is described as a JSON object:",
            *(json.dumps(_description(t["function"]), ensure_ascii=False) for t in tools),
            "To call a function, answer with nothing but one line per call, each exactly:",
            f'{TOOL_CALL_OPEN}{{"name": "<function name>", "arguments": {{<JSON arguments>}}}}'
            f"{TOOL_CALL_CLOSE}",
            "Results come back in messages from the tool role. "
            "When no function is needed, answer in plain text.",
        ]
    )


def format_call(name: str, arguments: str | Mapping[str, Any]) -> str:
    """One call as the model writes it; arguments as JSON text (OpenAI's form) or an object."""
    call = {"name": name, "arguments": _parsed(arguments)}
    return f"{TOOL_CALL_OPEN}{json.dumps(call, ensure_ascii=False)}{TOOL_CALL_CLOSE}"


def _description(function: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("name", "description", "parameters")
    return {k: function[k] for k in keys if function.get(k)}


def _text_of(message: Mapping[str, Any]) -> str:
    """A message's content, with an assistant's earlier tool calls in the call format."""
    calls = message.get("tool_calls") or []
    lines = [message["content"]] if message["content"] else []
    lines += [format_call(c["function"]["name"], c["function"].get("arguments", {})) for c in calls]
    return "\n".join(lines)
