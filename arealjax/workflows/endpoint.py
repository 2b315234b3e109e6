"""The OpenAI-compatible HTTP endpoint that agents run as commands talk to: one server per workflow, one key per
episode.

`AgentEndpoint` serves, on `host` (127.0.0.1: loopback only unless configured otherwise) and a free port, the routes
of `agent.answer` for the episode whose key the request carries (`Authorization: Bearer <key>`), and
`POST /v1/rl/reward {"reward": r}`, where the agent reports its reward. Keys are unguessable (256 random bits) and
live only while their episode runs: a missing, wrong or expired key gets 401 and touches nothing, so one episode's
key can neither read nor score another's. Request bodies are bounded (`MAX_BODY`: 413), calls per episode by the
session (`max_calls`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

from arealjax.rewards.service import as_reward
from arealjax.workflows.chat import APIError, ChatSession
from arealjax.workflows.routes import MAX_BODY, answer, json_response


@dataclass
class Grant:
    """One episode's access: its key and the reward its agent reported (None until it does)."""

    key: str
    session: ChatSession
    reward: float | None = None


class AgentEndpoint:
    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self._grants: dict[str, Grant] = {}
        self._runner = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: asyncio.Lock | None = None  # of self._loop: episodes starting at once start one server
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> None:
        """Starts the server on the running event loop (again if the loop changed: a server lives on its loop)."""
        from aiohttp import web

        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._runner, self._loop, self._starting = None, loop, asyncio.Lock()
        async with self._starting:
            if self._runner is not None:
                return
            app = web.Application(client_max_size=MAX_BODY)
            app.router.add_route("*", "/{path:.*}", self._handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.host, 0)
            await site.start()
            self._runner, self.port = runner, runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None and self._loop is asyncio.get_running_loop():
            await self._runner.cleanup()
        self._runner = self._loop = self._starting = None

    @contextlib.asynccontextmanager
    async def episode(self, session: ChatSession) -> AsyncIterator[Grant]:
        """A key for `session`, dead once the block ends."""
        await self.start()
        grant = Grant(secrets.token_urlsafe(32), session)
        self._grants[grant.key] = grant
        try:
            yield grant
        finally:
            del self._grants[grant.key]

    async def _handle(self, request):
        from aiohttp import web

        auth = request.headers.get("Authorization", "")
        grant = self._grants.get(auth.removeprefix("Bearer ").strip()) if auth.startswith("Bearer ") else None
        if grant is None:
            return _refuse(APIError("missing, wrong or expired API key (each episode has its own, valid while it "
                                    "runs)", None, 401, "authentication_error"))
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _refuse(APIError(f"request body exceeds {MAX_BODY} bytes", None, 413))
        if request.method == "POST" and request.path.rstrip("/").endswith("/rl/reward"):
            try:
                reward = as_reward(json.loads(body or b"null")["reward"])  # as a reward function's (true is 1)
            except (ValueError, TypeError, KeyError):
                return _refuse(APIError('expected {"reward": <a finite number>}', "reward"))
            grant.reward = reward
            return _response(*json_response(200, {"ok": True}))
        return _response(*await answer(grant.session, request.method, request.path, body))


def _refuse(e: APIError):
    return _response(*json_response(e.status, e.body()))


def _response(status: int, headers: dict[str, str], body: bytes):
    from aiohttp import web

    return web.Response(status=status, body=body, headers=headers)
