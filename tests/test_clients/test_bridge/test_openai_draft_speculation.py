"""Speculation with a draft model end to end: a real tritonserver serving the tiny model with
`speculative=draft` and the tiny model as its own draft model, asked through the OpenAI API (the
official SDK through a real bridge) and over gRPC, each request with `speculate` true and false:
the same answers (text, logprobs, usage, finish reasons, fingerprint; greedy, seeded, n=2, a stop
string), and the metrics count the draft model's drafts. A draft model with another vocabulary
stops the server's start with a message that says so."""

from __future__ import annotations

import openai
import pytest
from bridge_support import bridge_to
from conftest import served, start_server
from test_openai_speculation import CASES, _chat, _drafted, _grpc

from streaming_backend.launcher.server import ServerDied

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def drafting_server(tiny_model_dir):
    yield from served(tiny_model_dir, speculative="draft", draft_model=str(tiny_model_dir))


async def test_openai_answers_are_the_same_with_a_draft_model(drafting_server):
    """Each case through the SDK, whole and streamed, with speculate true and false: equal
    choices, usage, fingerprint and chunks; the draft model drafted meanwhile."""
    before = _drafted(drafting_server)
    async with bridge_to(drafting_server) as bridge:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{bridge.port}/v1", api_key="unused", max_retries=0
        )
        async with client:
            for name, kwargs in CASES.items():
                plain = await _chat(client, False, **kwargs)
                speculated = await _chat(client, True, **kwargs)
                assert speculated == plain, name
    assert _drafted(drafting_server) > before


def test_grpc_answers_are_the_same_with_a_draft_model(drafting_server):
    """Over gRPC, greedy and seeded, token ids and logprobs included: one response a token,
    the same responses with the draft model's speculation as without."""
    for sampling in (
        {"temperature": 0, "max_tokens": 48, "top_logprobs": 2},
        {"temperature": 1.0, "seed": 5, "max_tokens": 48},
    ):
        plain = _grpc(drafting_server, False, sampling)
        speculated = _grpc(drafting_server, True, sampling)
        assert speculated == plain
        assert all(len(r[1]) == 1 for r in speculated if r[1])


def test_a_draft_model_with_another_vocabulary_stops_the_start(tiny_model_dir, tmp_path):
    """The chat model refuses the draft at load: tritonserver exits, and the error's first line
    (what serve prints) names the draft model's other vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<not-in-the-model's-vocabulary>"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    failed = r"a model failed to load \(chat: ValueError: the draft model \S+ has another vocab"
    with pytest.raises(ServerDied, match=failed):
        start_server(tiny_model_dir, speculative="draft", draft_model=str(tmp_path))
