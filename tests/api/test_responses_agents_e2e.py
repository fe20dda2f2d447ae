"""openai-agents against the demo model over the Responses API (its default model class).

The agent runs as a user's would: ``OpenAIResponsesModel`` on an ``AsyncOpenAI``
client whose base URL is the server. SmolLM2-135M follows a pattern it has
seen, so a few earlier turns (tool calls, or JSON answers) make it call the
tool, or answer in the output type's shape.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

agents = pytest.importorskip("agents")

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool  # noqa: E402
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem  # noqa: E402

from tests.api.test_responses_e2e import CALL, shots  # noqa: E402


class Weather(BaseModel):
    city: str
    sunny: bool


@pytest.fixture(scope="module", autouse=True)
def no_tracing():
    """Traces would go to OpenAI's servers, which no test reaches."""
    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(False)


def model(base_url: str) -> OpenAIResponsesModel:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return OpenAIResponsesModel(model="demo", openai_client=client)


SETTINGS = ModelSettings(temperature=0, max_tokens=40)


@pytest.mark.slow  # test_frameworks_e2e's openai-agents function tool covers the path
def test_agent_calls_a_function_tool_and_answers_streamed(demo_server):
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        asked.append(city)
        return "sunny"

    agent = Agent(name="weather", instructions="You call tools.", model=model(demo_server.base_url),
                  tools=[get_weather], model_settings=SETTINGS)

    async def run():
        result = Runner.run_streamed(agent, shots("Weather in Paris?", CALL), max_turns=3)
        events = [ev async for ev in result.stream_events()]
        return result, events

    result, events = asyncio.run(run())
    assert asked == ["Paris"]
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    assert isinstance(result.final_output, str) and result.final_output
    assert any(ev.type == "raw_response_event" and ev.data.type == "response.function_call_arguments.delta"
               for ev in events)


def test_agent_answers_in_its_output_type(demo_server):
    agent = Agent(name="json", instructions="Answer in JSON.", model=model(demo_server.base_url),
                  output_type=Weather, model_settings=SETTINGS)
    answer = Weather(city="Paris", sunny=True).model_dump_json()
    result = Runner.run_sync(agent, shots("Weather in Paris?", answer), max_turns=1)
    assert result.final_output == Weather(city="Paris", sunny=True)


def test_agent_output_type_without_examples(demo_server):
    agent = Agent(name="json", instructions="Answer in JSON.", model=model(demo_server.base_url),
                  output_type=Weather, model_settings=ModelSettings(temperature=0, max_tokens=24))
    result = Runner.run_sync(agent, "Is it sunny in Paris?", max_turns=1)
    assert isinstance(result.final_output, Weather)
