"""Tests for streaming_backend/launcher/repository.py: the config.pbtxt rewrite, the copy."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT, write_echo_model

from streaming_backend.launcher.repository import (
    make_runtime_repository,
    patch_parameters,
    read_parameters,
)

MODELS = ("chat", "dialogue_model", "echo")

PATCH_TABLE = [
    pytest.param(
        'parameters { key: "model" value: { string_value: "a" } }\n',
        {"model": "b"},
        'parameters { key: "model" value: { string_value: "b" } }\n',
        id="replace-existing",
    ),
    pytest.param(
        'parameters {\n  key: "dtype"\n  value: {\n    string_value: "auto"\n  }\n}\n',
        {"dtype": "float32"},
        'parameters {\n  key: "dtype"\n  value: {\n    string_value: "float32"\n  }\n}\n',
        id="replace-multiline",
    ),
    pytest.param(
        'parameters [ { key: "model", value: { string_value: "a" } } ]\n',
        {"model": "b"},
        'parameters [ { key: "model", value: { string_value: "b" } } ]\n',
        id="replace-in-list-form",
    ),
    pytest.param(
        'name: "chat"\n',
        {"max_streams": "4"},
        'name: "chat"\nparameters { key: "max_streams" value: { string_value: "4" } }\n',
        id="add-new-key",
    ),
    pytest.param(
        'parameters { key: "a" value: { string_value: "1" } }\n'
        'parameters { key: "b" value: { string_value: "2" } }\n',
        {"b": "3"},
        'parameters { key: "a" value: { string_value: "1" } }\n'
        'parameters { key: "b" value: { string_value: "3" } }\n',
        id="keep-other-keys",
    ),
    pytest.param(
        '# parameters { key: "model" value: { string_value: "old" } }\n',
        {"model": "new"},
        '# parameters { key: "model" value: { string_value: "old" } }\n'
        'parameters { key: "model" value: { string_value: "new" } }\n',
        id="ignore-commented-entry",
    ),
    pytest.param(
        'parameters { key: "model" value: { string_value: "say \\"hi\\"" } }',
        {"model": 'C:\\m "x"'},
        'parameters { key: "model" value: { string_value: "C:\\\\m \\"x\\"" } }',
        id="escape-quotes-and-backslashes",
    ),
]


@pytest.mark.parametrize(("text", "mapping", "expected"), PATCH_TABLE)
def test_patch_parameters(text: str, mapping: dict[str, str], expected: str) -> None:
    """patch_parameters replaces a key's string_value or appends an entry, leaving the rest."""
    assert patch_parameters(text, mapping) == expected


@pytest.mark.parametrize(("text", "mapping", "expected"), PATCH_TABLE)
def test_read_parameters_sees_what_patch_wrote(text, mapping, expected) -> None:
    """read_parameters returns each patched value exactly, escapes undone, comments skipped."""
    assert read_parameters(expected).items() >= mapping.items()


def test_read_parameters_ignores_commented_entries() -> None:
    """A commented-out entry is not a parameter; the live one is."""
    text = (
        '# parameters { key: "model" value: { string_value: "old" } }\n'
        'parameters { key: "dtype" value: { string_value: "auto" } }  # "x"\n'
    )
    assert read_parameters(text) == {"dtype": "auto"}


def test_runtime_repository_patches_config_and_links_the_rest(echo_repository: Path) -> None:
    """The runtime copy has patched configs, links to version folders, and leaves the source."""
    original = (echo_repository / "echo" / "config.pbtxt").read_text()
    runtime = make_runtime_repository(echo_repository, {"suffix": "?"})
    try:
        config = (runtime / "echo" / "config.pbtxt").read_text()
        assert read_parameters(config) == {"suffix": "?"}
        assert (runtime / "echo" / "1").resolve() == (echo_repository / "echo" / "1").resolve()
        assert (echo_repository / "echo" / "config.pbtxt").read_text() == original
    finally:
        shutil.rmtree(runtime)


def test_runtime_repository_of_a_missing_folder_fails(tmp_path: Path) -> None:
    """A repository that does not exist is a clear FileNotFoundError, before anything starts."""
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_runtime_repository(tmp_path / "nowhere", {})


def test_runtime_repository_sets_each_parameter_on_the_models_that_take_it(tmp_path) -> None:
    """max_streams reaches the chat model only, max_beam_width the dialogue model only; dtype,
    quantize and forward reach both of ours; a key a model's own config.pbtxt declares reaches
    that model."""
    repository = tmp_path / "repository"
    write_echo_model(repository)  # declares "suffix"
    shutil.copytree(REPO_ROOT / "repository" / "chat", repository / "chat", symlinks=True)
    shutil.copytree(REPO_ROOT / "repository" / "dialogue_model", repository / "dialogue_model")
    values = {"max_streams": "3", "dtype": "float32", "suffix": "?", "max_beam_width": "2"}
    values |= {"quantize": "none", "forward": "hf"}
    runtime = make_runtime_repository(repository, values)
    try:
        read = {m: read_parameters((runtime / m / "config.pbtxt").read_text()) for m in MODELS}
    finally:
        shutil.rmtree(runtime)
    assert read["chat"]["max_streams"] == "3" and read["chat"]["dtype"] == "float32"
    assert "max_beam_width" not in read["chat"] and "suffix" not in read["chat"]
    assert read["dialogue_model"]["max_beam_width"] == "2"
    for model in ("chat", "dialogue_model"):
        assert (read[model]["quantize"], read[model]["forward"]) == ("none", "hf")
    assert read["dialogue_model"]["dtype"] == "float32"
    assert "max_streams" not in read["dialogue_model"]
    assert read["echo"] == {"suffix": "?"}


def test_runtime_repository_refuses_a_parameter_no_model_takes(tmp_path) -> None:
    """A misspelt key fails at start with the keys each model takes, and leaves no copy."""
    repository = tmp_path / "repository"
    write_echo_model(repository)
    before = set(Path(tempfile.gettempdir()).glob("tokenstream-repo-*"))
    with pytest.raises(ValueError, match="max_stream .*chat: model, dtype, .*max_streams"):
        make_runtime_repository(repository, {"max_stream": "3"})
    assert set(Path(tempfile.gettempdir()).glob("tokenstream-repo-*")) == before
