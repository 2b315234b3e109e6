"""OpenAI chat completions over one episode, token-faithful: what an agent written against the OpenAI API talks to.

A `ChatSession` serves `POST /v1/chat/completions` bodies (and `GET /v1/models`) for one episode: it renders the
messages (and `tools`) through the tokenizer's chat template, generates through the episode (`Episode.generate`:
behaviour logprobs and versions per token, as every workflow), parses the model's tool calls back into
`tool_calls`, and records every call's tokens for the trajectory.

Token fidelity: a trajectory holds the tokens the generator was fed and produced, never re-tokenized text.
  - An assistant message the session itself returned is rendered as the model's own output text (the template
    is given a marker for its content, replaced afterwards), so the next prompt's text extends the previous
    prompt + output exactly.
  - A call whose prompt text extends a chain's text (its prompt + outputs so far) continues that chain: the
    generator is fed the chain's tokens and then the new text's tokens only (environment tokens: in the context,
    not trained). Otherwise the call starts a chain of its own (`prefix_breaks`): the agent edited the history,
    or the template dropped part of it. Each chain is one trajectory; all share the episode's reward.
Tools: a template that renders `tools` gets them; for one that does not (SmolLM2's, the tiny models'), a
Hermes-style block goes into the system message, assistant tool calls are rendered as `<tool_call>{json}
</tool_call>` and tool results as `<tool_response>` user turns. Tool calls are parsed from `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` (Hermes / Qwen); one that does not parse stays text and is counted.
Structured outputs: `response_format` json_object or json_schema constrains the reply by its grammar
(generation/grammar.py); with tools, a reply may be tool calls instead, each naming a tool with arguments of its
schema. Whatever is not supported is refused with the OpenAI error shape naming the field (`APIError`), never
ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

from arealjax.api import Completion, Routes
from arealjax.rl.trajectory import Trajectory
from arealjax.structured import response_grammar
from arealjax.workflows.base import Episode, Turns

HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
# request fields served, and those accepted only at their default value (what the SDKs send unasked)
FIELDS = {"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens", "max_completion_tokens",
          "stop", "n", "logprobs", "top_logprobs", "seed", "stream", "parallel_tool_calls", "user", "metadata",
          "store", "frequency_penalty", "presence_penalty", "stream_options", "response_format"}
DEFAULTS = {"frequency_penalty": (0, None), "presence_penalty": (0, None),
            "top_logprobs": (0, None), "tool_choice": ("auto", None), "store": (False, None)}
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """A request the endpoint refuses: HTTP `status` and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Chain:
    """One token-faithful conversation: its tokens so far (prompt, model outputs, environment), as a trajectory."""

    turns: Turns
    text: str  # the decoded tokens, special tokens kept: what the next prompt's text must start with
    stop_reason: str = ""  # of its last model turn: "stop", or "length" where it hit the token cap
    busy: bool = False  # a call on it is in flight: its output will follow these tokens, nothing else may


@dataclasses.dataclass
class Counts:
    calls: int = 0
    prefix_breaks: int = 0
    tool_calls: int = 0
    unparsed_tool_calls: int = 0


class ChatSession:
    """Serves one episode's chat-completion calls and assembles its trajectories (module docstring)."""

    def __init__(self, ep: Episode, model_name: str = "arealjax", max_calls: int = 64):
        self.ep, self.tok, self.model_name, self.max_calls = ep, ep.tokenizer, model_name, max_calls
        self.chains: list[Chain] = []
        self.counts = Counts()
        self._returned: dict[str, str] = {}  # key of an assistant message we returned -> the model's own text
        self._template_tools = "tools" in (getattr(self.tok, "chat_template", "") or "")
        # the content of the last call's first choice (the reply an agent carries on with): the default reward's
        # input, and the text evaluation reads the episode's answer from
        self.last_assistant: str = ""
        self.started = time.monotonic()
        self._waiting = 0  # model calls in flight
        self._waited = 0.0  # seconds with a model call in flight, up to _since
        self._since = self.started

    def agent_seconds(self) -> float:
        """Seconds since the session started during which no model call of it was in flight: the agent's own time
        (its code, its tools), not the time it waited for the generator, which a busy generator stretches."""
        now = time.monotonic()
        waited = self._waited + (now - self._since if self._waiting else 0.0)
        return now - self.started - waited

    async def _generate(self, tokens, **overrides):
        """Episode.generate, its time counted as waiting for the model (`agent_seconds`)."""
        now = time.monotonic()
        if self._waiting:
            self._waited += now - self._since
        self._since, self._waiting = now, self._waiting + 1
        try:
            return await self.ep.generate(tokens, **overrides)
        finally:
            now = time.monotonic()
            self._waited += now - self._since
            self._since, self._waiting = now, self._waiting - 1

    # ---- the endpoint ----

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "arealjax"}]}

    async def chat_completions(self, body: Any) -> dict:
        """A `/v1/chat/completions` request body -> its response body; APIError for what is refused."""
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        unknown = sorted(set(body) - FIELDS)
        if unknown:
            raise APIError(f"unsupported field '{unknown[0]}' (served: {sorted(FIELDS)})", unknown[0])
        for key, allowed in DEFAULTS.items():
            if key in body and body[key] not in allowed:
                raise APIError(f"'{key}' = {body[key]!r} is not supported (only {allowed[0]!r})", key)
        if not isinstance(body.get("stream", False), (bool, type(None))):
            raise APIError(f"'stream' = {body['stream']!r}: expected true or false", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise APIError(f"'stream_options' = {options!r}: only {{'include_usage': bool}} is served",
                           "stream_options")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError("'messages' must be a non-empty list", "messages")
        tools = body.get("tools") or []
        text = self.render(messages, tools)
        overrides, stops = self._sampling(body)
        if body.get("response_format") is not None:
            try:
                overrides["grammar"] = response_grammar(body["response_format"], tools)
            except ValueError as e:
                raise APIError(f"'response_format': {e}", "response_format") from None
        n = body.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
            raise APIError(f"'n' = {n!r}: expected an integer in [1, 16]", "n")
        if self.counts.calls + n > self.max_calls:
            raise APIError(f"this episode made {self.counts.calls} calls; {n} more pass its limit of "
                           f"{self.max_calls} (workflow.kwargs.max_calls)")
        base = self._continue(text, overrides.get("temperature", self.ep.sampling.temperature))
        prompt_tokens = len(base.turns.tokens)
        chains = [base] + [Chain(base.turns.branch(), base.text) for _ in range(n - 1)]  # n alternatives
        self.chains += chains[1:]
        draws = range(self.counts.calls, self.counts.calls + n)  # every call and alternative draws anew
        self.counts.calls += n
        for chain in chains:
            chain.busy = True
        try:
            outs = await asyncio.gather(*[self._generate(chain.turns.tokens, draw=d, **overrides)
                                          for chain, d in zip(chains, draws)])
        finally:
            for chain in chains:
                chain.busy = False
        choices, completion_tokens = [], 0
        for i, (chain, c) in enumerate(zip(chains, outs)):
            c, content = self._cut(c, stops)
            chain.turns.model(c)
            chain.text += self.tok.decode(c.output_tokens, skip_special_tokens=False)
            chain.stop_reason = c.stop_reason
            completion_tokens += len(c.output_tokens)
            choices.append(self._choice(i, c, content, tools, bool(body.get("logprobs")),
                                        body.get("parallel_tool_calls") is not False))
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", self.model_name), "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    # ---- rendering ----

    def render(self, messages: list, tools: list) -> str:
        """The prompt text of `messages` (OpenAI form) and `tools`, assistant messages this session returned
        rendered as the model's own output."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise APIError(f"messages[{i}]: expected an object with 'role' one of {ROLES}", f"messages[{i}]")
        if not isinstance(tools, list) or any(not isinstance(t, dict) or t.get("type") != "function"
                                              or "name" not in t.get("function", {}) for t in tools):
            raise APIError("'tools' must be a list of {'type': 'function', 'function': {'name', 'parameters'}}",
                           "tools")
        marks: dict[str, str] = {}
        out = []
        for i, m in enumerate(messages):
            role, content = m["role"], _content(m.get("content"), i)
            if role == "developer":
                role = "system"
            if role == "assistant":
                own = self._returned.get(_key(content, m.get("tool_calls")))
                if own is not None:
                    mark = f"\x00MSG{i}\x00"
                    marks[mark] = own
                    out.append({"role": "assistant", "content": mark})
                    continue
                calls = m.get("tool_calls") or []
                if calls and not self._template_tools:
                    content = "\n".join([content] * bool(content) + [_render_call(c) for c in calls])
                    out.append({"role": "assistant", "content": content})
                else:
                    out.append({"role": "assistant", "content": content, **({"tool_calls": [
                        _hf_call(c) for c in calls]} if calls else {})})
            elif role == "tool" and not self._template_tools:
                out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
            else:
                out.append({"role": role, "content": content,
                            **({"tool_call_id": m["tool_call_id"]} if "tool_call_id" in m else {})})
        kwargs = {}
        if tools and self._template_tools:
            kwargs["tools"] = tools
        elif tools:
            block = HERMES_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
            else:
                out.insert(0, {"role": "system", "content": block})
        text = self.tok.apply_chat_template(out, add_generation_prompt=True, **kwargs)
        for mark, own in marks.items():
            if mark not in text:  # the template dropped or rewrote the message: no longer the model's own text
                continue
            text = text.replace(mark, own, 1)  # the model's end of turn, its last token, is the template's
        return text

    def _continue(self, text: str, temperature: float) -> Chain:
        """The chain whose text `text` extends (its tokens then the extension's: environment tokens), or a new one.
        A chain with a call in flight is branched instead (concurrent calls of one agent): the copy holds the
        tokens that call was fed, and each call's output follows exactly the tokens it was fed. Refuses (before
        changing anything) a prompt that leaves no room for a reply."""
        logprob_t = temperature if temperature > 0 else 1.0
        for chain in reversed(self.chains):
            if text.startswith(chain.text) and chain.turns.temperature in (None, logprob_t):
                rest = self.tok.encode(text[len(chain.text):]) if len(text) > len(chain.text) else []
                self._room(len(chain.turns.tokens) + len(rest))
                if chain.busy:
                    chain = Chain(chain.turns.branch(), chain.text)
                    self.chains.append(chain)
                if rest:
                    chain.turns.env(rest)
                chain.text = text
                return chain
        tokens = self.tok.encode(text)
        self._room(len(tokens))
        if self.chains:
            self.counts.prefix_breaks += 1
        chain = Chain(Turns(tokens), text)
        self.chains.append(chain)
        return chain

    def _room(self, n: int) -> None:
        if n >= self.ep.max_len:
            raise APIError(f"the conversation is {n} tokens: no room for a reply in max_len={self.ep.max_len}",
                           "messages", code="context_length_exceeded")

    def _sampling(self, body: dict) -> tuple[dict, list[str]]:
        """The sampling overrides of a request, and its stop strings."""
        out: dict[str, Any] = {}
        stops: list[str] = []
        if body.get("temperature") is not None:
            t = body["temperature"]
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t <= 2:
                raise APIError(f"'temperature' = {t!r}: expected a number in [0, 2]", "temperature")
            out["temperature"] = float(t)
        if body.get("top_p") is not None:
            p = body["top_p"]
            if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
                raise APIError(f"'top_p' = {p!r}: expected a number in (0, 1]", "top_p")
            out["top_p"] = float(p)
        for key in ("max_completion_tokens", "max_tokens"):
            if body.get(key) is not None:
                m = body[key]
                if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                    raise APIError(f"'{key}' = {m!r}: expected an integer ≥ 1", key)
                out["max_new_tokens"] = min(m, self.ep.sampling.max_new_tokens)
                break
        if body.get("seed") is not None:  # accepting it would be ignoring it
            raise APIError("'seed': draws are keyed by the run's seed, the prompt, the sample and the position "
                           "(an episode replays exactly on resume); leave it out", "seed")
        stop = body.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
                raise APIError("'stop' must be a string or a list of at most 4 strings", "stop")
            ids = []
            for s in stops:
                enc = self.tok.encode(s)
                if len(enc) != 1:
                    raise APIError(f"'stop' = {s!r} is {len(enc)} tokens for this tokenizer; only single-token stop "
                                   f"strings are supported (generation stops on token ids)", "stop")
                ids += enc
            out["stop_token_ids"] = tuple(dict.fromkeys((*self.ep.sampling.stop_token_ids, *ids)))
        return out, stops

    # ---- the response ----

    def _cut(self, c: Completion, stops: list[str]) -> tuple[Completion, str]:
        """The completion up to the first token at which its text holds a stop string (the model may write one
        inside a longer token, which the stop ids do not catch), and its text without the stop string: what
        OpenAI returns. The tokens kept are exactly the generator's, so the trajectory stays faithful."""
        text = self.tok.decode(c.output_tokens, skip_special_tokens=True)
        if not any(s in text for s in stops):
            return c, text
        lo, hi = 0, len(c.output_tokens)  # the shortest prefix whose text holds a stop string: hi tokens
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            prefix = self.tok.decode(c.output_tokens[:mid], skip_special_tokens=True)
            lo, hi = (lo, mid) if any(s in prefix for s in stops) else (mid, hi)
        text = self.tok.decode(c.output_tokens[:hi], skip_special_tokens=True)
        end = min(text.index(s) for s in stops if s in text)
        n = len(c.prompt_tokens) + hi
        return dataclasses.replace(
            c, output_tokens=c.output_tokens[:hi], logprobs=c.logprobs[:hi], versions=c.versions[:hi],
            stop_reason="stop", routes=None if c.routes is None else Routes(c.routes.experts[:n])), text[:end]

    def _choice(self, i: int, c: Completion, text: str, tools: list, logprobs: bool, parallel: bool) -> dict:
        eos = set(self.tok.eos_ids)
        out = list(c.output_tokens)
        own = self.tok.decode(out[:-1] if out and out[-1] in eos else out, skip_special_tokens=False)
        calls, content = [], text
        if tools:
            calls, content = self._parse_calls(text)
            calls = calls if parallel else calls[:1]  # parallel_tool_calls false: at most one, as OpenAI's
            self.counts.tool_calls += len(calls)
        finish = "tool_calls" if calls else ("length" if c.stop_reason == "length" else "stop")
        message = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = calls
        self._returned[_key(message["content"] or "", calls)] = own
        if i == 0:
            self.last_assistant = content
        choice = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
        if logprobs:
            choice["logprobs"] = {"content": [
                {"token": self.tok.decode([t], skip_special_tokens=False), "logprob": float(lp),
                 "bytes": list(self.tok.token_bytes(t)), "top_logprobs": []}
                for t, lp in zip(c.output_tokens, c.logprobs)]}
        return choice

    def _parse_calls(self, text: str) -> tuple[list[dict], str]:
        """(tool_calls, the text outside them) from `<tool_call>{json}</tool_call>` blocks; a block that does not
        parse as {"name": str, "arguments": object} stays in the text (counted)."""
        calls, kept, last = [], [], 0
        for m in TOOL_CALL.finditer(text):
            try:
                call = json.loads(m.group(1))
                if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                    raise ValueError(call)
                args = call.get("arguments", {})
                if isinstance(args, str):
                    args = json.loads(args)
                if not isinstance(args, dict):
                    raise ValueError(args)
            except ValueError:
                self.counts.unparsed_tool_calls += 1
                continue
            kept.append(text[last:m.start()])
            last = m.end()
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
        kept.append(text[last:])
        return calls, "".join(kept).strip()

    # ---- the trajectories ----

    def trajectories(self, reward: float, **info: Any) -> list[Trajectory]:
        """One trajectory per chain with a model turn, each with the episode's reward and its last turn's stop
        reason."""
        return [c.turns.build(reward, chains=len(self.chains), stop_reason=c.stop_reason, **info)
                for c in self.chains if c.turns.model_turns]


def _content(content: Any, i: int) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("text", "input_text",
                                                                                     "output_text") for p in content):
        return "".join(p.get("text", "") for p in content)
    raise APIError(f"messages[{i}].content: only text is supported (a string or text parts)",
                   f"messages[{i}].content")


def _key(content: str, calls: Sequence[dict] | None) -> str:
    """What identifies an assistant message the session returned when the agent sends it back."""
    names = [(c.get("id"), c.get("function", {}).get("name")) for c in calls or []]
    return json.dumps([content or "", names])


def _render_call(call: dict) -> str:
    """An OpenAI tool call as the Hermes block the model writes (for a template without tools)."""
    f = _hf_call(call)["function"]
    return "<tool_call>\n" + json.dumps(f, ensure_ascii=False) + "\n</tool_call>"


def _hf_call(call: dict) -> dict:
    """An OpenAI tool call as HF chat templates take it (arguments as an object)."""
    f = call.get("function", {})
    args = f.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return {"type": "function", "id": call.get("id"), "function": {"name": f.get("name"), "arguments": args}}


def stream_events(response: dict, include_usage: bool) -> bytes:
    """A chat.completion response as the server-sent events of `stream: true`: per choice, the role with the
    content (and its logprobs), then its tool calls, then its finish reason; the usage last when asked
    (`stream_options.include_usage`); `data: [DONE]`. The whole reply is generated before the first event (the
    tokens are the trajectory's either way), so a streaming agent gets it in a few chunks."""
    head = {k: response[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks = []
    for c in response["choices"]:
        m = c["message"]
        chunks.append({"index": c["index"], "delta": {"role": "assistant", "content": m["content"] or ""},
                       "logprobs": c["logprobs"], "finish_reason": None})
        if m.get("tool_calls"):
            chunks.append({"index": c["index"], "delta": {"tool_calls": [
                {"index": k, **call} for k, call in enumerate(m["tool_calls"])]}, "finish_reason": None})
        chunks.append({"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]})
    events = [{**head, "choices": [choice]} for choice in chunks]
    if include_usage:
        events.append({**head, "choices": [], "usage": response["usage"]})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
