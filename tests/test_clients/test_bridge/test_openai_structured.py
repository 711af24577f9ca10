"""Structured outputs, tool calls, logprobs and n > 1 on the OpenAI API: the official `openai`
SDK against a real bridge and tritonserver serving the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import asyncio
import enum
import json
import time
import uuid
from typing import Annotated

import openai
import pydantic
import pytest
import torch
from bridge_support import active_streams, bridge_to, metric, tokens_generated, wait_idle_engine
from conftest import chat_prompts

from streaming_backend.prompts import encode_prompt

pytestmark = pytest.mark.server

MODEL = "chat"


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Summary(pydantic.BaseModel):
    """What the model is asked to fill in: a string, an integer, an enum and a list."""

    topic: str = pydantic.Field(max_length=24)
    words: int = pydantic.Field(ge=0, le=500)
    colour: Colour
    tags: list[Annotated[str, pydantic.Field(max_length=12)]] = pydantic.Field(
        min_length=1, max_length=3
    )


class WeatherArgs(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=30)
    unit: Colour  # any enum will do: the grammar must keep the model inside it


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": WeatherArgs.model_json_schema(),
    },
}


class TimeArgs(pydantic.BaseModel):
    """get_time's arguments: its schema below, as a model to validate a call's arguments."""

    model_config = pydantic.ConfigDict(extra="forbid")
    zone: str = pydantic.Field(max_length=20)


TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def default_loaded(default_model_dir):
    from streaming_backend.model.loading import load_model

    return load_model(str(default_model_dir), dtype="float32", device="cpu")


def client_of(bridge) -> openai.AsyncOpenAI:
    base = f"http://127.0.0.1:{bridge.port}/v1"
    return openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)


async def wait_until(condition, timeout: float = 10.0) -> bool:
    """Whether a condition on the server (read in a thread) holds within `timeout`: a counter
    is exported a moment after the response that moved it."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def ask_summary(chat: list[dict]) -> list[dict]:
    request = "Summarise the conversation above as JSON: topic, words, colour, tags."
    return [*chat, {"role": "user", "content": request}]


async def test_parse_a_pydantic_model_for_every_shipped_chat(default_server):
    """SDK parse: every shipped chat gives a valid Summary, whole and streamed alike."""
    chats = chat_prompts()
    async with bridge_to(default_server) as bridge, client_of(bridge) as client:

        async def whole(chat):
            completion = await client.chat.completions.parse(
                model=MODEL, messages=ask_summary(chat), response_format=Summary, max_tokens=400
            )
            return completion.choices[0]

        async def streamed(chat):
            async with client.chat.completions.stream(
                model=MODEL, messages=ask_summary(chat), response_format=Summary, max_tokens=400
            ) as stream:
                deltas = [e.delta async for e in stream if e.type == "content.delta"]
                final = await stream.get_final_completion()
            return deltas, final.choices[0]

        wholes = await asyncio.gather(*(whole(c) for c in chats))
        streams = await asyncio.gather(*(streamed(c) for c in chats))
    for choice in wholes:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Summary)
    for deltas, choice in streams:
        assert len(deltas) > 5 and "".join(deltas) == choice.message.content
        assert isinstance(choice.message.parsed, Summary)


class Pick(pydantic.BaseModel):
    colour: Colour
    count: int = pydantic.Field(ge=0, le=9)


async def test_a_constrained_and_a_free_request_share_the_batch(default_server):
    """A json_schema request runs while a free greedy one streams (it starts after the free
    one's first token and ends before its last): it validates, and the free answer is the one
    the same request gets alone."""
    free = dict(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story about a lighthouse."}],
        max_tokens=48, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    ask = [{"role": "user", "content": "Pick a colour and a count as JSON."}]
    async with bridge_to(default_server) as bridge, client_of(bridge) as client:
        alone = await client.chat.completions.create(**free)

        async def streamed():
            stream = await client.chat.completions.create(stream=True, **free)
            return [(time.monotonic(), c) async for c in stream]

        async def constrained():
            started = time.monotonic()
            picked = await client.chat.completions.parse(
                model=MODEL, messages=ask, response_format=Pick, max_tokens=40
            )
            return started, time.monotonic(), picked.choices[0]

        free_task = asyncio.create_task(streamed())
        while not await asyncio.to_thread(active_streams, default_server):
            await asyncio.sleep(0.01)  # the free one is on the engine
        started, ended, picked = await constrained()
        chunks = await free_task
    texts = [(t, c.choices[0].delta.content) for t, c in chunks if c.choices]
    tokens = [t for t, text in texts if text]
    assert tokens[0] < ended < tokens[-1], (tokens[0], started, ended, tokens[-1])  # overlapped
    assert picked.finish_reason == "stop" and isinstance(picked.message.parsed, Pick)
    assert "".join(text or "" for _, text in texts) == alone.choices[0].message.content
    assert alone.usage.completion_tokens == 48


async def test_required_and_named_tool_calls_validate_and_stream(default_server):
    """tool_choice required / named: arguments always validate; streamed deltas reassemble to
    the whole answer's call; finish_reason is tool_calls."""
    async with bridge_to(default_server) as bridge, client_of(bridge) as client:
        common = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=400, seed=1)
        required = await client.chat.completions.create(tool_choice="required", **common)
        named = {"type": "function", "function": {"name": "get_time"}}
        forced = await client.chat.completions.create(tool_choice=named, **common)
        stream = await client.chat.completions.create(tool_choice="required", stream=True, **common)
        chunks = [c async for c in stream]
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        if call.function.name == "get_weather":
            WeatherArgs.model_validate_json(call.function.arguments)
        else:
            TimeArgs.model_validate_json(call.function.arguments)
    (time_call,) = forced.choices[0].message.tool_calls
    assert time_call.function.name == "get_time"
    TimeArgs.model_validate_json(time_call.function.arguments)
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected


async def test_a_tool_result_yields_a_text_answer(default_server):
    """The round trip: the assistant's call and the tool's result in history give a text answer
    (tool_choice "none"), whose prompt holds the result; with the tools still offered ("auto")
    the answer is well formed: text, or calls that parse."""
    async with bridge_to(default_server) as bridge, client_of(bridge) as client:
        first = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,  # exactly one call
            max_tokens=300,  # never cut: a city of 30 odd characters can take 90 tokens
            temperature=0,
        )
        message = first.choices[0].message
        (call,) = message.tool_calls
        result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees C."}
        called = [*ASK, message.model_dump(exclude_none=True)]
        common = dict(model=MODEL, tools=[WEATHER], max_tokens=120, temperature=0)
        text = await client.chat.completions.create(
            messages=[*called, result], tool_choice="none", **common
        )
        unanswered = await client.chat.completions.create(
            messages=called, tool_choice="none", **{**common, "max_tokens": 1}
        )
        # tool_choice left at "auto": the tools stay in the prompt and the model chooses
        chosen = await client.chat.completions.create(messages=[*called, result], **common)
    reply = text.choices[0]
    assert reply.message.tool_calls is None and reply.message.content.strip()
    assert reply.finish_reason in ("stop", "length")
    assert text.usage.prompt_tokens > unanswered.usage.prompt_tokens  # the result was read
    reply = chosen.choices[0]
    if reply.message.tool_calls:  # another call: whole, parsed, and said so
        assert reply.finish_reason == "tool_calls"
        for again in reply.message.tool_calls:
            assert again.function.name == "get_weather" and again.id.startswith("call_")
            assert isinstance(json.loads(again.function.arguments), dict)
    else:  # an answer in text (an unfinished call, cut by max_tokens, stays text)
        assert reply.message.content and reply.finish_reason in ("stop", "length")


async def test_top_logprobs_are_the_models_log_softmax(default_server, default_loaded):
    """logprobs with top_logprobs=3: sorted, and equal to the model's own log-softmax."""
    messages = chat_prompts()[0]
    async with bridge_to(default_server) as bridge, client_of(bridge) as client:
        whole = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
            top_logprobs=3,
        )  # fmt: skip
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
            top_logprobs=3, stream=True,
        )  # fmt: skip
        streamed = [e for c in [c async for c in stream] if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]  # fmt: skip
    entries = whole.choices[0].logprobs.content
    assert len(entries) == 6 and [e.token for e in streamed] == [e.token for e in entries]
    tokenizer, model = default_loaded.tokenizer, default_loaded.model
    ids = encode_prompt(tokenizer, messages=messages)
    for entry in entries:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        expected = torch.log_softmax(logits, -1)
        best = expected.topk(3)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            best.values.tolist(), abs=2e-3
        )
        tokens = [tokenizer.decode([i]) for i in best.indices]
        assert [t.token for t in entry.top_logprobs] == tokens
        assert entry.logprob == pytest.approx(best.values[0].item(), abs=2e-3)
        ids.append(int(best.indices[0]))


async def test_n_choices_with_a_seed_are_reproducible_and_share_the_prefill(default_server):
    """n=3 with a seed: three indexed choices, the same on a second request and when streamed.
    The prompt is prefilled once: choices 1 and 2 take all of it but the last token from the
    prefix cache (a system message no earlier request had keeps it fresh)."""
    fresh = {"role": "system", "content": f"Session {uuid.uuid4().hex}: answer in one sentence."}
    messages = [fresh, *ASK]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=8, n=3, seed=11, temperature=1.0)
    reused = "tokenstream_prefix_cache_reused_tokens_total"
    async with bridge_to(default_server) as bridge, client_of(bridge) as client:
        before = metric(default_server, reused)
        first = await client.chat.completions.create(**kwargs)
        shared = 2 * (first.usage.prompt_tokens - 1)
        grew = await wait_until(lambda: metric(default_server, reused) - before >= shared)
        again = await client.chat.completions.create(**kwargs)
        stream = await client.chat.completions.create(stream=True, **kwargs)
        texts = ["", "", ""]
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    assert [c.index for c in first.choices] == [0, 1, 2]
    contents = [c.message.content for c in first.choices]
    assert contents == [c.message.content for c in again.choices] == texts
    assert len(set(contents)) > 1  # each choice draws with its own seed
    assert 3 <= first.usage.completion_tokens <= 3 * 8  # every choice's tokens, the prompt once
    assert grew, (metric(default_server, reused) - before, shared)


async def test_bad_structured_requests_are_400_and_the_server_keeps_serving(default_server):
    """An invalid schema (response_format, or a tool's parameters whatever tool_choice is), an
    unknown tool_choice name, top_logprobs=50: 400 naming the field."""
    schema = {"type": "object", "properties": {"a": {"type": 7}}}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    unknown = {"type": "function", "function": {"name": "nope"}}
    bad_tool = {"type": "function", "function": {"name": "broken", "parameters": schema}}
    async with bridge_to(default_server) as bridge, client_of(bridge) as client:
        errors = []
        for extra in (
            {"response_format": bad_schema},
            {"response_format": bad_schema, "stream": True},
            {"tools": [WEATHER], "tool_choice": unknown},
            {"logprobs": True, "top_logprobs": 50},
            {"tools": [WEATHER, bad_tool]},  # auto: no grammar is built from the tools
            {"tools": [WEATHER, bad_tool], "tool_choice": "required"},
        ):
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(model=MODEL, messages=ASK, **extra)
            errors.append(error.value)
        # json_object reaches the model as guided_json_object: a whole object, greedy
        ok = await client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=60, temperature=0,
            response_format={"type": "json_object"},
        )  # fmt: skip
    params = [e.param for e in errors]
    tool = "tools[1].function.parameters"
    assert params == [*["response_format"] * 2, "tool_choice", "top_logprobs", tool, tool]
    assert all(e.status_code == 400 and e.type == "invalid_request_error" for e in errors)
    assert "does not compile" in errors[0].message
    assert "not a valid JSON schema: type must be a string" in errors[-1].message
    assert ok.choices[0].finish_reason == "stop", ok.choices[0].message.content
    assert isinstance(json.loads(ok.choices[0].message.content), dict)


async def test_cancelling_a_constrained_stream_frees_its_slot(default_server):
    """A client that leaves a constrained stream cancels it: the engine goes idle at once and
    generated far fewer than max_tokens."""
    before = tokens_generated(default_server)
    async with bridge_to(default_server) as bridge, client_of(bridge) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=400, stream=True,
            extra_body={"guided_regex": "[a-z ]{400}"},
        )  # fmt: skip
        got = [await anext(stream) for _ in range(4)]
        await stream.close()
        await wait_idle_engine(default_server, timeout=20)
        made = tokens_generated(default_server) - before
        after = await client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=5, extra_body={"guided_choice": ["yes", "no"]}
        )
    assert got[-1].choices[0].delta.content
    assert made < 200, made
    assert after.choices[0].message.content in ("yes", "no")


async def test_completions_logprobs(default_server, default_loaded):
    """/v1/completions with logprobs k: tokens, their logprobs (the model's log-softmax), at
    most k alternatives best first (two ids may decode to one key), and offsets."""
    prompt = "The capital of France is"
    async with bridge_to(default_server) as bridge, client_of(bridge) as client:
        completion = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, logprobs=2, temperature=0,
        )  # fmt: skip
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text
    assert len(logprobs.token_logprobs) == completion.usage.completion_tokens
    assert all(len(top) <= 2 and top for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    tokenizer, model = default_loaded.tokenizer, default_loaded.model
    ids = encode_prompt(tokenizer, text=prompt)
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        best = torch.log_softmax(logits, -1).topk(2)
        assert value == pytest.approx(best.values[0].item(), abs=2e-3)  # greedy: the best
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert top[token] == pytest.approx(value, abs=1e-6)
        assert list(top.values()) == pytest.approx(best.values.tolist()[: len(top)], abs=2e-3)
        ids.append(int(best.indices[0]))
