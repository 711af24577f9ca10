"""A real framework on the OpenAI API: LangChain's ChatOpenAI, with_structured_output and
bind_tools, against a real bridge and tritonserver serving the default model."""

from __future__ import annotations

import langchain_openai  # the test extra installs it
import pydantic
import pytest
from bridge_support import bridge_to

pytestmark = pytest.mark.server


class City(pydantic.BaseModel):
    """A city and the country it is in."""

    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: int = pydantic.Field(ge=0, le=100)


class GetWeather(pydantic.BaseModel):
    """Get the current weather in a city."""

    city: str = pydantic.Field(max_length=30)


def chat_model(bridge):
    return langchain_openai.ChatOpenAI(
        model="chat",
        base_url=f"http://127.0.0.1:{bridge.port}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=120,
        max_retries=0,
    )


async def test_langchain_structured_output_and_tool_call(default_server):
    """with_structured_output gives a City; bind_tools with a forced tool gives a call whose
    args validate."""
    async with bridge_to(default_server) as bridge:
        llm = chat_model(bridge)
        city = await llm.with_structured_output(City).ainvoke("Tell me about Paris.")
        forced = llm.bind_tools([GetWeather], tool_choice="GetWeather")
        message = await forced.ainvoke("What is the weather in Rome?")
    assert isinstance(city, City)
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])
