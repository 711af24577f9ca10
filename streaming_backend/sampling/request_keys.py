"""The request keys: every `sampling_parameters` key as one row of one table, defined once.

A row holds the key, how its value is written (its Kind), its default, its range, its help, OpenAI's
name for it where that differs, and the dialogue_model's input tensor when that model takes it
too. The rest is read from the table: the keys the models and both bridges accept
(SAMPLING_KEYS), the fields of SamplingSettings and their checks (sampling/settings.py), the
dialogue model's checks (dialogue/convert.py), the OpenAI API's mapping
(clients/bridge/openai_request.py) and the table of docs/interface.md (`markdown`). A new key is
one row here plus its effect. Standard library only: the clients import it without torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from streaming_backend import wire
from streaming_backend.errors import InvalidRequest

# The keys that code names; a new key needs a constant only when code names it.
TEMPERATURE = "temperature"
TOP_P = "top_p"
TOP_K = "top_k"
REPETITION_PENALTY = "repetition_penalty"
MAX_TOKENS = "max_tokens"
MIN_TOKENS = "min_tokens"
SEED = "seed"
STOP = "stop"
IGNORE_EOS = "ignore_eos"
TOP_LOGPROBS = "top_logprobs"
SPECULATE = "speculate"
# constrained decoding as vLLM names it; at most one per request (sampling/grammar.py)
GUIDED_JSON = "guided_json"
GUIDED_JSON_OBJECT = "guided_json_object"
GUIDED_REGEX = "guided_regex"
GUIDED_CHOICE = "guided_choice"
GUIDED_GRAMMAR = "guided_grammar"
GUIDED_KEYS = (GUIDED_JSON, GUIDED_JSON_OBJECT, GUIDED_REGEX, GUIDED_CHOICE, GUIDED_GRAMMAR)

MAX_SEED = 2**63 - 1  # a torch.Generator's seed (the dialogue model's UINT64 seeds wrap to it)
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_COUNT = 1_000_000  # tokens (a length, a top_k): past any context or vocabulary, yet bounded


@dataclass(frozen=True)
class Kind:
    """How a key's value is written: the docs' word, the type it is parsed into, and the JSON
    container (list, dict) it may also arrive as; every value may arrive as a string."""

    word: str
    type: Any
    container: type | None = None


NUMBER = Kind("number", float)
INTEGER = Kind("integer", int)
BOOLEAN = Kind("boolean", bool)
TEXT = Kind("string", str)
STRINGS = Kind("string or list of strings", tuple[str, ...], list)
CHOICE = Kind("list of strings", tuple[str, ...], list)
SCHEMA = Kind("JSON schema", str, dict)  # parsed into canonical JSON text (one cache key)


def shown(value: int | float) -> str:
    """A number as a message shows it: a whole one in all its digits (1000001, not 1e+06, which
    would read as inside a range ending at 1e+06), any other in the fewest digits that are still
    exactly it (1.0000001, not 1)."""
    if isinstance(value, int) or (value.is_integer() and abs(value) < 1e15):
        return str(int(value))
    return repr(float(value))


@dataclass(frozen=True)
class Range:
    """The values a number may take: [low, high], or (low, high] when low itself is refused."""

    low: int | float
    high: int | float
    low_open: bool = False

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{shown(self.low)}, {shown(self.high)}]"

    def exact(self) -> str:
        """The range with every digit (the docs' table; messages use the short form)."""
        return f"{'(' if self.low_open else '['}{self.low}, {self.high}]"

    def check(self, name: str, value: int | float) -> int | float:
        """`value` when it is in the range; else InvalidRequest naming `name` and the range."""
        below = value <= self.low if self.low_open else value < self.low
        if below or value > self.high:
            raise InvalidRequest(f"{name} must be in {self}, got {shown(value)}")
        return value


@dataclass(frozen=True)
class RequestKey:
    """One key of `sampling_parameters`: one row of the table."""

    key: str
    kind: Kind
    default: Any  # None: the model decides (the help says how)
    help: str
    range: Range | None = None  # numbers only
    off: int | None = None  # a value outside the range that also means off (the default)
    openai: str = ""  # OpenAI's parameter where its name differs; "": the same name, passed as is
    dialogue: str | None = None  # the dialogue_model's input tensor for it; None: chat only

    @property
    def models(self) -> tuple[str, ...]:
        """The models that take it."""
        chat = (wire.CHAT_MODEL,)
        return (*chat, wire.DIALOGUE_MODEL) if self.dialogue else chat


REQUEST_KEYS = (
    RequestKey(
        TEMPERATURE,
        NUMBER,
        1.0,
        "0 = greedy (the dialogue_model is greedy unless a request asks to sample)",
        Range(0, 100),
        dialogue=wire.DIALOGUE_TEMPERATURE,
    ),
    RequestKey(
        TOP_P,
        NUMBER,
        1.0,
        "cumulative-probability cut; always keeps at least one token (dialogue_model: 0 = off)",
        Range(0, 1, low_open=True),
        dialogue=wire.RUNTIME_TOP_P,
    ),
    RequestKey(
        TOP_K,
        INTEGER,
        0,
        "keep the k likeliest tokens; 0 = off (-1 too, as vLLM)",
        Range(0, MAX_COUNT),
        off=-1,
        dialogue=wire.RUNTIME_TOP_K,
    ),
    RequestKey(
        "min_p",
        NUMBER,
        0.0,
        "drop tokens less likely than min_p times the likeliest one (after temperature); 0 = off",
        Range(0, 1),
    ),
    RequestKey(
        REPETITION_PENALTY,
        NUMBER,
        1.0,
        "CTRL-style, over prompt and output; 1 = off",
        Range(0, 100, low_open=True),
        dialogue=wire.DIALOGUE_REPETITION_PENALTY,
    ),
    RequestKey(
        MAX_TOKENS,
        INTEGER,
        None,
        "most new tokens; none: the model's default, bounded by its context",
        Range(1, MAX_COUNT),
        openai="max_completion_tokens",
        dialogue=wire.REQUEST_OUTPUT_LEN,
    ),
    RequestKey(
        MIN_TOKENS,
        INTEGER,
        0,
        "EOS is suppressed until this many tokens exist",
        Range(0, MAX_COUNT),
    ),
    RequestKey(
        SEED,
        INTEGER,
        None,
        "fixes the draws; none: a fresh random seed",
        Range(0, MAX_SEED),
        dialogue=wire.RANDOM_SEED,
    ),
    RequestKey(STOP, STRINGS, (), "text that ends the answer (not included in it)"),
    RequestKey(IGNORE_EOS, BOOLEAN, False, "go on past EOS, up to max_tokens"),
    RequestKey(
        TOP_LOGPROBS,
        INTEGER,
        0,
        "alternatives per token in the logprobs output (with return_logprobs)",
        Range(0, MAX_TOP_LOGPROBS),
        openai="logprobs",
    ),
    RequestKey(
        SPECULATE,
        BOOLEAN,
        True,
        "false: no speculative decoding for this request (where the server speculates); "
        "the answer is the same either way",
    ),
    RequestKey(GUIDED_JSON, SCHEMA, None, "the answer is JSON that this schema admits"),
    RequestKey(GUIDED_JSON_OBJECT, BOOLEAN, False, "true: the answer is a JSON object"),
    RequestKey(GUIDED_REGEX, TEXT, None, "a regular expression the whole answer matches"),
    RequestKey(GUIDED_CHOICE, CHOICE, None, "the answer is one of these strings"),
    RequestKey(
        GUIDED_GRAMMAR, TEXT, None, "a Lark grammar (llguidance's dialect; GBNF is converted)"
    ),
)
ROWS = {row.key: row for row in REQUEST_KEYS}
SAMPLING_KEYS = tuple(ROWS)  # what sampling_parameters may hold
DIALOGUE_KEYS = tuple(row for row in REQUEST_KEYS if row.dialogue)


def markdown() -> str:
    """The table of docs/interface.md."""
    lines = [
        "| key | type | default | range | meaning | OpenAI | models |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in REQUEST_KEYS:
        default = "none" if row.default in (None, ()) else json.dumps(row.default)
        span = row.range.exact() if row.range else ""
        openai = f"`{row.openai}`" if row.openai else "same"
        models = ", ".join(row.models) + (f" (`{row.dialogue}`)" if row.dialogue else "")
        cells = (f"`{row.key}`", row.kind.word, default, span, row.help, openai, models)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
