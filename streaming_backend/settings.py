"""Sampling settings: one frozen value, validated once where a request enters."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from streaming_backend import wire
from streaming_backend.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_GRAMMAR_CHARS = 100_000  # the text of one guided_* value (a schema, a regex, a grammar)
MAX_CHOICES = 1024


@dataclass(frozen=True)
class SamplingSettings:
    """Per-request sampling settings; `SamplingSettings.parse` builds one from client input."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # cumulative-probability cut; always keeps at least one token
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    max_tokens: int | None = None  # None = engine default, bounded by the context
    min_tokens: int = 0  # EOS is suppressed until this many tokens exist
    seed: int | None = None  # None = a fresh random seed
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # alternatives per token when logprobs are returned
    # constrained decoding (at most one): streaming_backend.grammar turns it into a token mask
    guided_json: str | None = None  # a JSON schema, as canonical JSON text
    guided_json_object: bool = False
    guided_regex: str | None = None
    guided_choice: tuple[str, ...] | None = None
    guided_grammar: str | None = None

    @property
    def constrained(self) -> bool:
        """True when a guided_* key constrains the output."""
        return any(getattr(self, key) for key in wire.GUIDED_KEYS)

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
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in values if k not in known)
        if unknown:
            raise InvalidRequest(
                f"sampling_parameters: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join(sorted(known))}"
            )
        parsed = {key: _PARSERS[key](key, value) for key, value in values.items()}
        settings = cls(**parsed)
        guided = [key for key in wire.GUIDED_KEYS if getattr(settings, key)]
        if len(guided) > 1:
            raise InvalidRequest(
                f"sampling_parameters: give at most one of {', '.join(wire.GUIDED_KEYS)}; "
                f"got {', '.join(guided)}"
            )
        if settings.max_tokens is not None and settings.min_tokens > settings.max_tokens:
            raise InvalidRequest(
                f"sampling_parameters.min_tokens ({settings.min_tokens}) must not exceed "
                f"max_tokens ({settings.max_tokens})"
            )
        return settings


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


def _in_range(key: str, value: float, low: float, high: float, *, low_open: bool = False):
    below = value <= low if low_open else value < low
    if below or value > high:
        bracket = "(" if low_open else "["
        raise InvalidRequest(
            f"sampling_parameters.{key} must be in {bracket}{low:g}, {high:g}], got {value:g}"
        )
    return value


def _temperature(key: str, value: Any) -> float:
    return _in_range(key, _number(key, value), 0.0, 100.0)


def _top_p(key: str, value: Any) -> float:
    return _in_range(key, _number(key, value), 0.0, 1.0, low_open=True)


def _top_k(key: str, value: Any) -> int:
    k = _integer(key, value)
    if k == -1:  # the vLLM dialect's "off"
        return 0
    return int(_in_range(key, k, 0, 1_000_000))


def _repetition_penalty(key: str, value: Any) -> float:
    return _in_range(key, _number(key, value), 0.0, 100.0, low_open=True)


def _max_tokens(key: str, value: Any) -> int:
    return int(_in_range(key, _integer(key, value), 1, 1_000_000))


def _min_tokens(key: str, value: Any) -> int:
    return int(_in_range(key, _integer(key, value), 0, 1_000_000))


def _seed(key: str, value: Any) -> int:
    return int(_in_range(key, _integer(key, value), 0, MAX_SEED))


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


def _top_logprobs(key: str, value: Any) -> int:
    return int(_in_range(key, _integer(key, value), 0, MAX_TOP_LOGPROBS))


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


_PARSERS = {
    wire.TEMPERATURE: _temperature,
    wire.TOP_P: _top_p,
    wire.TOP_K: _top_k,
    wire.REPETITION_PENALTY: _repetition_penalty,
    wire.MAX_TOKENS: _max_tokens,
    wire.MIN_TOKENS: _min_tokens,
    wire.SEED: _seed,
    wire.STOP: _stop,
    wire.IGNORE_EOS: _boolean,
    wire.TOP_LOGPROBS: _top_logprobs,
    wire.GUIDED_JSON: _json_schema,
    wire.GUIDED_JSON_OBJECT: _boolean,
    wire.GUIDED_REGEX: _text,
    wire.GUIDED_CHOICE: _choice,
    wire.GUIDED_GRAMMAR: _text,
}
