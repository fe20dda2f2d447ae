"""Agent frameworks' structured output against Tandem's chat completions, unmodified.

Each framework asks in its own way: pydantic-ai with a forced ``final_result``
tool (its default) or ``response_format`` (``NativeOutput``), instructor and
LangChain's ``with_structured_output`` with a named tool or a JSON schema,
openai-agents with a strict ``json_schema`` and, for tools, ``tool_choice:
required``. The demo model is far too small to follow
a schema on its own; what parses here does because decoding was constrained.
"""

from __future__ import annotations

import asyncio
from typing import Any

import instructor
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

PROMPT = "What is the weather in Paris?"


class Weather(BaseModel):
    city: str = Field(max_length=12)
    sunny: bool


@pytest.fixture()
def base_url(demo_server) -> str:
    return demo_server.base_url + "/v1"


# ---- pydantic-ai ---------------------------------------------------------------------


def _pydantic_ai_agent(base_url: str, output_type: Any) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("demo", provider=OpenAIProvider(base_url=base_url, api_key="unused"))
    return Agent(model, output_type=output_type, model_settings={"max_tokens": 48, "temperature": 0.0},
                 retries=0)


def test_pydantic_ai_tool_output(base_url: str) -> None:
    agent = _pydantic_ai_agent(base_url, Weather)
    result = agent.run_sync(PROMPT)
    assert isinstance(result.output, Weather)


def test_pydantic_ai_native_output(base_url: str) -> None:
    from pydantic_ai import NativeOutput

    agent = _pydantic_ai_agent(base_url, NativeOutput(Weather))
    result = agent.run_sync(PROMPT)
    assert isinstance(result.output, Weather)


# ---- instructor ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor(base_url: str, mode: instructor.Mode) -> None:
    client = instructor.from_openai(OpenAI(base_url=base_url, api_key="unused", max_retries=0), mode=mode)
    weather = client.chat.completions.create(
        model="demo", response_model=Weather, max_retries=0, max_tokens=48, temperature=0.0,
        messages=[{"role": "user", "content": PROMPT}])
    assert isinstance(weather, Weather)


# ---- LangChain -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(base_url: str, method: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="demo", base_url=base_url, api_key="unused", temperature=0.0, max_tokens=48,
                     max_retries=0)
    weather = llm.with_structured_output(Weather, method=method).invoke(PROMPT)
    assert isinstance(weather, Weather)


# ---- openai-agents ---------------------------------------------------------------------


def _agents_model(base_url: str) -> Any:
    from agents import OpenAIChatCompletionsModel, set_tracing_disabled

    set_tracing_disabled(True)  # nothing leaves the machine
    return OpenAIChatCompletionsModel(model="demo", openai_client=AsyncOpenAI(base_url=base_url, api_key="unused"))


def test_openai_agents_output_type(base_url: str) -> None:
    from agents import Agent, ModelSettings, Runner

    agent = Agent(name="weather", instructions="Answer about the weather.", model=_agents_model(base_url),
                  output_type=Weather, model_settings=ModelSettings(max_tokens=48, temperature=0.0))
    result = asyncio.run(Runner.run(agent, PROMPT, max_turns=1))
    assert isinstance(result.final_output, Weather)


def test_openai_agents_forced_tool_runs_the_tool(base_url: str) -> None:
    from agents import Agent, ModelSettings, Runner, function_tool

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    agent = Agent(name="weather", instructions="Use your tools.", model=_agents_model(base_url), tools=[get_weather],
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(max_tokens=48, temperature=0.0, tool_choice="required",
                                               parallel_tool_calls=False))
    result = asyncio.run(Runner.run(agent, PROMPT, max_turns=2))
    assert len(calls) == 1 and result.final_output == f"sunny in {calls[0]}"
