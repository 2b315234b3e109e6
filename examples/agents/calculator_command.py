"""The calculator math agent as a program of its own, in plain `openai` calls: the `command` form.

  workflow.path = "arealjax.workflows.agent:OpenAIAgent"
  workflow.kwargs = {"command": "python examples/agents/calculator_command.py"}

The episode's endpoint and key come in OPENAI_BASE_URL and OPENAI_API_KEY (read by `openai.OpenAI()` itself), the
dataset row in AREALJAX_DATA. It loops: the model answers or calls `calculate`, whose result goes back as a tool
message. Its reward: 1 if the last answer's \\boxed{} holds the row's `answer`, posted to /rl/reward (a row without
one: the reward printed on the last stdout line is 0)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for examples.agents.calculator
from examples.agents.calculator import calculate  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluates an arithmetic expression (numbers, + - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def main() -> None:
    data = json.loads(os.environ["AREALJAX_DATA"])
    client = openai.OpenAI(max_retries=0)
    messages = [{"role": "system", "content": "Solve the problem. Use the calculate tool for arithmetic. Put the "
                                              "final answer in \\boxed{}."},
                {"role": "user", "content": data["prompt"]}]
    for _ in range(4):
        reply = client.chat.completions.create(model="arealjax", messages=messages, tools=TOOLS, max_tokens=64)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments).get("expression", ""))
            except (ValueError, AttributeError):
                result = "error: arguments must be {\"expression\": ...}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    boxed = re.findall(r"\\boxed\{([^}]*)\}", messages[-1].get("content") or "")
    if "answer" not in data:
        print(0.0)
        return
    reward = float(bool(boxed) and boxed[-1].strip() == str(data["answer"]).strip())
    httpx.post(f"{os.environ['OPENAI_BASE_URL']}/rl/reward", json={"reward": reward},
               headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}).raise_for_status()


if __name__ == "__main__":
    main()
