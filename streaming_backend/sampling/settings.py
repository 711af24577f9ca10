"""Sampling settings: one frozen value, validated once where a request enters.

SamplingSettings has a field per row of the request keys' table (sampling/request_keys.py), with
the row's type and default; `parse` reads each value as its row says (its kind, its range).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import field, make_dataclass
from typing import Any

from streaming_backend.errors import InvalidRequest
from streaming_backend.sampling.request_keys import (
    BOOLEAN,
    CHOICE,
    GUIDED_KEYS,
    INTEGER,
    NUMBER,
    REQUEST_KEYS,
    ROWS,
    SCHEMA,
    STRINGS,
    TEXT,
    RequestKey,
)

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_GRAMMAR_CHARS = 100_000  # the text of one guided_* value (a schema, a regex, a grammar)
MAX_CHOICES = 1024


class _SettingsMethods:
    """What SamplingSettings does beyond holding its fields (those come from the table)."""

    @property
    def constrained(self) -> bool:
        """True when a guided_* key constrains the output."""
        return any(getattr(self, key) for key in GUIDED_KEYS)

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax, whatever top_p / top_k say."""
        return self.temperature == 0.0

    @classmethod
    def parse(cls, values: Mapping[str, Any] | str | None) -> SamplingSettings:
        """Validate client input (a mapping or a JSON object string); values may be strings."""
        if values is None:
            return cls()
        if isinstance(values, (str, bytes)):
            values = _parse_json_object(values)
        if not isinstance(values, Mapping):
            raise InvalidRequest("sampling_parameters must be a JSON object")
        unknown = sorted(k for k in values if k not in ROWS)
        if unknown:
            raise InvalidRequest(
                f"sampling_parameters: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join(sorted(ROWS))}"
            )
        settings = cls(**{key: _read(ROWS[key], value) for key, value in values.items()})
        guided = [key for key in GUIDED_KEYS if getattr(settings, key)]
        if len(guided) > 1:
            raise InvalidRequest(
                f"sampling_parameters: give at most one of {', '.join(GUIDED_KEYS)}; "
                f"got {', '.join(guided)}"
            )
        if settings.max_tokens is not None and settings.min_tokens > settings.max_tokens:
            raise InvalidRequest(
                f"sampling_parameters.min_tokens ({settings.min_tokens}) must not exceed "
                f"max_tokens ({settings.max_tokens})"
            )
        return settings


def _field(row: RequestKey) -> tuple[str, Any, Any]:
    """A row as a dataclass field: its key, its type (optional when the default is None)."""
    kind_type = row.kind.type if row.default is not None else row.kind.type | None
    return row.key, kind_type, field(default=row.default)


SamplingSettings = make_dataclass(
    "SamplingSettings",
    [_field(row) for row in REQUEST_KEYS],
    bases=(_SettingsMethods,),
    frozen=True,
    namespace={
        "__doc__": "Per-request sampling settings, a field per request key; `parse` builds one.",
        "__module__": __name__,
    },
)


def _read(row: RequestKey, value: Any) -> Any:
    """One client value as its row says: read as its kind, its "off" value mapped, range checked."""
    value = _READERS[row.kind](row.key, value)
    if row.off is not None and value == row.off:
        return row.default
    if row.range is not None:
        row.range.check(f"sampling_parameters.{row.key}", value)
    return value


def _parse_json_object(text: str | bytes) -> Any:
    try:
        return json.loads(text) if text.strip() else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"sampling_parameters is not valid JSON: {exc}") from None


def _number(key: str, value: Any) -> float:
    """A finite float from a number or a numeric string ("0.7")."""
    if isinstance(value, bool):
        raise InvalidRequest(f"sampling_parameters.{key} must be a number, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise InvalidRequest(
                f"sampling_parameters.{key} must be a number, got {value!r}"
            ) from None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"sampling_parameters.{key} must be a finite number, got {value!r}")
    return float(value)


def _integer(key: str, value: Any) -> int:
    """An int from an int, an integral float (32.0) or a string ("32")."""
    number = _number(key, value)
    if number != int(number):
        raise InvalidRequest(f"sampling_parameters.{key} must be an integer, got {value!r}")
    return int(number)


def _stop(key: str, value: Any) -> tuple[str, ...]:
    """A string or a list of strings (a JSON list inside a string is accepted too)."""
    if isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            pass  # a literal stop string that happens to start with "["
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise InvalidRequest(f"sampling_parameters.{key} must be a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"sampling_parameters.{key}: at most {MAX_STOP_STRINGS} strings")
    for s in items:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise InvalidRequest(
                f"sampling_parameters.{key}: each stop string must have 1 to "
                f"{MAX_STOP_LENGTH} characters, got {s!r}"
            )
    return tuple(items)


def _boolean(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise InvalidRequest(f"sampling_parameters.{key} must be true or false, got {value!r}")


def _text(key: str, value: Any) -> str:
    """A non-empty string of at most MAX_GRAMMAR_CHARS (a regex, a grammar)."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"sampling_parameters.{key} must be a non-empty string")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"sampling_parameters.{key}: at most {MAX_GRAMMAR_CHARS} characters")
    return value


def _json_schema(key: str, value: Any) -> str:
    """A JSON schema (an object, or its JSON text) -> compact JSON text (one cache key); the
    order of keys stays: it is the order in which the answer writes an object's properties."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequest(f"sampling_parameters.{key} is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequest(f"sampling_parameters.{key} must be a JSON schema (an object)")
    return _text(key, json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _choice(key: str, value: Any) -> tuple[str, ...]:
    """A non-empty list of non-empty strings (a JSON list inside a string is accepted too)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidRequest(f"sampling_parameters.{key} must be a non-empty list of strings")
    if len(value) > MAX_CHOICES or not all(isinstance(c, str) and c for c in value):
        raise InvalidRequest(
            f"sampling_parameters.{key} must hold 1 to {MAX_CHOICES} non-empty strings"
        )
    _text(key, "".join(value))  # bounds the total size
    return tuple(value)


# How a value of each kind is read from client JSON (numbers and booleans may arrive as strings)
_READERS = {
    NUMBER: _number,
    INTEGER: _integer,
    BOOLEAN: _boolean,
    TEXT: _text,
    STRINGS: _stop,
    CHOICE: _choice,
    SCHEMA: _json_schema,
}
