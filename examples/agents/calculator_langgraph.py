"""The calculator math agent of calculator_agents_sdk.py written as a LangGraph ReAct agent over langchain-openai's
`ChatOpenAI`, trained by arealjax unchanged:

  workflow.path = "arealjax.workflows.agent:OpenAIAgent"
  workflow.kwargs = {"agent": "examples.agents.calculator_langgraph:solve"}

`ChatOpenAI` takes the episode's `openai.AsyncOpenAI` as its client (`async_client` / `root_async_client`), so its
calls reach the generator in process. LangChain re-serialises tool-call arguments; the episode matches the model's
calls by their ids. `solve` returns None: the run's reward function scores the last assistant message."""

from __future__ import annotations

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from examples.agents import calculator

calculate = tool(calculator.calculate)


async def solve(client, data: dict) -> float | None:
    llm = ChatOpenAI(model="arealjax", api_key="in-process", async_client=client.chat.completions,
                     root_async_client=client)
    agent = create_react_agent(llm, tools=[calculate], prompt="Solve the problem. Use the calculate tool for "
                                                              "arithmetic. Reply with only the final number.")
    await agent.ainvoke({"messages": [("user", data["prompt"])]}, config={"recursion_limit": 8})
    return None
