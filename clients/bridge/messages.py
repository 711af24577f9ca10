"""Client -> bridge: one websocket text frame in, one message value (or a ProtocolError) out.

No I/O here; the protocol's words are clients/bridge/protocol.py's. A `generate` becomes a
GenerateRequest; roles come from the wire contract and sampling keys from the request keys' table
(streaming_backend/sampling/request_keys.py), so the bridge accepts exactly what the model
accepts. Only shapes are checked: the model validates values and its message goes back to the
client as is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from clients.bridge import protocol as p
from clients.library.grpc_client import GenerateRequest
from streaming_backend.sampling.request_keys import ROWS, SAMPLING_KEYS
from streaming_backend.wire import INVALID_REQUEST, MESSAGES, ROLES

MAX_ID_LENGTH = 128


class ProtocolError(Exception):
    """A client message the bridge refuses; sent back as an error frame."""

    def __init__(self, code: str, message: str, gen_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.gen_id = gen_id


@dataclass(frozen=True)
class Generate:
    """A parsed `generate` message."""

    gen_id: str
    request: GenerateRequest


@dataclass(frozen=True)
class Cancel:
    """A parsed `cancel` message."""

    gen_id: str


@dataclass(frozen=True)
class Auth:
    """A parsed `auth` message."""

    token: str


def parse_message(raw: str | bytes) -> Generate | Cancel | Auth:
    """Validate one client frame into a message value; ProtocolError says what is wrong."""
    if isinstance(raw, bytes):
        raise ProtocolError(p.BAD_FRAME, "binary frames are not supported; send JSON text")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep JSON
        raise ProtocolError(p.BAD_FRAME, f"frame is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(p.BAD_FRAME, "frame must be a JSON object with a 'type' field")
    _check_text(data)
    kind = data.get(p.TYPE)
    if kind == p.AUTH:
        token = data.get(p.AUTH_TOKEN)
        if not isinstance(token, str):
            raise ProtocolError(p.BAD_FRAME, "auth needs a string 'token'")
        return Auth(token)
    if kind not in (p.GENERATE, p.CANCEL):
        raise ProtocolError(p.UNKNOWN_TYPE, f"unknown message type {kind!r}", _loose_id(data))
    gen_id = _parse_id(data)
    if kind == p.CANCEL:
        return Cancel(gen_id)
    return Generate(gen_id, _parse_request(data, gen_id))


def _check_text(data: dict) -> None:
    """Refuse strings that are not Unicode text, e.g. a lone surrogate ("\\ud800" is valid JSON).

    They cannot be encoded as UTF-8, so neither Triton nor the client could be sent them.
    """
    where = _invalid_text_at(data, "")
    if where is not None:
        message = f"{INVALID_REQUEST.prefix}: {where.lstrip('.')} is not valid Unicode text"
        raise ProtocolError(INVALID_REQUEST.code, f"{message} (a lone surrogate?)", _loose_id(data))


def _invalid_text_at(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) in `value` that UTF-8 cannot encode."""
    if isinstance(value, str):
        return None if _encodable(value) else path
    if isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        for key in value:
            if not _encodable(key):
                return f"{path} key"
        items = ((f"{path}.{k}", v) for k, v in value.items())
    else:
        return None
    for item_path, item in items:
        found = _invalid_text_at(item, item_path)
        if found is not None:
            return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _loose_id(data: dict) -> str | None:
    """The message's id when it is a usable one, for addressing an error to it."""
    gen_id = data.get(p.ID)
    usable = isinstance(gen_id, str) and 0 < len(gen_id) <= MAX_ID_LENGTH and _encodable(gen_id)
    return gen_id if usable else None


def _parse_id(data: dict) -> str:
    gen_id = _loose_id(data)
    if gen_id is None:
        raise ProtocolError(p.BAD_FRAME, f"'id' must be a string of 1 to {MAX_ID_LENGTH} chars")
    return gen_id


def _parse_request(data: dict, gen_id: str) -> GenerateRequest:
    """The GenerateRequest of a generate message (prompt or messages, params)."""
    prompt, messages = data.get(p.PROMPT), data.get(MESSAGES)
    if (prompt is None) == (messages is None):
        raise ProtocolError(p.BAD_FRAME, "give exactly one of 'prompt' and 'messages'", gen_id)
    if prompt is not None and not (isinstance(prompt, str) and prompt):
        raise ProtocolError(p.BAD_FRAME, "'prompt' must be a non-empty string", gen_id)
    if messages is not None:
        _check_messages(messages, gen_id)
    params = _parse_params(data.get(p.PARAMS, {}), gen_id)
    return GenerateRequest(prompt=prompt, messages=messages, sampling=params, return_timing=True)


def _check_messages(messages: Any, gen_id: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ProtocolError(p.BAD_FRAME, "'messages' must be a non-empty list", gen_id)
    for m in messages:
        if not (
            isinstance(m, dict)
            and set(m) == {p.ROLE, p.CONTENT}
            and m[p.ROLE] in ROLES
            and isinstance(m[p.CONTENT], str)
        ):
            roles = "|".join(ROLES)
            raise ProtocolError(
                p.BAD_FRAME, f'each message must be {{"role": {roles}, "content": string}}', gen_id
            )


def _parse_params(params: Any, gen_id: str) -> dict[str, Any]:
    """Shape checks only; the model validates values and its message comes back verbatim."""
    if not isinstance(params, dict):
        raise ProtocolError(p.BAD_PARAMS, "'params' must be an object", gen_id)
    unknown = sorted(set(params) - set(SAMPLING_KEYS))
    if unknown:
        allowed = ", ".join(sorted(SAMPLING_KEYS))
        raise ProtocolError(p.BAD_PARAMS, f"unknown params {unknown}; allowed: {allowed}", gen_id)
    for key, value in params.items():
        scalar = isinstance(value, (str, int, float, bool))
        container = ROWS[key].kind.container  # a list (of strings) or an object, for some kinds
        strings = container is list and isinstance(value, list)
        schema = container is dict and isinstance(value, dict)  # or its JSON text
        if not (scalar or schema or (strings and all(isinstance(s, str) for s in value))):
            raise ProtocolError(p.BAD_PARAMS, f"params.{key} has an unsupported type", gen_id)
    return dict(params)
