"""Prompts: messages validated, the chat template applied, the shipped chat prompts loaded."""

import json
import unicodedata

import pytest

from streaming_backend.errors import InvalidRequest
from streaming_backend.prompts import (
    DEFAULT_PROMPTS_FILE,
    encode_prompt,
    load_chat_prompts,
    parse_messages,
    render_chat,
)
from streaming_backend.wire import ROLES


def test_chat_messages_use_the_chat_template(tiny_loaded):
    """Messages are rendered with the model's chat template, ready for the answer."""
    ids = encode_prompt(tiny_loaded.tokenizer, messages=[{"role": "user", "content": "hi"}])
    text = tiny_loaded.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "hi" in text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "give exactly one of text_input, messages or input_ids"),
        ({"text": "a", "input_ids": [1]}, "(got text_input, input_ids)"),
        ({"text": "  "}, "text_input is empty"),
        ({"messages": "[{"}, "messages is not valid JSON"),
        ({"messages": []}, "messages must be a non-empty JSON list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be one of"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string"),
    ],
)
def test_bad_prompts_are_rejected(tiny_loaded, kwargs, message):
    """Each malformed prompt names what was wrong."""
    with pytest.raises(InvalidRequest) as info:
        encode_prompt(tiny_loaded.tokenizer, **kwargs)
    assert message in str(info.value)


def test_every_role_is_accepted_and_extra_keys_dropped():
    """All chat roles (tool included) pass; only role and content are kept."""
    messages = [{"role": role, "content": role, "name": "x"} for role in ROLES]
    assert parse_messages(messages) == [{"role": r, "content": r} for r in ROLES]
    assert parse_messages(json.dumps(messages).encode()) == parse_messages(messages)


@pytest.mark.parametrize(
    "messages, message",
    [
        ('{"role": "user"}', "must be a non-empty JSON list"),
        (["hi"], "messages[0] must be an object with role and content"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "messages[1].role must be one of"),
        (b"\xff", "messages is not valid JSON"),
    ],
)
def test_malformed_messages(messages, message):
    """Each malformed conversation names its first problem."""
    with pytest.raises(InvalidRequest) as info:
        parse_messages(messages)
    assert message in str(info.value)


def test_the_template_renders_every_turn(tiny_loaded):
    """A multi-turn conversation keeps each turn in order, then opens the assistant's turn."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "Hi 👋"},
        {"role": "user", "content": "Again?"},
    ]
    text = tiny_loaded.tokenizer.decode(render_chat(tiny_loaded.tokenizer, messages))
    positions = [text.index(m["content"]) for m in messages]
    assert positions == sorted(positions)
    assert text.endswith("<|im_start|>assistant\n")


class _NoTemplate:
    chat_template = None


class _Refusing:
    chat_template = "strict"

    def apply_chat_template(self, *args, **kwargs):
        raise ValueError("roles must alternate")


def test_a_model_without_or_refusing_a_template():
    """No template, or a template that raises, is the client's error with a clear message."""
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidRequest, match="no chat template: send text_input"):
        render_chat(_NoTemplate(), messages)
    with pytest.raises(InvalidRequest, match="rejected these messages: roles must alternate"):
        render_chat(_Refusing(), messages)


def test_input_ids_and_text(tiny_loaded):
    """input_ids pass through as ints; text is tokenized as the tokenizer does."""
    assert encode_prompt(tiny_loaded.tokenizer, input_ids=(5, 6)) == [5, 6]
    expected = tiny_loaded.tokenizer("Hello world", add_special_tokens=True)["input_ids"]
    assert encode_prompt(tiny_loaded.tokenizer, text="Hello world") == expected
    with pytest.raises(InvalidRequest, match="the prompt is empty"):
        encode_prompt(tiny_loaded.tokenizer, input_ids=[])


def test_the_shipped_chat_prompts():
    """The package's prompts: English, Chinese, emoji, a system prompt and a multi-turn chat."""
    assert DEFAULT_PROMPTS_FILE.is_file()
    prompts = load_chat_prompts()
    text = json.dumps(prompts, ensure_ascii=False)
    assert len(prompts) >= 4
    assert "France" in prompts[0][-1]["content"]
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text)
    assert any(unicodedata.category(ch) == "So" for ch in text)  # an emoji
    assert any(m["role"] == "system" for chat in prompts for m in chat)
    assert any(sum(m["role"] == "user" for m in chat) >= 2 for chat in prompts)
    assert all(chat[-1]["role"] == "user" for chat in prompts)


def test_load_chat_prompts_from_a_file(tmp_path):
    """A JSONL file of {"messages": [...]} lines; blank lines are skipped, bad ones rejected."""
    path = tmp_path / "p.jsonl"
    line = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    path.write_text(f"{line}\n\n{line}\n", encoding="utf-8")
    assert load_chat_prompts(path) == [[{"role": "user", "content": "hi"}]] * 2
    path.write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    with pytest.raises(InvalidRequest, match="role must be one of"):
        load_chat_prompts(path)
