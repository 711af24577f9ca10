"""launcher/batching.py (the dialogue model's config rewrites) and serve's model options."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from clients.cli.serve import add_arguments, config_from_args
from streaming_backend.launcher.batching import DialogueBatching
from streaming_backend.launcher.binary import TritonBinary
from streaming_backend.launcher.repository import make_runtime_repository
from streaming_backend.launcher.server import ServerConfig, TritonServer
from streaming_backend.wire import CHAT_MODEL, DIALOGUE_MODEL

REPOSITORY = Path(__file__).resolve().parents[3] / "repository"
SHIPPED = (REPOSITORY / DIALOGUE_MODEL / "config.pbtxt").read_text()


def test_no_settings_leave_the_config_unchanged():
    assert DialogueBatching().rewrite(SHIPPED) == SHIPPED


def test_instances_and_queue_delay_are_rewritten():
    text = DialogueBatching(instances=3, queue_delay_us=250).rewrite(SHIPPED)
    assert "instance_group [ { count: 3, kind: KIND_MODEL } ]" in text
    assert "max_queue_delay_microseconds: 250\n" in text
    assert "preferred_batch_size: [ 8, 16, 32 ]" in text


def test_dynamic_batching_off_drops_the_block_only():
    text = DialogueBatching(dynamic_batching=False).rewrite(SHIPPED)
    assert "dynamic_batching {" not in text
    assert "preferred_batch_size" not in text and "max_queue_delay" not in text
    assert "max_batch_size: 32" in text and "instance_group" in text
    assert text.count("{") == text.count("}")


def test_commented_entries_are_not_taken_for_real_ones():
    text = "# instance_group [ { count: 9 } ]\ninstance_group [ { count: 2 } ]\n"
    assert DialogueBatching(instances=4).rewrite(text) == (
        "# instance_group [ { count: 9 } ]\ninstance_group [ { count: 4 } ]\n"
    )
    with pytest.raises(ValueError, match="no entry"):
        DialogueBatching(queue_delay_us=1).rewrite(text)


def test_bad_values_are_refused():
    with pytest.raises(ValueError):
        DialogueBatching(instances=0)
    with pytest.raises(ValueError):
        DialogueBatching(queue_delay_us=-1)


def test_the_runtime_repository_applies_the_rewrite_to_the_dialogue_model_only():
    runtime = make_runtime_repository(
        REPOSITORY, {"dtype": "float32"}, DialogueBatching(instances=1).rewrites()
    )
    try:
        dialogue = (runtime / DIALOGUE_MODEL / "config.pbtxt").read_text()
        chat = (runtime / CHAT_MODEL / "config.pbtxt").read_text()
        assert "count: 1, kind: KIND_MODEL" in dialogue
        assert chat == (REPOSITORY / CHAT_MODEL / "config.pbtxt").read_text().replace(
            'key: "dtype" value: { string_value: "auto" }',
            'key: "dtype" value: { string_value: "float32" }',
        )
    finally:
        shutil.rmtree(runtime)


def test_serve_options_reach_the_config_and_the_command_line():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--models", "chat, dialogue_model", "--dialogue-instances", "1", "--no-dynamic-batching"]
    )
    config = config_from_args(args).server
    assert config.models == (CHAT_MODEL, DIALOGUE_MODEL)
    assert config.dialogue == DialogueBatching(instances=1, dynamic_batching=False)
    command = TritonServer(config).command(TritonBinary(Path("/bin/true"), Path("/x"), {}))
    assert "--model-control-mode=explicit" in command
    assert f"--load-model={CHAT_MODEL}" in command and f"--load-model={DIALOGUE_MODEL}" in command
    default = config_from_args(parser.parse_args([])).server
    assert default.models == () and default.dialogue == DialogueBatching()
    plain = TritonServer(ServerConfig()).command(TritonBinary(Path("/bin/true"), Path("/x"), {}))
    assert not any(arg.startswith("--model-control-mode") for arg in plain)
    assert config_from_args(parser.parse_args(["--models", ""])).server.models == ()
