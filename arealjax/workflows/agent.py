"""Agents written against the OpenAI API, trained unchanged: one `openai.AsyncOpenAI` client per episode.

    workflow.path = "arealjax.workflows.agent:OpenAIAgent"
    workflow.kwargs = {"agent": "package.module:function"}

runs, for every episode, `async def function(client: openai.AsyncOpenAI, data: dict) -> float | None`. `client` is
the SDK's own class whose HTTP transport (`EpisodeTransport`) routes its requests in process to this episode's
`ChatSession` (workflows/chat.py): no socket, the SDK's request building and response parsing unchanged. `data` is
the dataset row: the prompt text under "prompt", every other field as the reward kwargs get them. The return value
is the reward; None scores the last assistant message with the run's reward function (`rewards.fn`).

    workflow.kwargs = {"command": "python my_agent.py"}

runs that shell command once per episode, with `OPENAI_BASE_URL` (the workflow's HTTP endpoint on 127.0.0.1:
workflows/endpoint.py), `OPENAI_API_KEY` (a key valid for this episode only) and `AREALJAX_DATA` (the row as JSON)
in its environment; it reports its reward with `POST $OPENAI_BASE_URL/rl/reward {"reward": r}` or as the number on
the last line of its stdout. The command runs under `guard.py`, which kills it if the trainer dies (kill -9
included), and only the end of its output is kept.

An agent that raises, runs past `timeout` seconds of its own (the time its calls wait for the model is not counted:
a busy generator rejects nothing), makes no call, exits non-zero or (a command) reports no reward ends as a
rejected episode: one log line with its reason, counted per reason (`metrics()`); the run goes on.
Every chat call's tokens, behaviour logprobs and versions go into the episode's trajectories (one per
token-faithful chain, all with the episode's reward)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx

from arealjax.rewards.service import as_reward, resolve
from arealjax.rl.trajectory import Trajectory
from arealjax.workflows.base import Episode
from arealjax.workflows.chat import ChatSession
from arealjax.workflows.endpoint import AgentEndpoint
from arealjax.workflows.routes import answer

log = logging.getLogger(__name__)


class EpisodeTransport(httpx.AsyncBaseTransport):
    """An httpx transport that answers the OpenAI API's routes (`answer`) from one `ChatSession` in process."""

    def __init__(self, session: ChatSession):
        self.session = session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        status, headers, content = await answer(self.session, request.method, request.url.path,
                                                await request.aread())
        return httpx.Response(status, headers=headers, content=content)


class Rejected(Exception):
    """An episode the agent's process ends without a trajectory: `reason` is its counter's name."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def client_for(session: ChatSession):
    """An `openai.AsyncOpenAI` whose requests `session` answers in process (no retries: a refusal is final)."""
    import openai

    return openai.AsyncOpenAI(api_key="arealjax-episode", base_url="http://episode.arealjax/v1", max_retries=0,
                              http_client=httpx.AsyncClient(transport=EpisodeTransport(session)))


GUARD = str(Path(__file__).with_name("guard.py"))  # runs each command, and kills it if the trainer dies


async def start_command(command: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    """`command` through the shell under `guard.py`, in a session of its own (its process group: the guard, the
    shell and what they start), stdout and stderr piped: killed with its group at a timeout, and by the guard if
    this process dies."""
    return await asyncio.create_subprocess_exec(sys.executable, "-I", GUARD, str(os.getpid()), command, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                start_new_session=True)


TAIL_BYTES = 1 << 16  # of a command agent's stdout and of its stderr, the end kept (its reward, its error)


async def _tail(stream: asyncio.StreamReader, limit: int = TAIL_BYTES) -> bytes:
    """Reads a stream to its end, keeping its last `limit` bytes: a program that prints without end costs the run
    no memory."""
    kept = bytearray()
    while chunk := await stream.read(1 << 16):
        kept += chunk
        del kept[:-limit]
    return bytes(kept)


class OpenAIAgent:
    """The workflow (module docstring). `agent`: 'package.module:function', or `command`: a shell command run once
    per episode; `timeout`: seconds of the agent's own time per episode (its model calls' time not counted: a busy
    generator does not reject episodes); `max_calls`: chat calls per episode; `host`: where the commands'
    endpoint listens (loopback unless set)."""

    def __init__(self, agent: str | None = None, command: str | None = None, timeout: float = 600.0,
                 max_calls: int = 64, model_name: str = "arealjax", host: str = "127.0.0.1"):
        if (agent is None) == (command is None):
            raise ValueError("workflow.kwargs: give exactly one of 'agent' ('module:function') or 'command' (a shell "
                             f"command); got agent={agent!r}, command={command!r}")
        if agent is not None:
            self.agent = resolve(agent, what="agent")
            if not asyncio.iscoroutinefunction(self.agent):
                raise ValueError(f"agent '{agent}': expected 'async def function(client, data) -> float | None'")
        elif not isinstance(command, str) or not command.strip():
            raise ValueError(f"workflow.kwargs.command = {command!r}: expected a shell command")
        self.name, self.command = agent or command, command
        self.timeout, self.max_calls, self.model_name = timeout, max_calls, model_name
        self.endpoint = AgentEndpoint(host) if command else None
        self.rejected: collections.Counter[str] = collections.Counter()
        self.calls = self.prefix_breaks = self.unparsed_tool_calls = 0

    async def run(self, ep: Episode) -> list[Trajectory] | None:
        session = ChatSession(ep, self.model_name, self.max_calls)
        data = {"prompt": ep.prompt.text or ep.tokenizer.decode(ep.prompt.tokens, skip_special_tokens=True),
                **ep.prompt.reward_kwargs}
        try:
            if self.command is None:
                async with client_for(session) as client:
                    reward = await self._within(self.agent(client, data), session)
            else:
                reward = await self._run_command(session, data)
        except TimeoutError:
            return self._reject(ep, "timeout", f"ran past workflow timeout {self.timeout} s of its own time")
        except Rejected as e:
            return self._reject(ep, e.reason, str(e))
        except Exception as e:  # noqa: BLE001 - an agent's error rejects its episode, not the run
            return self._reject(ep, "error", f"{type(e).__name__}: {e}")
        finally:
            self.calls += session.counts.calls
            self.prefix_breaks += session.counts.prefix_breaks
            self.unparsed_tool_calls += session.counts.unparsed_tool_calls
        if not any(c.turns.model_turns for c in session.chains):
            return self._reject(ep, "no_call", "made no chat call the model answered")
        if reward is None:
            reward = await ep.reward(session.last_assistant)
        try:
            reward = as_reward(reward)
        except (TypeError, ValueError) as e:
            return self._reject(ep, "bad_reward", f"{e} (or None: the run's reward function scores the last reply)")
        return session.trajectories(reward, final_reply=session.last_assistant, agent_calls=session.counts.calls,
                                    prefix_breaks=session.counts.prefix_breaks) or None

    async def _run_command(self, session: ChatSession, data: dict) -> float:
        """Runs the command with the episode's endpoint, key and row in its environment; its reward: what it posted
        to /v1/rl/reward, else the number on the last line of its stdout. Killed (its process group) at the
        timeout or if the episode is cancelled."""
        async with self.endpoint.episode(session) as grant:
            env = {**os.environ, "OPENAI_BASE_URL": self.endpoint.base_url, "OPENAI_API_KEY": grant.key,
                   "AREALJAX_DATA": json.dumps(data)}
            proc = await start_command(self.command, env)
            try:
                out, err, _ = await self._within(asyncio.gather(_tail(proc.stdout), _tail(proc.stderr), proc.wait()),
                                                 session)
            finally:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
            if proc.returncode:
                last = (err.decode(errors="replace").strip().splitlines() or [""])[-1][:300]
                raise Rejected("exit", f"exited with status {proc.returncode}: {last}")
            if grant.reward is not None:
                return grant.reward
            lines = out.decode(errors="replace").strip().splitlines()
            try:
                printed = float(lines[-1])
            except (IndexError, ValueError):
                raise Rejected("no_reward", "reported no reward (POST /v1/rl/reward {\"reward\": r}, or a number on "
                                            f"the last line of stdout; it ended with {lines[-1:]!r})") from None
            return printed  # checked as every reward is (a NaN is a bad reward)

    async def _within(self, awaitable, session: ChatSession):
        """`awaitable`'s result, or TimeoutError once the agent has spent `timeout` seconds of its own
        (session.agent_seconds: the time its model calls wait for a busy generator is not counted); cancelled
        then."""
        task = asyncio.ensure_future(awaitable)
        try:
            while (left := self.timeout - session.agent_seconds()) > 0:
                done, _ = await asyncio.wait({task}, timeout=left)
                if done:
                    return task.result()
            raise TimeoutError
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        """Stops the commands' endpoint, if one was started on this event loop."""
        if self.endpoint is not None:
            await self.endpoint.close()

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
