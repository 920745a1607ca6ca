"""An OpenAI Agents SDK agent with one function tool, run over /v1/responses (the Agents SDK is in
the test extra). Its first turn must call the tool (the SDK then resets tool_choice to auto); the
SDK takes an incomplete response for a failure, so EOS is pushed up once `min_tokens` are out
(under the first turn's grammar EOS stays masked until the call is whole): the answer ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from openai import AsyncOpenAI


async def run_weather_agent(client: AsyncOpenAI, model: str, model_dir: Path, question: str,
                            **settings: Any) -> tuple[list[str], Any]:
    """The cities the tool was called with and the SDK's run result; `settings` add to ModelSettings."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from transformers import AutoTokenizer

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    extra = {"min_tokens": 3, "logit_bias": {str(eos): 100}, **settings.pop("extra_body", {})}
    options = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 64, **settings}
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=model, openai_client=client),
                  model_settings=ModelSettings(extra_body=extra, **options))
    result = await Runner.run(agent, question, max_turns=4)
    return calls, result


def assert_called_once_and_answered(calls: list[str], result: Any) -> None:
    """The tool ran once with a city it knows, then the agent ended with text."""
    assert len(calls) == 1 and calls[0] in ("Paris", "Oslo", "Lima")
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
