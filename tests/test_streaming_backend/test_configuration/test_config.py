"""Tests for streaming_backend/configuration/models.py: the model's settings and their defaults,
defined once."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
from conftest import REPO_ROOT

from streaming_backend.configuration.models import (
    CHAT_PARAMETERS,
    DIALOGUE_PARAMETERS,
    TABLES,
    DialogueSettings,
    EngineConfig,
    ModelSettings,
    parameter_strings,
    parse_memory,
    serve_options,
)
from streaming_backend.launcher.repository import read_parameters

CONFIGURATION_DOC = REPO_ROOT / "docs" / "configuration.md"


@pytest.mark.parametrize("model", sorted(TABLES))
def test_config_pbtxt_spells_the_default_settings(model) -> None:
    """Each repository/<model>/config.pbtxt sets exactly its table's parameters to the defaults."""
    text = (REPO_ROOT / "repository" / model / "config.pbtxt").read_text()
    assert read_parameters(text) == TABLES[model].defaults()


@pytest.mark.parametrize("model", sorted(TABLES))
def test_docs_table_states_the_table(model) -> None:
    """docs/configuration.md holds each model's table as the code renders it (key, default,
    meaning); on a change, paste the message's table into the doc."""
    expected = TABLES[model].markdown()
    assert expected in CONFIGURATION_DOC.read_text(), f"docs/configuration.md needs:\n{expected}"


def test_every_row_fills_a_settings_field() -> None:
    """Each parameter names a field of the settings its model reads, and every default parses."""
    chat_fields = {f.name for f in fields(EngineConfig)} | {f.name for f in fields(ModelSettings)}
    assert {p.target for p in CHAT_PARAMETERS} <= chat_fields
    dialogue_fields = {f.name for f in fields(DialogueSettings)} - {"engine"}
    assert {p.target for p in DIALOGUE_PARAMETERS} - dialogue_fields <= chat_fields


def test_serve_options_name_every_model_that_takes_them() -> None:
    """An option's models are all those whose table has its key (the launcher sets it on each),
    and a parameter has an option in every table or in none."""
    for parameter, models in serve_options():
        assert models == [name for name, table in TABLES.items() if parameter.key in table]
        assert all(table[parameter.key].option for name, table in TABLES.items() if name in models)


def test_dataclass_defaults_are_the_tables() -> None:
    """The typed defaults are what the tables' default strings parse to."""
    assert ModelSettings().parameters() == CHAT_PARAMETERS.defaults()
    dialogue = DialogueSettings()
    values = {p.key: getattr(dialogue, p.key, None) for p in DIALOGUE_PARAMETERS}
    values |= {
        p.key: getattr(dialogue.engine, p.key)
        for p in DIALOGUE_PARAMETERS
        if p.key in ({f.name for f in fields(EngineConfig)})
    }
    assert values == DIALOGUE_PARAMETERS.default_values()


def test_dialogue_settings_share_the_cores_among_instances(monkeypatch) -> None:
    """cpu_threads 0 divides the cores among the instances; a set value is kept."""
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    config = {"instance_group": [{"count": 4}], "parameters": {}}
    assert DialogueSettings.from_config(config).cpu_threads == 2
    config["parameters"] = {
        "cpu_threads": {"string_value": "3"},
        "max_beam_width": {"string_value": "2"},
    }
    settings = DialogueSettings.from_config(config)
    assert (settings.cpu_threads, settings.max_beam_width) == (3, 2)


def test_dialogue_instances_share_a_cache_fraction_and_hold_a_batch_of_beams() -> None:
    """A kv_cache_memory fraction is divided among the instances, a size is each one's; an
    instance's steps have room for max_batch_size requests of the widest beams."""
    config = {
        "max_batch_size": 16,
        "instance_group": [{"count": 2}],
        "parameters": {"max_beam_width": {"string_value": "4"}},
    }
    settings = DialogueSettings.from_config(config)
    assert settings.engine.kv_cache_memory == "0.125"
    assert settings.engine.max_streams == 64
    config["parameters"]["kv_cache_memory"] = {"string_value": "2GiB"}
    config["parameters"]["forward"] = {"string_value": "hf"}
    settings = DialogueSettings.from_config(config)
    assert (settings.engine.kv_cache_memory, settings.engine.forward) == ("2GiB", "hf")


@pytest.mark.parametrize(
    "params, message",
    [
        ({"max_beam_width": "0"}, "max_beam_width='0': must be at least 1"),
        ({"dtype": "int3"}, "dtype='int3': unknown dtype 'int3'; choose auto, float32"),
    ],
)
def test_bad_dialogue_parameters_are_refused_with_the_key(params, message) -> None:
    """A bad dialogue parameter fails at load with the key and the accepted values."""
    raw = {k: {"string_value": v} for k, v in params.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        DialogueSettings.from_config({"parameters": raw})


def test_parameter_strings_format_and_check_values() -> None:
    """Named values become config.pbtxt strings; a bad value or an unknown key is refused."""
    assert parameter_strings(max_streams=8, compile=True, model=None) == {
        "max_streams": "8",
        "compile": "on",
    }
    with pytest.raises(ValueError, match="max_streams='0'"):
        parameter_strings(max_streams=0)
    with pytest.raises(ValueError, match="no model has a parameter 'streams'"):
        parameter_strings(streams=2)


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
    with pytest.raises(ValueError, match="max_streams='0': must be at least 1"):
        ModelSettings.from_parameters({"max_streams": "0"})
    with pytest.raises(ValueError, match="invalid engine limits"):
        EngineConfig(max_streams=0)


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
