"""The OpenAI-compatible HTTP servers: `HTTPServer` (the routes of routes.answer over aiohttp, bounded bodies, keys)
and `AgentEndpoint`, what agents run as commands talk to: one server per workflow, one key per episode
(`arealjax.serve` is the other: a frozen model for any client).

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
    """One key's access: the session its requests go to and, for an episode, the reward its agent reported (None
    until it does)."""

    key: str
    session: ChatSession
    reward: float | None = None


class HTTPServer:
    """The OpenAI routes (routes.answer) over aiohttp on `host`:`port` (0: a free one), bodies bounded (`MAX_BODY`:
    413). A subclass says which grant (key and session) a request's key holds (`grant`; None: 401) and may serve
    routes of its own (`extra`)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, shutdown_seconds: float = 60.0):
        self.host, self.port, self.shutdown_seconds = host, port, shutdown_seconds
        self._runner = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: asyncio.Lock | None = None  # of self._loop: callers starting at once start one server

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
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=self.shutdown_seconds)
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self._runner, self.port = runner, runner.addresses[0][1]

    async def close(self) -> None:
        """Stops listening, lets the requests in flight finish (up to `shutdown_seconds`), then stops."""
        if self._runner is not None and self._loop is asyncio.get_running_loop():
            await self._runner.cleanup()
        self._runner = self._loop = self._starting = None

    def grant(self, key: str) -> Grant | None:
        """The grant of a request that carries `key` (`Authorization: Bearer <key>`); None: refused (401)."""
        raise NotImplementedError

    async def extra(self, request, grant: Grant, body: bytes) -> tuple[int, dict[str, str], bytes] | None:
        """A route of the subclass's own, answered; None: the OpenAI routes answer."""
        return None

    async def _handle(self, request):
        from aiohttp import web

        auth = request.headers.get("Authorization", "")
        grant = self.grant(auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else "")
        if grant is None:
            return refuse(APIError(self.refusal, None, 401, "authentication_error"))
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return refuse(APIError(f"request body exceeds {MAX_BODY} bytes", None, 413))
        answered = await self.extra(request, grant, body)
        if answered is None:
            answered = await answer(grant.session, request.method, request.path, body)
        return _response(*answered)

    refusal = "missing or wrong API key"


class AgentEndpoint(HTTPServer):
    refusal = "missing, wrong or expired API key (each episode has its own, valid while it runs)"

    def __init__(self, host: str = "127.0.0.1"):
        super().__init__(host)
        self._grants: dict[str, Grant] = {}

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

    def grant(self, key: str) -> Grant | None:
        return self._grants.get(key)

    async def extra(self, request, grant: Grant, body: bytes):
        """POST /v1/rl/reward: the agent's reward for its episode."""
        if not (request.method == "POST" and request.path.rstrip("/").endswith("/rl/reward")):
            return None
        try:
            reward = as_reward(json.loads(body or b"null")["reward"])  # as a reward function's (true is 1)
        except (ValueError, TypeError, KeyError):
            e = APIError('expected {"reward": <a finite number>}', "reward")
            return json_response(e.status, e.body())
        grant.reward = reward
        return json_response(200, {"ok": True})


def refuse(e: APIError):
    """A refusal in OpenAI's error shape."""
    return _response(*json_response(e.status, e.body()))


def _response(status: int, headers: dict[str, str], body: bytes):
    from aiohttp import web

    return web.Response(status=status, body=body, headers=headers)
