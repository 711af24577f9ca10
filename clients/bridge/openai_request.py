"""OpenAI request body -> ApiRequest (a GenerateRequest plus how to answer), or an ApiError.

No I/O here. Only shapes and the keys we cannot honour are checked: the model validates values
(ranges, lengths) and its own message goes back to the client as a 400. A key that would change
the answer and is not implemented is refused, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from clients.bridge.openai_errors import ApiError, invalid
from clients.bridge.openai_tools import Tools, parse_tool_calls, parse_tools
from clients.library.request import GenerateRequest
from streaming_backend.sampling.request_keys import (
    GUIDED_GRAMMAR,
    GUIDED_JSON,
    GUIDED_JSON_OBJECT,
    GUIDED_KEYS,
    MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    REQUEST_KEYS,
    ROWS,
    SEED,
    STOP,
    TOP_LOGPROBS,
)
from streaming_backend.wire import ROLES

CHAT, COMPLETION = "chat", "completion"
# Request keys this module reads itself: stop (a string or a list), guided_* (against
# response_format and tool_choice), and those OpenAI names otherwise (the table's `openai`).
READ_HERE = (STOP, *GUIDED_KEYS)
# Every other request key passes to the model under the same name, its value checked there: the
# OpenAI ones (temperature, top_p, seed) and the extras that vLLM accepts and the benchmark tools
# (genai-perf, AIPerf) send (top_k, min_tokens, ignore_eos, repetition_penalty).
SAMPLING_SAME_NAME = tuple(
    row.key for row in REQUEST_KEYS if not row.openai and row.key not in READ_HERE
)
TOKEN_LIMITS = (MAX_TOKENS, ROWS[MAX_TOKENS].openai)  # the old name and max_completion_tokens
# Keys that would change the answer, with the only values we can honour (None: absent).
ONLY_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}
CHAT_ONLY_DEFAULTS = ONLY_DEFAULTS
COMPLETION_ONLY_DEFAULTS = {
    **ONLY_DEFAULTS,
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}
CHAT_FEATURES = ("n", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice")
CHAT_FEATURES += ("parallel_tool_calls",)
COMPLETION_FEATURES = ("n", "logprobs")
MAX_N = 16  # choices per request
# Keys that do not change the answer (who asked, what to store): accepted and not used.
METADATA_KEYS = ("user", "metadata", "store", "service_tier")
COMMON_KEYS = ("model", "stream", "stream_options", STOP, *TOKEN_LIMITS, *SAMPLING_SAME_NAME)
COMMON_KEYS += GUIDED_KEYS  # vLLM's extras: guided decoding in the Triton dialect's names
CHAT_KEYS = frozenset(
    (*COMMON_KEYS, "messages", *CHAT_ONLY_DEFAULTS, *CHAT_FEATURES, *METADATA_KEYS)
)
COMPLETION_KEYS = frozenset(
    (*COMMON_KEYS, "prompt", *COMPLETION_ONLY_DEFAULTS, *COMPLETION_FEATURES, *METADATA_KEYS)
)
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
MESSAGE_KEYS = frozenset(("role", "content", "name", "tool_calls", "tool_call_id"))


@dataclass(frozen=True)
class ApiRequest:
    """One validated OpenAI request: what to generate and how to answer it."""

    kind: str  # CHAT or COMPLETION
    model: str
    request: GenerateRequest
    stream: bool
    include_usage: bool
    n: int = 1  # choices
    logprobs: int | None = None  # top_logprobs per token; None: no logprobs
    tools: Tools | None = None
    grammar_param: str | None = None  # the OpenAI field a grammar came from (its errors' param)

    def choice_requests(self) -> list[GenerateRequest]:
        """One GenerateRequest per choice; with a seed, choice i draws with seed + i."""
        seed = self.request.sampling.get(SEED)
        if self.n == 1 or seed is None:
            return [self.request] * self.n
        return [
            replace(self.request, sampling={**self.request.sampling, SEED: seed + i})
            for i in range(self.n)
        ]


def parse_chat(body: Any, served_model: str) -> ApiRequest:
    """Validate a /v1/chat/completions body."""
    body = _object(body)
    _check_keys(body, CHAT_KEYS, CHAT_ONLY_DEFAULTS)
    tools = parse_tools(body)
    messages = _messages(body.get("messages"))
    top = _chat_logprobs(body)
    guided = _response_format(body.get("response_format"))
    param = "response_format" if guided else None
    grammar = tools.grammar() if tools is not None else None
    if grammar is not None:
        if guided:
            message = "response_format cannot be combined with a required or named tool_choice"
            raise invalid(message, "response_format")
        guided, param = {GUIDED_GRAMMAR: grammar}, "tool_choice"
    extra = {"tools": tools, "grammar_param": param}
    given = tools.openai() if tools is not None else None
    return _api_request(
        CHAT, body, served_model, top, guided, extra, messages=messages, tools=given
    )


def parse_completion(body: Any, served_model: str) -> ApiRequest:
    """Validate a /v1/completions body."""
    body = _object(body)
    _check_keys(body, COMPLETION_KEYS, COMPLETION_ONLY_DEFAULTS)
    prompt, input_ids = _prompt(body.get("prompt"))
    top = _bounded(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    return _api_request(
        COMPLETION, body, served_model, top, {}, {}, prompt=prompt, input_ids=input_ids
    )


def check_model(model: Any, served_model: str) -> str:
    """The requested model name when it is the served one."""
    if model is None:
        raise invalid("you must provide a model parameter", "model", "missing_required_parameter")
    if model != served_model:
        raise ApiError(
            404,
            f"The model {model!r} does not exist; this server serves {served_model!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    return model


def _api_request(
    kind: str,
    body: Mapping,
    served_model: str,
    top: int | None,
    guided: Mapping[str, Any],
    extra: Mapping[str, Any],
    **prompt: Any,
) -> ApiRequest:
    model = check_model(body.get("model"), served_model)
    stream = _flag(body, "stream")
    include_usage = _include_usage(body.get("stream_options"), stream)
    sampling = _sampling(body)
    given = [key for key in GUIDED_KEYS if body.get(key) is not None]
    if given and guided:
        raise invalid(f"{given[0]} cannot be combined with {extra['grammar_param']}", given[0])
    sampling |= {key: body[key] for key in given} | dict(guided)
    if top:
        sampling[TOP_LOGPROBS] = top
    n = _bounded(body, "n", 1, MAX_N) or 1
    if n > 1 and SEED in sampling and not _is_int(sampling[SEED]):
        raise invalid("seed must be an integer", SEED)
    request = GenerateRequest(
        **prompt,
        sampling=sampling,
        return_timing=False,
        return_logprobs=top is not None,
        return_system_fingerprint=True,  # every answer and chunk names the server's numerics
    )
    return ApiRequest(kind, model, request, stream, include_usage, n, top, **extra)


def _bounded(body: Mapping, key: str, low: int, high: int) -> int | None:
    """An integer option in [low, high]; None when absent."""
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise invalid(f"{key} must be an integer from {low} to {high}, got {value!r}", key)
    return value


def _chat_logprobs(body: Mapping) -> int | None:
    """Chat's logprobs (true/false) and top_logprobs (0-20, only with logprobs true)."""
    wanted = _flag(body, "logprobs")
    top = _bounded(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _response_format(value: Any) -> dict[str, Any]:
    """response_format -> the guided_* sampling key it becomes ({} for text)."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {GUIDED_JSON_OBJECT: True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise invalid("response_format.json_schema needs a name", "response_format")
        if schema is not None and not isinstance(schema, Mapping):
            raise invalid("response_format.json_schema.schema must be an object", "response_format")
        # strict or not, the schema is enforced: the grammar admits only what it validates
        return {GUIDED_JSON: dict(schema) if schema is not None else {"type": "object"}}
    message = 'response_format.type must be "text", "json_object" or "json_schema"'
    raise invalid(message, "response_format")


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise invalid("the request body must be a JSON object")
    return body


def _check_keys(body: Mapping, allowed: frozenset[str], only_defaults: Mapping) -> None:
    """Refuse unknown keys and keys set to a value we cannot honour."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for key, honoured in only_defaults.items():
        value = body.get(key)
        if not any(value == h and type(value) is type(h) for h in honoured):
            shown = ", ".join("absent" if h is None else repr(h) for h in honoured)
            raise invalid(
                f"{key}={value!r} is not supported by this server (supported: {shown})",
                key,
                "unsupported_parameter",
            )


def _flag(body: Mapping, key: str) -> bool:
    value = body.get(key)
    if value not in (None, True, False):
        raise invalid(f"{key} must be true or false", key)
    return bool(value)


def _include_usage(options: Any, stream: bool) -> bool:
    """stream_options.include_usage; stream_options needs stream: true, as with OpenAI."""
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, Mapping) or set(options) - {"include_usage"}:
        raise invalid('stream_options must be {"include_usage": bool}', "stream_options")
    return _flag(options, "include_usage")


def _sampling(body: Mapping) -> dict[str, Any]:
    """The sampling_parameters of the request; values unchecked (the model checks them)."""
    sampling = {key: body[key] for key in SAMPLING_SAME_NAME if body.get(key) is not None}
    limits = {name: body[name] for name in TOKEN_LIMITS if body.get(name) is not None}
    if len(set(map(repr, limits.values()))) > 1:
        raise invalid("max_tokens and max_completion_tokens differ; give one", MAX_TOKENS)
    if limits:
        sampling[MAX_TOKENS] = next(iter(limits.values()))
    stop = body.get(STOP)
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise invalid("stop must be a string or a list of strings", STOP)
        if stop:
            sampling[STOP] = stop
    for key, value in sampling.items():
        if ROWS[key].kind.container is None and not isinstance(value, (int, float, bool, str)):
            raise invalid(f"{key} must be a number", key)
    return sampling


def _messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> [{"role", "content", "tool_calls"?}] with text content."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise invalid(f"{where} must be an object with role and content", where)
    extra = sorted(set(message) - MESSAGE_KEYS)
    if extra:
        raise invalid(f"{where}.{extra[0]} is not supported by this server", f"{where}.{extra[0]}")
    role = ROLE_ALIASES.get(message.get("role"), message.get("role"))
    if role not in ROLES:
        roles = ", ".join((*ROLES, *ROLE_ALIASES))
        raise invalid(f"{where}.role must be one of {roles}", f"{where}.role")
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise invalid(f"{where}.tool_calls: only assistant messages make calls", where)
    content = message.get("content")
    if calls and content is None:  # an assistant message that only calls tools
        content = ""
    parsed = {"role": role, "content": _content(content, f"{where}.content")}
    if calls:
        parsed["tool_calls"] = parse_tool_calls(calls, f"{where}.tool_calls")
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        parsed["tool_call_id"] = message["tool_call_id"]
    return parsed


def _content(content: Any, where: str) -> str:
    """A string, or the list-of-parts form with text parts only (joined by newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise invalid(f"{where} must be a string or a non-empty list of text parts", where)
    texts = []
    for i, part in enumerate(content):
        if not (isinstance(part, Mapping) and part.get("type") == "text"):
            raise invalid(f"{where}[{i}]: only text parts are supported", f"{where}[{i}]")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}[{i}].text must be a string", f"{where}[{i}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """A completion prompt: a string, a list of one string, or a list of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return None, prompt
    raise invalid(
        "prompt must be a non-empty string or list of token ids (one prompt per request)", "prompt"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
