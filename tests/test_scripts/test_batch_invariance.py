"""scripts/batch_invariance.py against a real server as served (dtype and quantize auto): the same
answers alone and in a crowd, over the OpenAI API, through tritonserver and the bridge."""

from __future__ import annotations

import pytest
from conftest import bridge_thread, served

pytestmark = [pytest.mark.server, pytest.mark.cpu_kinds]


@pytest.fixture(scope="module")
def auto_server(tiny_model_dir):
    """The tiny model served with this CPU's automatic choices, prompts prefilled in chunks of
    16 tokens while other streams decode."""
    yield from served(
        tiny_model_dir, dtype="auto", quantize="auto", max_streams=16, prefill_chunk_tokens=16
    )


def test_answers_alone_and_in_a_crowd_are_identical(load_script, auto_server, capsys):
    """4 chats greedy and seeded, alone and then beside each other and 4 long prompts: every
    answer identical, and one system_fingerprint throughout."""
    script = load_script("batch_invariance")
    with bridge_thread(auto_server.grpc_url) as port:
        argv = ["--url", f"http://127.0.0.1:{port}/v1", "--chats", "4", "--max-tokens", "16"]
        result = script.main([*argv, "--long", "4", "--long-words-x", "4"])
    assert result["differing"] == []
    assert (result["greedy_identical"], result["seeded_identical"]) == (4, 4)
    assert len(result["fingerprints"]) == 1
    assert "greedy 4/4 identical, seeded 4/4 identical" in capsys.readouterr().out
