"""The Responses API (`POST /v1/responses`: the OpenAI Agents SDK's default model) over one episode's `ChatSession`.

A request becomes chat messages (`instructions` → system; `input` text or items: messages, `function_call`,
`function_call_output`; flat function `tools`) and goes through `ChatSession.chat_completions`, so tokens, chains,
token fidelity and counts are the session's: an assistant turn sent back as the output items it came as (its
message, then its function calls) is rendered as the model's own text. The reply comes back as output items (a
`message` with `output_text`, a `function_call` per tool call) with the API's usage and status (`incomplete`
when `max_output_tokens` cut it). `text.format` (json_object, json_schema) constrains the reply as chat's
`response_format` does. What is not served (streaming, stored responses, reasoning, non-function tools,
`include`) is refused with OpenAI's error shape naming the field. A tool's `strict` flag is read as what it asks of
a model: a call that does not parse stays text (counted), as on the chat route.
"""

from __future__ import annotations

import uuid
from typing import Any

from arealjax.workflows.chat import APIError, ChatSession

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "temperature", "top_p", "max_output_tokens",
          "parallel_tool_calls", "include", "stream", "store", "metadata", "user", "text", "truncation", "reasoning",
          "previous_response_id", "top_logprobs"}
# accepted only at their default value (what the SDKs send unasked)
DEFAULTS = {"include": ([], None), "stream": (False, None), "store": (False, None), "tool_choice": ("auto", None),
            "truncation": ("disabled", None), "reasoning": (None,),
            "previous_response_id": (None,), "top_logprobs": (0, None)}
WHY = {"stream": "a streamed response", "store": "stored responses (nothing is kept after the call)",
       "previous_response_id": "stored responses: send the whole input", "reasoning": "reasoning settings",
       "include": "extra output (include)"}


async def responses(session: ChatSession, body: Any) -> dict:
    """A `/v1/responses` request body -> its response body; APIError for what is refused."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    if unknown := sorted(set(body) - FIELDS):
        raise APIError(f"unsupported field '{unknown[0]}' (served: {sorted(FIELDS)})", unknown[0])
    for key, allowed in DEFAULTS.items():
        if key in body and body[key] not in allowed:
            raise APIError(f"'{key}' = {body[key]!r} is not supported ({WHY.get(key, 'only ' + repr(allowed[0]))})",
                           key)
    chat = {"model": body.get("model", session.model_name), "messages": _messages(body), "tools": _tools(body),
            "response_format": _format(body)}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("max_output_tokens", "max_tokens"),
                         ("metadata", "metadata"), ("user", "user"), ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    try:
        reply = await session.chat_completions(chat)
    except APIError as e:  # named as the caller named it
        names = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}
        param = names.get(e.param, e.param)
        if param and param.startswith("messages["):
            param = "input"
        message = str(e).replace("'max_tokens'", "'max_output_tokens'").replace("'response_format'", "'text.format'")
        raise APIError(message, param, e.status, e.kind, e.code) from None
    (choice,) = reply["choices"]
    m = choice["message"]
    output = [{"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": m["content"], "annotations": [], "logprobs": []}]}
              ] if m["content"] else []
    output += [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"],
                "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
               for c in m.get("tool_calls") or []]
    cut = choice["finish_reason"] == "length"
    usage = reply["usage"]
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": reply["created"],
            "model": reply["model"], "status": "incomplete" if cut else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "instructions": body.get("instructions"), "tools": body.get("tools") or [], "tool_choice": "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "previous_response_id": None, "reasoning": None, "store": False,
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}}, "truncation": "disabled",
            "user": body.get("user"),
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": usage["total_tokens"]}}


def _messages(body: dict) -> list[dict]:
    """Chat messages of `instructions` and `input`; an assistant message and the function calls right after it are
    one assistant turn (as the reply that produced them)."""
    out: list[dict] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise APIError("'instructions' must be a string", "instructions")
        out.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError("'input' must be a string or a non-empty list of items", "input")
    turn_open = False  # the last message is an assistant turn that function calls may join
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and "role" in item:
            if item["role"] == "assistant":
                out.append({"role": "assistant", "content": _text(item.get("content"), i)})
            else:
                out.append({"role": item["role"], "content": item.get("content")})
            turn_open = item["role"] == "assistant"
        elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not turn_open:
                out.append({"role": "assistant", "content": ""})
                turn_open = True
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output, i)})
            turn_open = False
        else:
            raise APIError(f"input[{i}]: expected a message (role, content), a function_call (call_id, name, "
                           f"arguments) or a function_call_output (call_id, output); got type {kind!r}", f"input[{i}]")
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         for p in content):
        return "".join(p.get("text", "") for p in content)
    raise APIError(f"input[{i}].content: only text is supported (a string or text parts)", f"input[{i}]")


def _format(body: dict) -> dict | None:
    """`text.format` as chat's `response_format` (json_schema's name, schema and strict flattened in it)."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or text.get("verbosity") not in (
            None, "medium"):
        raise APIError(f"'text' = {text!r}: only {{'format': ...}} is served", "text")
    fmt = text.get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools") or []
    if not isinstance(tools, list) or any(not isinstance(t, dict) or t.get("type") != "function" or "name" not in t
                                          for t in tools):
        raise APIError("'tools' must be a list of function tools {'type': 'function', 'name', 'parameters'} "
                       "(no built-in tools)", "tools")
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
            for t in tools]
