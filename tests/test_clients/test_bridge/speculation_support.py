"""Helpers shared by the speculation tests over a real server (n-gram drafts and a draft model):
the same requests with `speculate` true and false, through the OpenAI API (the official SDK
through a real bridge) and over gRPC, as comparable values, and the drafts the server counted."""

from __future__ import annotations

import openai
from bridge_support import bridge_to, metric

from clients.library.grpc_client import GenerateRequest, stream_generate

MODEL = "chat"
# a prompt that repeats itself: its own n-grams give drafts to check
LOOPING = "one two three four five six " * 6
MESSAGES = [{"role": "user", "content": f"Repeat: {LOOPING}"}]

CASES = {
    "greedy": dict(temperature=0, max_tokens=40, logprobs=True, top_logprobs=3),
    "seeded": dict(temperature=1.0, seed=7, top_p=0.9, max_tokens=40, logprobs=True),
    "seeded_n2": dict(temperature=0.8, seed=11, n=2, max_tokens=30),
    "stop": dict(temperature=0, max_tokens=40, stop=["four"]),
}
GRPC_CASES = (
    {"temperature": 0, "max_tokens": 48, "top_logprobs": 2},
    {"temperature": 1.0, "seed": 5, "max_tokens": 48},
)


def drafted(server) -> float:
    """Tokens the server drafted and verified so far (its metrics port)."""
    return metric(server, "tokenstream_spec_decode_draft_tokens_total")


async def chat(client, speculate: bool, **kwargs):
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


def grpc(server, speculate: bool, sampling: dict):
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


async def check_openai_answers_agree(server) -> None:
    """Each of CASES through the SDK, whole and streamed, with speculate true and false: equal
    choices, usage, fingerprint and chunks; and the server drafted tokens meanwhile."""
    before = drafted(server)
    async with bridge_to(server) as bridge:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{bridge.port}/v1", api_key="unused", max_retries=0
        )
        async with client:
            for name, kwargs in CASES.items():
                plain = await chat(client, False, **kwargs)
                speculated = await chat(client, True, **kwargs)
                assert speculated == plain, name
    assert drafted(server) > before


def check_grpc_answers_agree(server) -> None:
    """Each of GRPC_CASES over gRPC, token ids and logprobs included: one response a token, the
    same responses with speculate true as false; and the server drafted tokens meanwhile."""
    before = drafted(server)
    for sampling in GRPC_CASES:
        plain = grpc(server, False, sampling)
        speculated = grpc(server, True, sampling)
        assert speculated == plain
        assert all(len(r[1]) == 1 for r in speculated if r[1])
    assert drafted(server) > before
