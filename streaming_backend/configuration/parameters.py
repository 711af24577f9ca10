"""A model's config.pbtxt `parameters` as a table: each one described once.

A `Parameter` row holds a key, its default as config.pbtxt spells it, its help, its kind (how the
string is parsed into a value and written back) and the settings field it fills. A model's
`ParameterTable` turns strings into typed values and back, gives `tokenstream serve` its options,
and renders the reference table of docs/configuration.md; tests check config.pbtxt and the docs
against it. Standard library only: the launcher reads it without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Kind:
    """How a parameter's string becomes a value and back."""

    parse: Callable[[str], Any]  # raises ValueError on a bad string
    format: Callable[[Any], str]
    metavar: str = "TEXT"


def _integer(low: int) -> Kind:
    def parse(text: str) -> int:
        value = int(text.strip())
        if value < low:
            raise ValueError(f"must be at least {low}")
        return value

    return Kind(parse, str, "N")


def _integer_or_auto(low: int) -> Kind:
    """An integer, or "auto" (None: the code chooses)."""
    number = _integer(low)

    def parse(text: str) -> int | None:
        return None if text.strip() == "auto" else number.parse(text)

    return Kind(parse, lambda value: "auto" if value is None else str(value), "{auto,N}")


def _choice(*options: str) -> Kind:
    def parse(text: str) -> str:
        value = text.strip()
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return value

    return Kind(parse, str, "{" + ",".join(options) + "}")


def _switch(text: str) -> bool:
    value = text.strip().lower()
    if value in ("on", "true", "1", "yes"):
        return True
    if value in ("off", "false", "0", "no"):
        return False
    raise ValueError("must be on or off")


def _milliseconds(text: str) -> float:
    """Milliseconds as written -> seconds."""
    value = float(text.strip()) / 1e3
    if not value >= 0:  # also NaN
        raise ValueError("must be a number of milliseconds >= 0")
    return value


TEXT = Kind(str, str)
OPTIONAL_TEXT = Kind(lambda text: text.strip() or None, lambda value: value or "", "TEXT")
SWITCH = Kind(_switch, lambda value: "on" if value else "off", "{on,off}")
MILLISECONDS = Kind(_milliseconds, lambda seconds: f"{seconds * 1e3:g}", "MS")  # value: seconds
integer = _integer
integer_or_auto = _integer_or_auto
choice = _choice


@dataclass(frozen=True)
class Parameter:
    """One config.pbtxt parameter of a model."""

    key: str
    default: str  # as config.pbtxt spells it
    help: str
    kind: Kind = TEXT
    field: str = ""  # the settings field it fills; "" = the key
    option: bool = False  # `tokenstream serve` has an option of its own for it

    @property
    def target(self) -> str:
        """The settings field this parameter fills."""
        return self.field or self.key

    def parse(self, text: str) -> Any:
        """The typed value of a string; ValueError naming the key when it is not valid."""
        try:
            return self.kind.parse(text)
        except ValueError as exc:
            raise ValueError(f"parameter {self.key}={text!r}: {exc}") from None

    def option_help(self) -> str:
        """The help of its `tokenstream serve` option: meaning and default."""
        return f"{self.help} (default {self.default})" if self.default else self.help


@dataclass(frozen=True)
class ParameterTable:
    """A model's parameters, in the order the docs list them."""

    model: str
    rows: tuple[Parameter, ...]

    def __iter__(self) -> Iterator[Parameter]:
        return iter(self.rows)

    def __contains__(self, key: object) -> bool:
        return any(p.key == key for p in self.rows)

    def __getitem__(self, key: str) -> Parameter:
        for parameter in self.rows:
            if parameter.key == key:
                return parameter
        raise KeyError(f"{self.model} has no parameter {key!r}")

    def defaults(self) -> dict[str, str]:
        """Every parameter's default, as config.pbtxt spells it."""
        return {p.key: p.default for p in self.rows}

    def default_values(self) -> dict[str, Any]:
        """Settings field -> typed default."""
        return {p.target: p.parse(p.default) for p in self.rows}

    def parse(self, params: Mapping[str, str]) -> dict[str, Any]:
        """Settings field -> typed value; a missing key keeps its default, unknown keys are
        ignored (Triton hands a model every parameter of its config)."""
        return {p.target: p.parse(params.get(p.key, p.default)) for p in self.rows}

    def format(self, values: Mapping[str, Any]) -> dict[str, str]:
        """Settings field -> value, as config.pbtxt strings (the inverse of parse)."""
        return {p.key: p.kind.format(values[p.target]) for p in self.rows}

    def markdown(self) -> str:
        """The reference table of docs/configuration.md."""
        lines = ["| parameter | default | meaning |", "| --- | --- | --- |"]
        for p in self.rows:
            default = f"`{p.default}`" if p.default else "empty"
            lines.append(f"| `{p.key}` | {default} | {p.help} |")
        return "\n".join(lines)
