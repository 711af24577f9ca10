"""The guided_* sampling keys and top_logprobs reach the engine over every transport: gRPC
stream_infer, HTTP generate_stream and the websocket bridge (a real tritonserver, tiny model)."""

from __future__ import annotations

import json
import re

import aiohttp
import pytest
import websockets
from bridge_support import bridge_to, collect, frame, ws_url

from clients.grpc_client import AsyncChatClient, GenerateRequest, stream_generate
from clients.sse_client import generate, generate_stream_url

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
