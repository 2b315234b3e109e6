"""A judge model as the reward: any OpenAI-compatible endpoint scores each completion.

    rewards.fn = "arealjax.rewards.judge:judge"
    rewards.judge.base_url = "http://127.0.0.1:8000/v1"   # e.g. python -m arealjax.serve --model=DIR
    rewards.judge.serve = "DIR"                            # or: the run serves DIR itself (`served`)

Each completion is put in `rewards.judge.prompt` (a template over `{prompt}`, `{completion}` and the row's fields,
e.g. `{answer}`), sent as one user message at temperature 0, and the reply read by `rewards.judge.parse`: `number`
(the first number in it, divided by `max_score`), `yes_no` (1 for yes, 0 for no) or `json:FIELD` (that field of the
JSON object in it, divided by `max_score`). Calls run concurrently on the reward service's event loop
(`rewards.concurrency` at once). A reply that times out (`judge.timeout`), is refused (an HTTP error) or does not
parse is a failed reward for that sample, counted and logged with the URL and the reason under the service's
failure rate. An endpoint that cannot be reached is found by a probe (`GET /models`) at start-up and after a
connection failure while running, and ends the run with one message naming its URL.

With `rewards.judge.serve = DIR` the run starts `python -m arealjax.serve --model=DIR` itself, on loopback, before
its reward service, and stops it (SIGTERM) after: `serve_args` are that command's flags, `serve_env` its environment
(default `JAX_PLATFORMS=cpu`: the accelerators are the trainer's and the generator's; on a host with spare ones,
e.g. `CUDA_VISIBLE_DEVICES=7`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import queue
import re
import shlex
import signal
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from arealjax.api import RewardFatal
from arealjax.runtime import child_env

FN = "arealjax.rewards.judge:judge"

DEFAULT_PROMPT = (
    "You are grading a response to a question.\n\nQuestion:\n{prompt}\n\nResponse:\n{completion}\n\n"
    "How correct and helpful is the response, from 0 (wrong or useless) to 10 (correct and complete)? "
    "Reply with the number only.")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
PROBES, PROBE_WAIT = 3, 5.0  # GET /models tries before the endpoint is called unreachable, seconds between them
SERVE_START_SECONDS = 600.0  # for a served judge to load its model and listen
SERVE_STOP_SECONDS = 60.0  # for it to finish its requests after SIGTERM, before SIGKILL


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """The `rewards.judge` section: an OpenAI-compatible endpoint (`base_url`, its `model`: "" = the first of its
    GET /models; `api_key_env` names the variable holding its key), or a model directory the run serves itself
    (`serve`, with `serve_args` flags, in `serve_env`); how a completion is put to it (`prompt`, "" =
    DEFAULT_PROMPT) and its reply read (`parse`, over `max_score`), the reply's `max_tokens` and `timeout`."""

    base_url: str = ""
    model: str = ""
    prompt: str = ""
    parse: str = "number"
    max_score: float = 10.0
    max_tokens: int = 16
    timeout: float = 8.0
    api_key_env: str = ""
    serve: str = ""
    serve_args: str = ""
    serve_env: str = "JAX_PLATFORMS=cpu"


def serve_env(section: JudgeConfig) -> dict[str, str]:
    """rewards.judge.serve_env's NAME=VALUE pairs."""
    return dict(kv.split("=", 1) for kv in shlex.split(section.serve_env))


@contextlib.contextmanager
def served(section: JudgeConfig, start_seconds: float = SERVE_START_SECONDS) -> Iterator[str]:
    """`python -m arealjax.serve --model=section.serve` on loopback (a free port), in `section.serve_env`; yields
    its base URL once it serves, and stops it on exit. A server that exits or does not serve within `start_seconds`
    is an error with the tail of its output."""
    cmd = [sys.executable, "-m", "arealjax.serve", f"--model={section.serve}", "--host=127.0.0.1", "--port=0",
           *shlex.split(section.serve_args)]
    env = {**child_env(), **serve_env(section)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a Ctrl-C to the run reaches it through the run, not twice
    lines: queue.Queue[str | None] = queue.Queue()
    serving = threading.Event()

    def read() -> None:  # all of its output, so a full pipe never blocks it; the start-up lines kept for errors
        for line in proc.stdout:
            if not serving.is_set():
                lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="judge-server-output", daemon=True).start()
    try:
        url, seen, deadline = None, [], time.monotonic() + start_seconds
        while url is None:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RuntimeError(f"rewards.judge.serve: `{shlex.join(cmd)}` did not serve within {start_seconds:.0f}"
                                   f" s; its output:\n{''.join(seen[-20:])}") from None
            if line is None:
                raise RuntimeError(f"rewards.judge.serve: `{shlex.join(cmd)}` exited with code {proc.wait()} before "
                                   f"serving; its output:\n{''.join(seen[-20:])}")
            seen.append(line)
            if line.startswith("serving ") and " at " in line:
                url = line.split(" at ", 1)[1].split()[0]
        serving.set()
        logging.info("judge served by the run: %s at %s", section.serve, url)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(SERVE_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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
    if r.fn != FN:
        return
    j, need = r.judge, problems.need
    need(bool(j.base_url) != bool(j.serve), "rewards.judge.base_url",
         "the judge's OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1, or rewards.judge.serve = a model "
         "directory the run serves itself (one of the two)")
    need(not j.serve or os.path.isdir(j.serve), "rewards.judge.serve", f"a model directory ({j.serve} is not one)")
    try:
        serve_env(j)
        shlex.split(j.serve_args)
    except ValueError as e:
        need(False, "rewards.judge.serve_env", f"NAME=VALUE pairs, and serve_args flags ({e})")
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
