"""The guided_* sampling keys and top_logprobs reach the engine over every transport: gRPC
stream_infer, HTTP generate_stream and the websocket bridge (a real tritonserver, tiny model)."""

from __future__ import annotations

import json
import re

import aiohttp
import pytest
import websockets
from bridge_support import bridge_to, collect, frame, ws_url

from clients.library.chunk import GenerationError
from clients.library.grpc_client import AsyncChatClient, GenerateRequest, stream_generate
from clients.library.sse_client import generate, generate_stream_url

pytestmark = pytest.mark.server

PATTERN = r"(yes|no)-[0-9]{3}"
GUIDED = {"guided_regex": PATTERN, "temperature": 1.0, "seed": 5, "max_tokens": 40}
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green"]}},
    "required": ["colour"],
    "additionalProperties": False,
}


def test_grpc_guided_regex_and_top_logprobs(triton_server):
    """gRPC: the regex shapes the answer; return_logprobs gives each token's top_logprobs."""
    sampling = {**GUIDED, "top_logprobs": 2}
    request = GenerateRequest(prompt="Hello", sampling=sampling, return_logprobs=True)
    chunks = list(stream_generate(triton_server.grpc_url, request))
    assert re.fullmatch(PATTERN, "".join(c.text for c in chunks))
    assert chunks[-1].finish_reason == "stop"
    entries = [e for c in chunks for e in c.logprobs or ()]
    assert len(entries) == sum(c.tokens for c in chunks)
    for entry in entries:  # where the grammar allows one token only, it is the only one
        top = entry["top_logprobs"]
        assert 1 <= len(top) <= 2 and [t["logprob"] for t in top] == sorted(
            (t["logprob"] for t in top), reverse=True
        )
        assert {"token_id", "token", "logprob"} <= set(entry)
    assert any(len(e["top_logprobs"]) == 2 for e in entries)


async def test_generate_stream_guided_json(triton_server):
    """HTTP generate_stream: a guided_json schema (as JSON text) gives JSON that fits it."""
    request = GenerateRequest(prompt="Colour?", sampling={"guided_json": SCHEMA, "seed": 1})
    async with aiohttp.ClientSession() as session:
        url = generate_stream_url(triton_server.http_url)
        chunks = [c async for c in generate(session, url, request)]
    assert json.loads("".join(c.text for c in chunks))["colour"] in ("red", "green")


async def test_grpc_bad_grammar_is_invalid_request(triton_server):
    """A grammar that does not compile fails that request with invalid_request, naming the
    key; the next request is served."""
    async with AsyncChatClient(triton_server.grpc_url) as client:
        bad = GenerateRequest(prompt="Hi", sampling={"guided_regex": "(oops"})
        with pytest.raises(Exception) as error:
            [c async for c in client.generate(bad, "bad")]
        good = GenerateRequest(prompt="Hi", sampling={"guided_choice": ["fine"]})
        text = "".join([c.text async for c in client.generate(good, "good")])
    assert getattr(error.value, "code", None) == "invalid_request"
    assert "guided_regex" in str(error.value)
    assert text == "fine"


async def test_websocket_guided_keys(triton_server):
    """The websocket bridge passes guided_choice (a list) and guided_json (an object)."""
    async with bridge_to(triton_server) as bridge, websockets.connect(ws_url(bridge)) as ws:
        choice = {"guided_choice": ["alpha", "beta"], "seed": 3}
        schema = {"guided_json": SCHEMA, "seed": 4}
        await ws.send(frame(type="generate", id="c", prompt="Pick", params=choice))
        await ws.send(frame(type="generate", id="j", prompt="Pick", params=schema))
        frames = await collect(ws, {"c", "j"})
    texts = {
        i: "".join(f.get("text", "") for f in fs if f["type"] == "token")
        for i, fs in frames.items()
    }
    assert frames["c"][-1]["type"] == frames["j"][-1]["type"] == "done"
    assert texts["c"] in ("alpha", "beta")
    assert json.loads(texts["j"])["colour"] in ("red", "green")


BAD_GRAMMARS = [
    ("guided_json", {"type": "object", "properties": {"colour": {"type": 7}}}),
    ("guided_regex", "(oops"),
]


async def test_websocket_bad_grammar_is_an_error_frame(triton_server):
    """The websocket: a guided_json or guided_regex that does not compile ends that generation
    with an invalid_request error frame naming the key; a good one beside it is served."""
    async with bridge_to(triton_server) as bridge, websockets.connect(ws_url(bridge)) as ws:
        for key, value in BAD_GRAMMARS:
            await ws.send(frame(type="generate", id=key, prompt="Hi", params={key: value}))
        await ws.send(
            frame(type="generate", id="ok", prompt="Hi", params={"guided_choice": ["fine"]})
        )
        frames = await collect(ws, {key for key, _ in BAD_GRAMMARS} | {"ok"})
    for key, _ in BAD_GRAMMARS:
        (end,) = frames[key]
        assert (end["type"], end["code"]) == ("error", "invalid_request"), end
        assert f"sampling_parameters.{key} does not compile" in end["message"]
    assert frames["ok"][-1]["type"] == "done"
    assert "".join(f.get("text", "") for f in frames["ok"]) == "fine"


@pytest.mark.parametrize("key, value", BAD_GRAMMARS)
async def test_generate_stream_bad_grammar_is_invalid_request(triton_server, key, value):
    """HTTP generate_stream: a grammar that does not compile is an invalid_request error whose
    message names the key, before any token."""
    url = generate_stream_url(triton_server.http_url)
    async with aiohttp.ClientSession() as session:
        request = GenerateRequest(prompt="Hi", sampling={key: value})
        got = []
        with pytest.raises(GenerationError) as error:
            async for chunk in generate(session, url, request):
                got.append(chunk)
    assert got == [] and error.value.code == "invalid_request"
    assert f"sampling_parameters.{key} does not compile" in error.value.message


def test_grpc_guided_grammar(triton_server):
    """gRPC: a Lark grammar (guided_grammar) shapes the whole answer."""
    lark = 'start: "id-" DIGIT DIGIT ("a" | "b")\nDIGIT: /[0-9]/'
    request = GenerateRequest(prompt="Hello", sampling={"guided_grammar": lark, "seed": 2})
    chunks = list(stream_generate(triton_server.grpc_url, request))
    assert re.fullmatch(r"id-[0-9]{2}[ab]", "".join(c.text for c in chunks))
    assert chunks[-1].finish_reason == "stop"
