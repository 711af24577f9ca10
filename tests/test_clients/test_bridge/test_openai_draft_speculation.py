"""Speculation with a draft model end to end: a real tritonserver serving the tiny model with
`speculative=draft` and the tiny model as its own draft model, asked through the OpenAI API (the
official SDK through a real bridge) and over gRPC, each request with `speculate` true and false:
the same answers (text, logprobs, usage, finish reasons, fingerprint; greedy, seeded, n=2, a stop
string), and the metrics count the draft model's drafts; its health answer (/status's source)
reports the draft model's KV cache beside the model's. A draft model with another vocabulary
stops the server's start with a message that says so."""

from __future__ import annotations

import pytest
from conftest import save_other_vocabulary, served, start_server
from speculation_support import check_grpc_answers_agree, check_openai_answers_agree

from streaming_backend.launcher.control import control
from streaming_backend.launcher.server import ServerDied
from streaming_backend.wire import CHAT_MODEL, CONTROL_HEALTH

pytestmark = pytest.mark.server
ADMIN_KEY = "draft-test-key"


@pytest.fixture(scope="module")
def drafting_server(tiny_model_dir):
    yield from served(
        tiny_model_dir,
        speculative="draft",
        draft_model=str(tiny_model_dir),
        admin_key=ADMIN_KEY,
    )


async def test_openai_answers_are_the_same_with_a_draft_model(drafting_server):
    """Each case through the SDK, whole and streamed, with speculate true and false: equal
    choices, usage, fingerprint and chunks; the draft model drafted meanwhile."""
    await check_openai_answers_agree(drafting_server)


def test_grpc_answers_are_the_same_with_a_draft_model(drafting_server):
    """Over gRPC, greedy and seeded, token ids and logprobs included: one response a token,
    the same responses with the draft model's speculation as without."""
    check_grpc_answers_agree(drafting_server)


def test_the_health_answer_reports_the_draft_models_kv_cache(drafting_server):
    """The forward report (/status's "forward") has the draft model's KV cache beside the
    model's: no more slots, as many positions; the memory report's KV cache is both."""
    health = control(drafting_server.http_url, CHAT_MODEL, ADMIN_KEY, CONTROL_HEALTH, 10)
    kv_cache, draft = health.forward["kv_cache"], health.forward["draft_kv_cache"]
    assert 1 <= draft["slots"] <= kv_cache["slots"] and draft["positions"] == kv_cache["positions"]
    assert health.memory["kv_cache"]["reserved_bytes"] == kv_cache["bytes"] + draft["bytes"]
    assert health.speculation["mode"] == "draft"


def test_a_draft_model_with_another_vocabulary_stops_the_start(tiny_model_dir, tmp_path):
    """The chat model refuses the draft at load: tritonserver exits, and the error's first line
    (what serve prints) names the draft model's other vocabulary."""
    save_other_vocabulary(tiny_model_dir, tmp_path)
    failed = r"a model failed to load \(chat: ValueError: the draft model \S+ has another vocab"
    with pytest.raises(ServerDied, match=failed):
        start_server(tiny_model_dir, speculative="draft", draft_model=str(tmp_path))
