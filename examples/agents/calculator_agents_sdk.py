"""A math agent with a calculator tool, written with the OpenAI Agents SDK (`Agent`, `function_tool`, `Runner`) as
anyone would write it, trained by arealjax unchanged:

  workflow.path = "arealjax.workflows.agent:OpenAIAgent"
  workflow.kwargs = {"agent": "examples.agents.calculator_agents_sdk:solve"}

`client` is the episode's `openai.AsyncOpenAI` (its transport answers in process from the generator); the Agents SDK
speaks to it through Chat Completions. `solve` returns None: the run's reward function scores the agent's last
message (the math task's `\\boxed{}` answer)."""

from __future__ import annotations

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

from examples.agents import calculator

set_tracing_disabled(True)  # no tracing export: nothing leaves the machine

calculate = function_tool(calculator.calculate)


async def solve(client, data: dict) -> float | None:
    agent = Agent(name="calculator", model=OpenAIChatCompletionsModel(model="arealjax", openai_client=client),
                  instructions="Solve the problem. Use the calculate tool for arithmetic. Put the final answer "
                               "in \\boxed{}.", tools=[calculate])
    await Runner.run(agent, data["prompt"], max_turns=4)
    return None
