"""Tools in the prompt: through a chat template that takes them, else the generic format."""

from __future__ import annotations

import copy

import pytest

from streaming_backend.errors import InvalidRequest
from streaming_backend.prompts import encode_prompt
from streaming_backend.wire import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
]
# A template that takes tools (as Qwen's and Hermes' do), reduced to what the test reads.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS={{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL={{ c.function.name }}{% endfor %}\n{% endfor %}"
    "[assistant]"
)


def _text(tokenizer, **prompt) -> str:
    return tokenizer.decode(encode_prompt(tokenizer, **prompt))


def test_generic_format_without_a_tool_template(tiny_loaded):
    """The default template knows no tools: they go in a system message, calls as markers."""
    text = _text(tiny_loaded.tokenizer, messages=HISTORY, tools=TOOLS)
    assert '"name": "get_weather"' in text and "The weather in a city" in text
    body = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    call = f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"
    assert call in text and "Sunny" in text
    assert text.index("get_weather") < text.index("Weather in Paris?")  # the system message


def test_a_template_that_takes_tools_renders_them(tiny_loaded):
    """A template reading `tools` gets the tools and the structured calls itself."""
    tokenizer = copy.copy(tiny_loaded.tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    text = _text(tokenizer, messages=HISTORY, tools=TOOLS)
    assert text.startswith("TOOLS=get_weather\n")
    assert "CALL=get_weather" in text and TOOL_CALL_OPEN not in text


# As Qwen 2.5's and Llama 3.1's templates write a call: the arguments through `tojson`.
TOJSON_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL={{ c.function.arguments | tojson }}{% endfor %}\n"
    "{% endfor %}{% if tools %}(tools){% endif %}[assistant]"
)


def test_a_template_gets_call_arguments_as_an_object(tiny_loaded):
    """OpenAI's arguments (JSON text) reach a tools template as an object, so `tojson` writes
    them once; arguments that are not JSON are passed as given."""
    tokenizer = copy.copy(tiny_loaded.tokenizer)
    tokenizer.chat_template = TOJSON_TEMPLATE
    text = _text(tokenizer, messages=HISTORY, tools=TOOLS)
    assert 'CALL={"city": "Paris"}' in text, text
    broken = copy.deepcopy(HISTORY)
    broken[1]["tool_calls"][0]["function"]["arguments"] = '{"city": Par'
    text = _text(tokenizer, messages=broken, tools=TOOLS)
    assert 'CALL="{\\"city\\": Par"' in text, text
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_bad_tools_are_invalid_requests(tiny_loaded):
    """Tools without messages, or not a list of function tools: InvalidRequest naming them."""
    with pytest.raises(InvalidRequest, match="tools needs messages"):
        encode_prompt(tiny_loaded.tokenizer, text="hi", tools=TOOLS)
    with pytest.raises(InvalidRequest, match=r"tools\[0\]"):
        encode_prompt(tiny_loaded.tokenizer, messages=HISTORY, tools='[{"type": "function"}]')
    bad_call = [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]
    with pytest.raises(InvalidRequest, match="tool_calls"):
        encode_prompt(tiny_loaded.tokenizer, messages=bad_call)


@pytest.mark.parametrize(
    "parameters, message",
    [
        ({"type": "object", "properties": {"a": {"type": 7}}}, "type must be a string"),
        ({"$ref": "#/$defs/missing"}, "does not exist"),
        ({"type": "string", "pattern": "(oops"}, "unclosed group"),
        ([], "must be a JSON schema object"),
    ],
)
def test_a_tools_parameters_schema_must_compile(tiny_loaded, parameters, message):
    """Every tool's parameters schema is compiled as a grammar's would be, whether or not a
    call is forced: one that does not compile is an InvalidRequest naming the tool's field."""
    tools = copy.deepcopy(TOOLS) + [{"type": "function", "function": {"name": "f"}}]
    tools[0]["function"]["parameters"] = parameters
    with pytest.raises(InvalidRequest, match=r"tools\[0\]\.function\.parameters") as info:
        encode_prompt(tiny_loaded.tokenizer, messages=HISTORY, tools=tools)
    assert message in str(info.value)
    defs = {"$defs": {"c": {"type": "string"}}, "properties": {"city": {"$ref": "#/$defs/c"}}}
    tools[0]["function"]["parameters"] = {"type": "object", **defs}
    assert encode_prompt(tiny_loaded.tokenizer, messages=HISTORY, tools=tools)
