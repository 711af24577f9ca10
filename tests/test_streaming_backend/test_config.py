"""Tests for streaming_backend/config.py: the model's settings and their defaults, defined once."""

from __future__ import annotations

import re

import pytest
from conftest import REPO_ROOT

from streaming_backend.config import (
    PARAMETER_HELP,
    EngineConfig,
    ModelSettings,
    default_parameters,
    parse_memory,
)
from streaming_backend.launcher.repository import read_parameters

DOCS_TABLE_HEADER = "| parameter | default | meaning |"


def documented_parameter_rows() -> dict[str, tuple[str, str]]:
    """docs/configuration.md's table of model parameters: key -> (default as written, meaning)."""
    lines = (REPO_ROOT / "docs" / "configuration.md").read_text().splitlines()
    start = lines.index(DOCS_TABLE_HEADER) + 2  # past the header and the |---| line
    rows = {}
    for line in lines[start:]:
        match = re.fullmatch(r"\| `(\w+)` \| (.*?) \| (.*?) \|", line)
        if match is None:
            break
        rows[match[1]] = (match[2], match[3])
    return rows


def test_chat_config_pbtxt_spells_the_default_settings() -> None:
    """repository/chat/config.pbtxt sets every parameter to exactly the dataclass default."""
    text = (REPO_ROOT / "repository" / "chat" / "config.pbtxt").read_text()
    assert read_parameters(text) == default_parameters()


def test_documented_table_states_the_default_settings() -> None:
    """docs/configuration.md's parameter table lists each parameter with its default and its
    help text."""
    expected = {
        key: (f"`{value}`" if value else "empty", PARAMETER_HELP[key])
        for key, value in default_parameters().items()
    }
    assert documented_parameter_rows() == expected


def test_every_parameter_has_help() -> None:
    """The help table and the parameters name the same keys."""
    assert PARAMETER_HELP.keys() == default_parameters().keys()


def test_missing_parameters_keep_the_defaults() -> None:
    """A config without parameters gives the default settings, the engine's included."""
    assert ModelSettings.from_config({}) == ModelSettings()
    assert ModelSettings.from_parameters({}).engine == EngineConfig()


def test_parameters_round_trip() -> None:
    """parameters() and from_parameters() are inverses (milliseconds <-> seconds)."""
    engine = EngineConfig(
        max_streams=4,
        queue_limit=0,
        default_max_tokens=7,
        test_first_token_delay_s=0.3,
        test_token_delay_s=0.05,
    )
    settings = ModelSettings(model="/m", dtype="float32", engine=engine, cancel_check_s=0.01)
    assert ModelSettings.from_parameters(settings.parameters()) == settings


def test_from_config_reads_tritons_json_form() -> None:
    """Triton gives parameters as {"string_value": ...}; an empty model means the default."""
    config = {
        "parameters": {
            "model": {"string_value": ""},
            "max_streams": {"string_value": "8"},
            "cancel_check_ms": {"string_value": "25"},
            "suffix": {"string_value": "ignored"},
        }
    }
    settings = ModelSettings.from_config(config)
    assert settings.model is None and settings.engine.max_streams == 8
    assert settings.cancel_check_s == pytest.approx(0.025)
    assert settings.engine.queue_limit == EngineConfig().queue_limit


def test_bad_engine_limits_are_refused() -> None:
    """A parameter that makes no engine (no stream slot) fails at load time, clearly."""
    with pytest.raises(ValueError, match="invalid engine limits"):
        ModelSettings.from_parameters({"max_streams": "0"})


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("0.5", (None, 0.5)),
        ("1", (None, 1.0)),
        ("4GiB", (4 * 2**30, None)),
        ("512MiB", (512 * 2**20, None)),
        ("1.5GiB", (3 * 2**29, None)),
        ("2000000", (2_000_000, None)),
    ],
)
def test_kv_cache_memory_is_a_fraction_or_a_size(text, parsed):
    """A number in (0, 1] is a fraction of free memory; a size has a unit or is a byte count."""
    assert parse_memory(text) == parsed


@pytest.mark.parametrize("text", ["0", "-1", "lots", "4GB", "1.5", "GiB", ""])
def test_bad_kv_cache_memory_is_refused_clearly(text):
    """Anything else is refused with a message that shows both accepted forms."""
    with pytest.raises(ValueError, match="fraction in \\(0, 1\\] such as 0.5 or a size"):
        parse_memory(text)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("forward", "fast", "forward must be one of auto, compact, hf"),
        ("prefix_cache", "yes", "prefix_cache must be one of on, prompts, off"),
        ("prefill_chunk_tokens", 0, "prefill_chunk_tokens must be >= 1"),
    ],
)
def test_engine_settings_are_checked(field, value, message):
    """A bad forward, prefix-cache mode or chunk size fails at load with a clear message."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})
