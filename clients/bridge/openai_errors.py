"""OpenAI's error object and status codes: what the API answers when it cannot answer.

No I/O here. `{"error": {"message", "type", "param", "code"}}` with 400 for invalid requests
(the model's own message), 401 without the token, 404 for unknown models and paths, 429 with
Retry-After when the engine's queue is full, 503 with Retry-After when Triton or the model is down.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from streaming_backend.wire import (
    CANCELLED,
    INTERNAL,
    INVALID_REQUEST,
    OVERLOADED,
    SAMPLING_PARAMETERS,
    TOOLS,
    UNAVAILABLE,
)

RETRY_AFTER_S = 1
# The category of a GenerationError (streaming_backend.wire) -> status, OpenAI type, Retry-After.
STATUS_OF_CODE: dict[str, tuple[int, str, int | None]] = {
    INVALID_REQUEST.code: (400, "invalid_request_error", None),
    OVERLOADED.code: (429, "rate_limit_error", RETRY_AFTER_S),
    UNAVAILABLE.code: (503, "server_error", RETRY_AFTER_S),
    CANCELLED.code: (503, "server_error", RETRY_AFTER_S),  # the engine shut down under it
    INTERNAL.code: (500, "server_error", None),
}
# The field a model's message names: a sampling key, or a tool's parameters schema.
_PARAM = re.compile(rf"{SAMPLING_PARAMETERS}\.(\w+)|({TOOLS}\[\d+\]\.function\.parameters)")


@dataclass(eq=False)  # not frozen: Python sets __traceback__ on exceptions
class ApiError(Exception):
    """An answer in OpenAI's error format."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    def body(self) -> dict[str, Any]:
        """The JSON body: OpenAI's error object."""
        fields = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": fields | {"code": self.code}}

    def headers(self) -> dict[str, str]:
        """Retry-After when retrying later can help."""
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 for a request this API refuses before it reaches the model."""
    return ApiError(400, message, "invalid_request_error", param, code)


def from_generation_error(code: str, message: str) -> ApiError:
    """The API's answer to a failed generation (a GenerationError's code and message)."""
    status, kind, retry = STATUS_OF_CODE.get(code, STATUS_OF_CODE[INTERNAL.code])
    match = _PARAM.search(message) if status == 400 else None
    param = match and (match.group(1) or match.group(2))
    return ApiError(status, message, kind, param, code, retry)


def not_ready(triton_url: str) -> ApiError:
    """A 503 while Triton or the model is not ready."""
    message = f"{UNAVAILABLE.prefix}: Triton at {triton_url} is not ready; retry shortly"
    return ApiError(503, message, "server_error", None, UNAVAILABLE.code, RETRY_AFTER_S)


def unauthorized() -> ApiError:
    """A 401: the bridge has a token and the request did not carry it."""
    message = "missing or wrong API key: send the bridge's token as 'Authorization: Bearer'"
    return ApiError(401, message, "invalid_request_error", None, "invalid_api_key")


def forbidden_origin(origin: str) -> ApiError:
    """A 403 for a browser page of another origin."""
    return ApiError(403, f"origin {origin!r} not allowed", "invalid_request_error", None, None)


def path_error(status: int, method: str, path: str) -> ApiError:
    """404 for an unknown path, 405 for a wrong method."""
    if status == 405:
        return ApiError(405, f"{method} is not allowed on {path}", code="method_not_allowed")
    return ApiError(404, f"unknown path {path}", code="not_found")
