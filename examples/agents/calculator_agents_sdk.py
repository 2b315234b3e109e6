"""A math agent with a calculator tool, written with the OpenAI Agents SDK (`Agent`, `function_tool`, `Runner`) as
anyone would write it, trained by arealjax unchanged:

  workflow.path = "arealjax.workflows.agent:OpenAIAgent"
  workflow.kwargs = {"agent": "examples.agents.calculator_agents_sdk:solve"}

`client` is the episode's `openai.AsyncOpenAI` (its transport answers in process from the generator); the Agents SDK
speaks to it through the Responses API, its default (`solve`), or Chat Completions (`solve_chat`). Both return
None: the run's reward function scores the agent's last message (its final number)."""

from __future__ import annotations

from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from examples.agents import calculator

set_tracing_disabled(True)  # no tracing export: nothing leaves the machine

calculate = function_tool(calculator.calculate)


def agent(model) -> Agent:
    return Agent(name="calculator", model=model, tools=[calculate],
                 instructions="Solve the problem. Use the calculate tool for arithmetic. Reply with only the final "
                              "number.")


async def solve(client, data: dict) -> float | None:
    """The SDK's default model: the Responses API."""
    await Runner.run(agent(OpenAIResponsesModel(model="arealjax", openai_client=client)), data["prompt"], max_turns=4)
    return None


async def solve_chat(client, data: dict) -> float | None:
    """The same agent over Chat Completions (`OpenAIChatCompletionsModel`)."""
    await Runner.run(agent(OpenAIChatCompletionsModel(model="arealjax", openai_client=client)), data["prompt"],
                     max_turns=4)
    return None
