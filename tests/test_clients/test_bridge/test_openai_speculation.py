"""Speculative decoding end to end: a real tritonserver serving the tiny model with
`speculative=ngram`, asked through the OpenAI API (the official SDK through a real bridge) and
over gRPC, each request with `speculate` true and false. The answers are the same: text, token
ids, logprobs with their alternatives, usage, finish reasons and the system_fingerprint, greedy
and seeded (n=2 too); the server really drafted (its metrics say so)."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import openai
import pytest
from bridge_support import bridge_to
from conftest import served

from clients.library.grpc_client import GenerateRequest, stream_generate

pytestmark = pytest.mark.server

MODEL = "chat"
# a prompt that repeats itself: its own n-grams give drafts to check
LOOPING = "one two three four five six " * 6
MESSAGES = [{"role": "user", "content": f"Repeat: {LOOPING}"}]


@pytest.fixture(scope="module")
def speculating_server(tiny_model_dir):
    yield from served(tiny_model_dir, speculative="ngram")


def _drafted(server) -> float:
    """tokenstream_spec_decode_draft_tokens_total on the server's metrics port."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r"^tokenstream_spec_decode_draft_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(value) for value in found)


async def _chat(client, speculate: bool, **kwargs):
    """A whole answer and a streamed one, as comparable values (ids and times left out)."""
    body = dict(model=MODEL, messages=MESSAGES, extra_body={"speculate": speculate}, **kwargs)
    whole = await client.chat.completions.create(**body)
    stream = await client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **body
    )
    chunks = [c async for c in stream]
    # each choice's chunks in order (with n > 1 the choices' chunks interleave as they come)
    streamed = sorted(
        (c.choices[0].index, at, c.choices[0].delta.content, c.choices[0].finish_reason,
         c.choices[0].logprobs)
        for at, c in enumerate(chunks)
        if c.choices
    )  # fmt: skip
    streamed = [(index, *rest) for index, _, *rest in streamed]
    choices = [(c.index, c.message.content, c.finish_reason, c.logprobs) for c in whole.choices]
    return choices, whole.usage, whole.system_fingerprint, streamed, chunks[-1].usage


def _grpc(server, speculate: bool, sampling: dict):
    """A gRPC stream's responses as comparable values (one per token)."""
    request = GenerateRequest(
        prompt=LOOPING,
        sampling={**sampling, "speculate": speculate},
        return_output_ids=True,
        return_logprobs=True,
        return_system_fingerprint=True,
    )
    return [
        (c.text, c.output_ids, c.num_output_tokens, c.finish_reason, c.logprobs,
         c.system_fingerprint, c.final)
        for c in stream_generate(server.grpc_url, request)
    ]  # fmt: skip


CASES = {
    "greedy": dict(temperature=0, max_tokens=40, logprobs=True, top_logprobs=3),
    "seeded": dict(temperature=1.0, seed=7, top_p=0.9, max_tokens=40, logprobs=True),
    "seeded_n2": dict(temperature=0.8, seed=11, n=2, max_tokens=30),
    "stop": dict(temperature=0, max_tokens=40, stop=["four"]),
}


async def test_openai_answers_are_the_same_with_and_without_speculation(speculating_server):
    """Each case through the SDK, whole and streamed, with speculate true and false: equal
    choices, usage, fingerprint and chunks; and the server drafted tokens meanwhile."""
    before = _drafted(speculating_server)
    async with bridge_to(speculating_server) as bridge:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{bridge.port}/v1", api_key="unused", max_retries=0
        )
        async with client:
            for name, kwargs in CASES.items():
                plain = await _chat(client, False, **kwargs)
                speculated = await _chat(client, True, **kwargs)
                assert speculated == plain, name
    assert _drafted(speculating_server) > before


def test_grpc_answers_are_the_same_with_and_without_speculation(speculating_server):
    """Over gRPC, greedy and seeded, token ids and logprobs included: one response a token,
    the same responses with speculation as without."""
    before = _drafted(speculating_server)
    for sampling in (
        {"temperature": 0, "max_tokens": 48, "top_logprobs": 2},
        {"temperature": 1.0, "seed": 5, "max_tokens": 48},
    ):
        plain = _grpc(speculating_server, False, sampling)
        speculated = _grpc(speculating_server, True, sampling)
        assert speculated == plain
        assert all(len(r[1]) == 1 for r in speculated if r[1])
    assert _drafted(speculating_server) > before


def test_a_bad_speculate_value_is_refused(speculating_server):
    """speculate must be a boolean: anything else is a clear per-request error."""
    request = GenerateRequest(prompt="Hi", sampling={"speculate": "sometimes", "max_tokens": 3})
    with pytest.raises(Exception, match="speculate"):
        list(stream_generate(speculating_server.grpc_url, request))


def test_speculation_runs_while_other_clients_stream(speculating_server):
    """Two requests at once over gRPC, one speculating: both answers are their alone ones."""
    sampling = {"temperature": 0, "max_tokens": 32}
    alone = _grpc(speculating_server, True, sampling)

    async def both():
        return await asyncio.gather(
            asyncio.to_thread(_grpc, speculating_server, True, sampling),
            asyncio.to_thread(_grpc, speculating_server, False, sampling),
        )

    first, second = asyncio.run(both())
    assert first == alone and second == alone
