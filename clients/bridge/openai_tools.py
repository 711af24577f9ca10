"""Tool calls on /v1/chat/completions: tools and tool_choice checked, forced calls turned into
a grammar, and the answer's calls parsed back.

No I/O here. The model gets the tools and the history's calls as they are (the `tools` input,
messages with `tool_calls`); it renders them with its chat template when that takes tools, else
in the generic format of streaming_backend/prompts/tool_prompt.py, where a call is one line

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

`tool_choice` "required" or a named function is enforced with a grammar (guided_grammar), so the
answer is nothing but such calls, whose arguments validate against the function's JSON schema;
"auto" lets the model choose, and "none" leaves the tools out of the prompt. The answer's text is
parsed back into OpenAI `tool_calls` (`ToolCallParser`), incrementally when streaming.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clients.bridge.openai_errors import invalid
from streaming_backend.wire import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

CALL_OPEN, CALL_CLOSE = TOOL_CALL_OPEN, TOOL_CALL_CLOSE
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 4  # calls one answer may hold when tool_choice is "required"
NONE, AUTO, REQUIRED = "none", "auto", "required"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# JSON in the calls as json.dumps writes it (llguidance's options, inside the schema)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class Tools:
    """A request's tools and how the model must use them."""

    tools: tuple[Tool, ...]
    choice: str  # NONE, AUTO, REQUIRED, or the name of the one function to call
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The answer must be calls (a grammar enforces it)."""
        return self.choice not in (NONE, AUTO)

    def grammar(self) -> str | None:
        """The Lark grammar of a forced answer (guided_grammar); None when the model chooses."""
        if not self.forced:
            return None
        named = [t for t in self.tools if self.choice in (REQUIRED, t.name)]
        calls, definitions = [], {}
        for tool in named:
            parameters, found = _hoist_definitions(tool.name, tool.parameters)
            calls.append(_call_schema(tool.name, parameters))
            definitions |= found
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {**schema, "$defs": definitions, "x-guidance": JSON_STYLE}
        repeat = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}'
        several = self.parallel and self.choice == REQUIRED
        start = f"start: call {repeat}" if several else "start: call"
        opening, closing = json.dumps(CALL_OPEN), json.dumps(CALL_CLOSE)
        return f"{start}\ncall: {opening} body {closing}\nbody: %json {json.dumps(schema)}"

    def openai(self) -> list[dict[str, Any]] | None:
        """The tools as OpenAI writes them: the model's `tools` input (None with "none")."""
        if self.choice == NONE:
            return None
        return [{"type": "function", "function": _description(t)} for t in self.tools]


def _description(tool: Tool) -> dict[str, Any]:
    described = {"name": tool.name, "parameters": dict(tool.parameters)}
    return described | ({"description": tool.description} if tool.description else {})


def _call_schema(name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call: the function's name and arguments that fit its parameters."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": dict(parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


DEFINITION_KEYS = ("$defs", "definitions")


def _hoist_definitions(name: str, schema: Any) -> tuple[Any, dict[str, Any]]:
    """A function's parameters with their $defs moved out (to the call grammar's root, where
    "#/$defs/..." points), renamed "<function>.<def>" so two functions' defs never clash."""
    definitions = {}
    for key in DEFINITION_KEYS:
        found = schema.get(key) if isinstance(schema, Mapping) else None
        for def_name, value in (found if isinstance(found, Mapping) else {}).items():
            definitions[f"{name}.{def_name}"] = value
    prefixes = {f"#/{key}/": f"#/$defs/{name}." for key in DEFINITION_KEYS}

    def rewrite(node: Any) -> Any:
        if isinstance(node, Mapping):
            out = {k: rewrite(v) for k, v in node.items() if k not in DEFINITION_KEYS}
            ref = out.get("$ref")
            for old, new in prefixes.items():
                if isinstance(ref, str) and ref.startswith(old):
                    out["$ref"] = new + ref[len(old) :]
            return out
        return [rewrite(v) for v in node] if isinstance(node, list) else node

    return rewrite(schema), {k: rewrite(v) for k, v in definitions.items()}


# ---- the request: tools, tool_choice, parallel_tool_calls, and the messages ------------------
def parse_tools(body: Mapping[str, Any]) -> Tools | None:
    """The request's tools and tool_choice; None without tools (then tool_choice must be absent
    or "none")."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel not in (True, False):
        raise invalid("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, NONE):
            raise invalid("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise invalid(f"tools must be a list of at most {MAX_TOOLS} function tools", "tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools: each function needs its own name", "tools")
    return Tools(tools, _choice(choice, names), parallel)


def _tool(tool: Any, where: str) -> Tool:
    if not (isinstance(tool, Mapping) and tool.get("type") == "function"):
        raise invalid(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise invalid(f"{where}.function must be an object", f"{where}.function")
    name = function.get("name")
    if not (isinstance(name, str) and NAME_PATTERN.match(name)):
        message = f"{where}.function.name must be 1-64 letters, digits, '_' or '-'"
        raise invalid(message, f"{where}.function.name")
    parameters = function.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(parameters, Mapping):
        message = f"{where}.function.parameters must be a JSON schema object"
        raise invalid(message, f"{where}.function.parameters")
    description = function.get("description") or ""
    if not isinstance(description, str):
        message = f"{where}.function.description must be a string"
        raise invalid(message, f"{where}.function.description")
    return Tool(name, description, parameters)


def _choice(choice: Any, names: Sequence[str]) -> str:
    """tool_choice: "none", "auto" (the default), "required" or {"type": "function", ...}."""
    if choice is None:
        return AUTO
    if choice in (NONE, AUTO, REQUIRED):
        return choice
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not (isinstance(choice, Mapping) and choice.get("type") == "function" and name):
        message = 'tool_choice must be "none", "auto", "required" or a named function'
        raise invalid(message, "tool_choice")
    if name not in names:
        raise invalid(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return name


def parse_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, checked: [{id, type, function: {name, arguments}}]."""
    if not isinstance(calls, list):
        raise invalid(f"{where} must be a list", where)
    checked = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        ok = isinstance(function, Mapping) and isinstance(function.get("name"), str)
        if not (ok and isinstance(function.get("arguments", ""), str)):
            message = f"{where}[{i}] must be {{id, type, function: {{name, arguments}}}}"
            raise invalid(message, f"{where}[{i}]")
        arguments = function.get("arguments", "")
        function = {**function, "arguments": arguments}
        checked.append({"id": call.get("id"), "type": "function", "function": function})
    return checked


# ---- the answer: text -> tool calls ------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    """One call the model made."""

    index: int
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def message(self) -> dict[str, Any]:
        """As in a non-streamed message's tool_calls."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}

    def deltas(self) -> list[dict[str, Any]]:
        """As streamed: the call's id and name, then its arguments."""
        head = self.message() | {"index": self.index}
        head["function"] = {"name": self.name, "arguments": ""}
        return [head, {"index": self.index, "function": {"arguments": self.arguments}}]


@dataclass
class ToolCallParser:
    """Splits an answer's text, as it streams in, into content and tool calls."""

    names: frozenset[str]
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""  # text not yet given out
    _in_call: bool = False
    _pending_space: str = ""  # whitespace given out only if more content follows

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now) after more text."""
        self._buffer += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buffer.find(CALL_CLOSE)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE) :]
                self._in_call = False
                call = self._call(body)
                if call is None:  # not a call of ours: it stays text
                    content += self._content(f"{CALL_OPEN}{body}{CALL_CLOSE}")
                else:
                    calls.append(call)
                continue
            start = self._buffer.find(CALL_OPEN)
            if start < 0:
                keep = _partial_marker(self._buffer)
                content += self._content(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            content += self._content(self._buffer[:start])
            self._buffer, self._in_call = self._buffer[start + len(CALL_OPEN) :], True
        return content, calls

    def finish(self) -> str:
        """Content still held back at the end (an unfinished call stays text)."""
        rest = (CALL_OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return self._content(rest) if rest.strip() else ""

    def _content(self, text: str) -> str:
        """Text to give out: whitespace waits until something else follows it."""
        if not text.strip():
            self._pending_space += text
            return ""
        text, self._pending_space = self._pending_space + text, ""
        return text

    def _call(self, body: str) -> ToolCall | None:
        try:
            parsed = json.loads(body)
        except ValueError:
            return None
        if not isinstance(parsed, dict) or parsed.get("name") not in self.names:
            return None
        arguments = parsed.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        text = json.dumps(arguments, ensure_ascii=False)
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        call = ToolCall(len(self.calls), call_id, parsed["name"], text)
        self.calls.append(call)
        return call


def _partial_marker(text: str) -> int:
    """How many characters at the end of `text` could begin CALL_OPEN (held back)."""
    for size in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
