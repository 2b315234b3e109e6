"""A judge model as the reward: any OpenAI-compatible endpoint scores each completion.

    rewards.fn = "arealjax.rewards.judge:judge"
    rewards.judge.base_url = "http://127.0.0.1:8000/v1"   # e.g. python -m arealjax.serve --model=DIR

Each completion is put in `rewards.judge.prompt` (a template over `{prompt}`, `{completion}` and the row's fields,
e.g. `{answer}`), sent as one user message at temperature 0, and the reply read by `rewards.judge.parse`: `number`
(the first number in it, divided by `max_score`), `yes_no` (1 for yes, 0 for no) or `json:FIELD` (that field of the
JSON object in it, divided by `max_score`). Calls run concurrently on the reward service's event loop
(`rewards.concurrency` at once). A reply that times out (`judge.timeout`), is refused (an HTTP error) or does not
parse is a failed reward for that sample, counted and logged with the URL and the reason under the service's
failure rate. An endpoint that cannot be reached is found by a probe (`GET /models`) at start-up and after a
connection failure while running, and ends the run with one message naming its URL.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import string
from typing import Any

from arealjax.rewards.service import RewardFatal

DEFAULT_PROMPT = (
    "You are grading a response to a question.\n\nQuestion:\n{prompt}\n\nResponse:\n{completion}\n\n"
    "How correct and helpful is the response, from 0 (wrong or useless) to 10 (correct and complete)? "
    "Reply with the number only.")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
PROBES, PROBE_WAIT = 3, 5.0  # GET /models tries before the endpoint is called unreachable, seconds between them


class _Endpoint:
    """One judge endpoint's client and the model it serves (on the service's event loop)."""

    def __init__(self, cfg: dict):
        import httpx

        self.url = cfg["base_url"].rstrip("/")
        key = os.environ.get(cfg.get("api_key_env") or "", "")
        self.client = httpx.AsyncClient(headers={"Authorization": f"Bearer {key or 'none'}"},
                                        timeout=float(cfg.get("timeout", 8.0)))
        self.model = cfg.get("model") or ""
        self.probing: asyncio.Task | None = None

    async def probe(self) -> None:
        """`GET /models` until it answers (up to PROBES tries); RewardFatal naming the URL when it never does. Fills
        the model name from the first model served when none was given."""
        import httpx

        why = ""
        for attempt in range(PROBES):
            try:
                r = await self.client.get(f"{self.url}/models")
                r.raise_for_status()
                if not self.model:
                    self.model = r.json()["data"][0]["id"]
                return
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                why = f"{type(e).__name__}: {e}"
            if attempt + 1 < PROBES:
                await asyncio.sleep(PROBE_WAIT)
        raise RewardFatal(f"the judge at {self.url} cannot be reached ({PROBES} tries of GET /models): {why}")


_ENDPOINTS: dict[tuple[int, str], _Endpoint] = {}  # (event loop, URL): one client per service loop and endpoint


def _endpoint(cfg: dict) -> _Endpoint:
    key = (id(asyncio.get_running_loop()), cfg["base_url"])
    if key not in _ENDPOINTS:
        _ENDPOINTS[key] = _Endpoint(cfg)
    return _ENDPOINTS[key]


async def judge(completion: str, *, prompt: str = "", judge: dict, **row: Any) -> float:
    """The judge's score of `completion` (module docstring)."""
    import httpx

    ep = _endpoint(judge)
    text = render(judge.get("prompt") or DEFAULT_PROMPT, prompt=prompt, completion=completion, **row)
    body = {"model": ep.model, "messages": [{"role": "user", "content": text}], "temperature": 0.0,
            "max_tokens": int(judge.get("max_tokens", 16))}
    try:
        r = await ep.client.post(f"{ep.url}/chat/completions", json=body)
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # is it gone? one probe at a time for every call
        if ep.probing is None or ep.probing.done():
            ep.probing = asyncio.ensure_future(ep.probe())
        await ep.probing
        raise RuntimeError(f"judge {ep.url}: {type(e).__name__}: {e}") from None
    except httpx.TimeoutException:
        raise TimeoutError(f"judge {ep.url}: no reply within {ep.client.timeout.read}s") from None
    if r.status_code != 200:
        raise RuntimeError(f"judge {ep.url}: refused (HTTP {r.status_code}: {r.text[:200]})")
    try:
        reply = r.json()["choices"][0]["message"]["content"] or ""
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"judge {ep.url}: not a chat completion: {r.text[:200]!r}") from None
    return parse(reply, judge.get("parse", "number"), float(judge.get("max_score", 10.0)), ep.url)


async def _start(judge: dict) -> None:
    """The service's start-up hook: the endpoint answers `GET /models` (else the run does not start)."""
    await _endpoint(judge).probe()


async def _close() -> None:
    loop = id(asyncio.get_running_loop())
    for key in [k for k in _ENDPOINTS if k[0] == loop]:
        await _ENDPOINTS.pop(key).client.aclose()


judge.start, judge.close = _start, _close


def render(template: str, **fields: Any) -> str:
    """`template` with `{name}` filled from `fields`; a name the row lacks is an error naming it."""
    names = {n for _, n, _, _ in string.Formatter().parse(template) if n}
    missing = sorted(names - set(fields))
    if missing:
        raise KeyError(f"rewards.judge.prompt uses {{{missing[0]}}}, which the row does not have (it has "
                       f"{sorted(fields)})")
    return template.format(**fields)


def parse(reply: str, how: str, max_score: float, url: str = "") -> float:
    """The score in a judge's `reply`: `number`, `yes_no` or `json:FIELD` (module docstring)."""
    text = reply.strip()
    if how == "yes_no":
        word = re.match(r"\W*(\w+)", text.lower())
        if word and word.group(1) in ("yes", "no"):
            return float(word.group(1) == "yes")
    elif how == "number":
        m = NUMBER.search(text)
        if m:
            return float(m.group()) / max_score
    elif how.startswith("json:"):
        m = re.search(r"\{.*\}", text, re.S)
        try:
            return float(json.loads(m.group())[how[5:]]) / max_score
        except (AttributeError, ValueError, KeyError, TypeError):
            pass
    raise ValueError(f"judge {url}: unparsable reply {text[:120]!r} (rewards.judge.parse = {how!r})")


def check(config: Any, problems) -> None:
    """rewards.judge, when rewards.fn is this judge."""
    r = config.rewards
    if r.fn != "arealjax.rewards.judge:judge":
        return
    j, need = r.judge, problems.need
    need(bool(j.base_url), "rewards.judge.base_url", "the judge's OpenAI-compatible endpoint, e.g. "
         "http://127.0.0.1:8000/v1")
    need(j.parse in ("number", "yes_no") or (j.parse.startswith("json:") and len(j.parse) > 5),
         "rewards.judge.parse", "'number', 'yes_no' or 'json:FIELD'")
    need(0 < j.timeout < r.timeout, "rewards.judge.timeout", f"seconds in (0, rewards.timeout = {r.timeout})")
    need(j.max_score > 0, "rewards.judge.max_score", "> 0")
    need(not j.api_key_env or bool(os.environ.get(j.api_key_env)), "rewards.judge.api_key_env",
         f"the name of a set environment variable ({j.api_key_env} is unset or empty)")
    try:
        render(j.prompt or DEFAULT_PROMPT, prompt="", completion="", **{n: "" for n in _row_fields(j.prompt)})
    except (ValueError, IndexError) as e:
        need(False, "rewards.judge.prompt", f"a template over {{prompt}}, {{completion}} and the row's fields ({e})")


def _row_fields(template: str) -> set[str]:
    try:
        return {n for _, n, _, _ in string.Formatter().parse(template or "") if n} - {"prompt", "completion"}
    except ValueError:
        return set()
