"""Agents written against the OpenAI API, trained unchanged: one `openai.AsyncOpenAI` client per episode.

    workflow.path = "arealjax.workflows.agent:OpenAIAgent"
    workflow.kwargs = {"agent": "package.module:function"}

runs, for every episode, `async def function(client: openai.AsyncOpenAI, data: dict) -> float | None`. `client` is
the SDK's own class whose HTTP transport (`EpisodeTransport`) routes its requests in process to this episode's
`ChatSession` (workflows/chat.py): no socket, the SDK's request building and response parsing unchanged. `data` is
the dataset row: the prompt text under "prompt", every other field as the reward kwargs get them. The return value
is the reward; None scores the last assistant message with the run's reward function (`rewards.fn`).

An agent that raises, runs past `timeout` seconds, or makes no call ends as a rejected episode: one log line with
its reason, counted per reason (`metrics()`); the run goes on. Every chat call's tokens, behaviour logprobs and
versions go into the episode's trajectories (one per token-faithful chain, all with the episode's reward).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from typing import Any

import httpx

from arealjax.rewards.service import resolve
from arealjax.rl.trajectory import Trajectory
from arealjax.workflows.base import Episode
from arealjax.workflows.chat import APIError, ChatSession, stream_events
from arealjax.workflows.responses import responses

log = logging.getLogger(__name__)
MAX_BODY = 4 << 20  # bytes of one request body


class EpisodeTransport(httpx.AsyncBaseTransport):
    """An httpx transport that answers the OpenAI API's routes from one `ChatSession` in process:
    POST /v1/chat/completions, POST /v1/responses (workflows/responses.py), GET /v1/models; anything else is a 404
    in OpenAI's error shape."""

    def __init__(self, session: ChatSession):
        self.session = session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path.rstrip("/")
        try:
            body = await request.aread()
            if len(body) > MAX_BODY:
                raise APIError(f"request body of {len(body)} bytes exceeds {MAX_BODY}", None, 413)
            if request.method == "GET" and path.endswith("/models"):
                return _json(200, self.session.models())
            if request.method == "POST" and path.endswith(("/chat/completions", "/responses")):
                try:
                    data = json.loads(body or b"null")
                except ValueError as e:
                    raise APIError(f"the request body is not JSON: {e}") from None
                if path.endswith("/responses"):
                    return _json(200, await responses(self.session, data))
                response = await self.session.chat_completions(data)
                if data.get("stream"):
                    include_usage = bool((data.get("stream_options") or {}).get("include_usage"))
                    return httpx.Response(200, content=stream_events(response, include_usage),
                                          headers={"content-type": "text/event-stream"})
                return _json(200, response)
            raise APIError(f"{request.method} {path}: not served here (POST /v1/chat/completions, POST /v1/responses, "
                           "GET /v1/models)",
                           None, 404, "not_found_error")
        except APIError as e:
            return _json(e.status, e.body())


def _json(status: int, body: dict) -> httpx.Response:
    """A JSON response; a refusal tells the SDK not to retry it (it would retry a 429 or 5xx by default)."""
    return httpx.Response(status, json=body, headers={"content-type": "application/json",
                                                      **({"x-should-retry": "false"} if status >= 400 else {})})


def client_for(session: ChatSession):
    """An `openai.AsyncOpenAI` whose requests `session` answers in process (no retries: a refusal is final)."""
    import openai

    return openai.AsyncOpenAI(api_key="arealjax-episode", base_url="http://episode.arealjax/v1", max_retries=0,
                              http_client=httpx.AsyncClient(transport=EpisodeTransport(session)))


class OpenAIAgent:
    """The workflow (module docstring). `agent`: 'package.module:function'; `timeout`: seconds per episode;
    `max_calls`: chat calls per episode."""

    def __init__(self, agent: str, timeout: float = 600.0, max_calls: int = 64, model_name: str = "arealjax"):
        self.agent = resolve(agent, what="agent")
        if not asyncio.iscoroutinefunction(self.agent):
            raise ValueError(f"agent '{agent}': expected 'async def function(client, data) -> float | None'")
        self.name, self.timeout, self.max_calls, self.model_name = agent, timeout, max_calls, model_name
        self.rejected: collections.Counter[str] = collections.Counter()
        self.calls = self.prefix_breaks = self.unparsed_tool_calls = 0

    async def run(self, ep: Episode) -> list[Trajectory] | None:
        session = ChatSession(ep, self.model_name, self.max_calls)
        client = client_for(session)
        data = {"prompt": ep.tokenizer.decode(ep.prompt.tokens, skip_special_tokens=False),
                **ep.prompt.reward_kwargs}
        try:
            async with client:
                reward = await asyncio.wait_for(self.agent(client, data), self.timeout)
        except TimeoutError:
            return self._reject(ep, "timeout", f"ran past workflow timeout {self.timeout} s")
        except Exception as e:  # noqa: BLE001 - an agent's error rejects its episode, not the run
            return self._reject(ep, "error", f"{type(e).__name__}: {e}")
        finally:
            self.calls += session.counts.calls
            self.prefix_breaks += session.counts.prefix_breaks
            self.unparsed_tool_calls += session.counts.unparsed_tool_calls
        if not session.chains:
            return self._reject(ep, "no_call", "made no chat call")
        if reward is None:
            reward = await ep.reward(session.last_assistant)
        if not isinstance(reward, (int, float)):
            return self._reject(ep, "bad_reward", f"returned {reward!r}, expected a number or None")
        return session.trajectories(float(reward), agent_calls=session.counts.calls,
                                    prefix_breaks=session.counts.prefix_breaks) or None

    def _reject(self, ep: Episode, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        log.warning("agent %s, episode %s rejected: %s", self.name, ep.request_id, detail)
        return None

    def metrics(self) -> dict[str, Any]:
        """Cumulative counts: chat calls, chains broken off (prefix breaks), tool calls that did not parse, and
        rejected episodes by reason."""
        return {"agent_calls": self.calls, "agent_prefix_breaks": self.prefix_breaks,
                "agent_unparsed_tool_calls": self.unparsed_tool_calls,
                **{f"agent_rejected_{k}": v for k, v in sorted(self.rejected.items())}}
