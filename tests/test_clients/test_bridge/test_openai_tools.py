"""Tool calls' generic format (clients/bridge/openai_tools.py) and the answers' logprobs and
tool_calls shapes (openai_response.py): no server."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from clients.bridge.openai_errors import ApiError
from clients.bridge.openai_request import CHAT, COMPLETION, parse_chat
from clients.bridge.openai_response import Answer, delta_chunks, finish_chunk, whole_response
from clients.bridge.openai_tools import ToolCallParser, parse_tools
from clients.library.chunk import Chunk

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "$defs": {"Unit": {"enum": ["C", "F"]}},
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'


def chunk(text, final=False, logprobs=None):
    reason = "stop" if final else None
    return Chunk(
        text=text,
        num_output_tokens=1,
        num_input_tokens=5,
        finish_reason=reason,
        final=final,
        request_id="r",
        received_ns=0,
        logprobs=logprobs,
    )


def test_calls_split_anywhere_are_parsed_and_text_is_kept():
    """Markers cut across responses still parse; text around calls stays content."""
    for cut in range(1, len(CALL)):
        parser = ToolCallParser(frozenset({"get_weather"}))
        text = f"Let me look. {CALL[:cut]}"
        content, calls = parser.feed(text)
        more, later = parser.feed(CALL[cut:] + "\n")
        assert content + more + parser.finish() == "Let me look. "
        (call,) = calls + later
        assert (call.name, json.loads(call.arguments)) == (
            "get_weather",
            {"city": "Paris", "unit": "C"},
        )


def test_not_a_call_stays_text():
    """An unknown name, bad JSON or an unfinished call is content, not a call."""
    parser = ToolCallParser(frozenset({"get_weather"}))
    bad = '<tool_call>{"name": "rm", "arguments": {}}</tool_call> and <tool_call>{oops'
    content, calls = parser.feed(bad)
    assert calls == [] and content + parser.finish() == bad


def test_forced_choice_grammars_compile_and_admit_only_valid_calls(default_model_dir):
    """required / named: the Lark grammar compiles ($defs hoisted) and admits a valid call."""
    tokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(default_model_dir))
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        tools = parse_tools({"tools": [WEATHER, TIME], "tool_choice": choice})
        grammar = llguidance.LLMatcher.grammar_from_lark(tools.grammar())
        assert llguidance.LLMatcher.validate_grammar(grammar, tokenizer) == ""
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        ids = tokenizer.tokenize_str(CALL)
        assert all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()
        wrong = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        bad = tokenizer.tokenize_str(CALL.replace('"C"', '"K"'))
        assert not all(wrong.consume_token(t) for t in bad)


def test_history_and_tools_reach_the_model_as_they_are():
    """Calls and results stay structured (the model renders them); tools go as OpenAI's list,
    and not at all with tool_choice "none"."""
    body = {
        "model": "chat",
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        ],
    }
    request = parse_chat(body, "chat").request
    assert request.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert request.messages[1]["content"] == ""
    assert request.messages[2] == {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"}
    assert [t["function"]["name"] for t in request.tools] == ["get_weather"]
    assert parse_chat({**body, "tool_choice": "none"}, "chat").request.tools is None
    with pytest.raises(ApiError):
        parse_chat({**body, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "chat")


def test_streamed_and_whole_tool_calls():
    """Streamed: id and name, then arguments, by index; whole: tool_calls, finish tool_calls."""
    answer = Answer(CHAT, "chat", tools=ToolCallParser(frozenset({"get_weather"})))
    payloads = delta_chunks(answer, answer.add(chunk(CALL[:20])))
    payloads += delta_chunks(answer, answer.add(chunk(CALL[20:], final=True)))
    deltas = [p["choices"][0]["delta"]["tool_calls"][0] for p in payloads]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[0]["index"] == deltas[1]["index"] == 0 and deltas[0]["id"].startswith("call_")
    assert json.loads(deltas[1]["function"]["arguments"])["city"] == "Paris"
    assert finish_chunk(answer)["choices"][0]["finish_reason"] == "tool_calls"
    message = whole_response(answer)["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["id"] == deltas[0]["id"]


def test_logprobs_shapes_for_chat_and_completions():
    """Chat: content entries with bytes and top_logprobs; completions: parallel lists."""
    entries = [
        {"token_id": 1, "token": "Hi", "logprob": -0.1, "top_logprobs": [
            {"token_id": 1, "token": "Hi", "logprob": -0.1},
            {"token_id": 2, "token": "Yo", "logprob": -2.5},
        ]},
        {"token_id": 3, "token": "!", "logprob": -0.3},
    ]  # fmt: skip
    chat = Answer(CHAT, "chat", logprobs=True)
    streamed = delta_chunks(chat, chat.add(chunk("Hi", logprobs=entries[:1])))
    content = streamed[0]["choices"][0]["logprobs"]["content"]
    assert content[0]["bytes"] == [72, 105] and content[0]["top_logprobs"][1]["token"] == "Yo"
    chat.add(chunk("!", final=True, logprobs=entries[1:]))
    whole = whole_response(chat)["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in whole] == ["Hi", "!"] and whole[1]["top_logprobs"] == []
    text = Answer(COMPLETION, "chat", logprobs=True)
    text.add(chunk("Hi!", final=True, logprobs=entries))
    logprobs = whole_response(text)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["Hi", "!"] and logprobs["text_offset"] == [0, 2]
    assert logprobs["top_logprobs"][0] == {"Hi": -0.1, "Yo": -2.5}
