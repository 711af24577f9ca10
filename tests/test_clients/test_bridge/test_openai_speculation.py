"""Speculative decoding end to end: a real tritonserver serving the tiny model with
`speculative=ngram`, asked through the OpenAI API (the official SDK through a real bridge) and
over gRPC, each request with `speculate` true and false. The answers are the same: text, token
ids, logprobs with their alternatives, usage, finish reasons and the system_fingerprint, greedy
and seeded (n=2 too); the server really drafted (its metrics say so)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import served
from speculation_support import check_grpc_answers_agree, check_openai_answers_agree, grpc

from clients.library.grpc_client import GenerateRequest, stream_generate

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def speculating_server(tiny_model_dir):
    yield from served(tiny_model_dir, speculative="ngram")


async def test_openai_answers_are_the_same_with_and_without_speculation(speculating_server):
    """Each case through the SDK, whole and streamed, with speculate true and false: equal
    choices, usage, fingerprint and chunks; and the server drafted tokens meanwhile."""
    await check_openai_answers_agree(speculating_server)


def test_grpc_answers_are_the_same_with_and_without_speculation(speculating_server):
    """Over gRPC, greedy and seeded, token ids and logprobs included: one response a token,
    the same responses with speculation as without."""
    check_grpc_answers_agree(speculating_server)


def test_a_bad_speculate_value_is_refused(speculating_server):
    """speculate must be a boolean: anything else is a clear per-request error."""
    request = GenerateRequest(prompt="Hi", sampling={"speculate": "sometimes", "max_tokens": 3})
    with pytest.raises(Exception, match="speculate"):
        list(stream_generate(speculating_server.grpc_url, request))


def test_speculation_runs_while_other_clients_stream(speculating_server):
    """Two requests at once over gRPC, one speculating: both answers are their alone ones."""
    sampling = {"temperature": 0, "max_tokens": 32}
    alone = grpc(speculating_server, True, sampling)

    async def both():
        return await asyncio.gather(
            asyncio.to_thread(grpc, speculating_server, True, sampling),
            asyncio.to_thread(grpc, speculating_server, False, sampling),
        )

    first, second = asyncio.run(both())
    assert first == alone and second == alone
