"""The OpenAI API's routes over one episode's `ChatSession`, shared by the in-process transport (workflows/agent.py)
and the HTTP endpoint (workflows/endpoint.py)."""

from __future__ import annotations

import json

from arealjax.workflows.chat import APIError, ChatSession, stream_events
from arealjax.workflows.responses import responses

MAX_BODY = 4 << 20  # bytes of one request body


async def answer(session: ChatSession, method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """One OpenAI API request answered by `session`: (status, headers, body). POST /v1/chat/completions (JSON, or
    server-sent events with `stream`), POST /v1/responses (workflows/responses.py), GET /v1/models[/id]; anything else,
    and every refusal, in OpenAI's error shape."""
    path = path.rstrip("/")
    try:
        if len(body) > MAX_BODY:
            raise APIError(f"request body of {len(body)} bytes exceeds {MAX_BODY}", None, 413)
        if method == "GET" and path.endswith("/models"):
            return json_response(200, session.models())
        if method == "GET" and "/models/" in path:  # any name is served (a chat call's `model` is any name)
            return json_response(200, {**session.models()["data"][0], "id": path.split("/models/", 1)[1]})
        if method == "POST" and path.endswith(("/chat/completions", "/responses")):
            try:
                data = json.loads(body or b"null")
            except ValueError as e:
                raise APIError(f"the request body is not JSON: {e}") from None
            if path.endswith("/responses"):
                return json_response(200, await responses(session, data))
            response = await session.chat_completions(data)
            if data.get("stream"):
                include_usage = bool((data.get("stream_options") or {}).get("include_usage"))
                return 200, {"content-type": "text/event-stream"}, stream_events(response, include_usage)
            return json_response(200, response)
        raise APIError(f"{method} {path}: not served here (POST /v1/chat/completions, POST /v1/responses, "
                       "GET /v1/models)", None, 404, "not_found_error")
    except APIError as e:
        return json_response(e.status, e.body())


def json_response(status: int, body: dict) -> tuple[int, dict[str, str], bytes]:
    """A JSON response; a refusal tells the SDK not to retry it (it would retry a 429 or 5xx by default), except
    429 and 503 (a busy or stopping server: a retry may succeed)."""
    final = status >= 400 and status not in (429, 503)
    return status, {"content-type": "application/json", **({"x-should-retry": "false"} if final else {})}, \
        json.dumps(body).encode()
