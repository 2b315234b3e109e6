"""Judge rewards (arealjax/rewards/judge.py) through the reward service, against a judge served on loopback: an
aiohttp app speaking the OpenAI API whose replies each test scripts."""

import asyncio
import threading
import time

import pytest

from arealjax.rewards import judge as judge_module
from arealjax.rewards.judge import parse, render
from arealjax.rewards.service import RewardService

FN = "arealjax.rewards.judge:judge"


class FakeJudge:
    """An OpenAI-compatible judge on a thread of its own: `reply(text) -> str | int` (an int: that HTTP status)
    scripts each answer; `delay` seconds per answer; it counts the requests in flight at once."""

    def __init__(self, reply=lambda text: "7", delay: float = 0.0):
        self.reply, self.delay = reply, delay
        self.seen: list[str] = []
        self.in_flight = self.most = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = None
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    async def _start(self) -> int:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "the-judge"}]}))
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return self.runner.addresses[0][1]

    async def _chat(self, request):
        from aiohttp import web

        body = await request.json()
        text = body["messages"][0]["content"]
        self.seen.append(text)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            out = self.reply(text)
        finally:
            self.in_flight -= 1
        if isinstance(out, int):
            return web.Response(status=out, text="no")
        assert body["model"] == "the-judge" and body["temperature"] == 0.0
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": out}}]})

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def service(url: str, **kwargs) -> RewardService:
    cfg = {"base_url": url, "model": "", "prompt": kwargs.pop("prompt", ""), "parse": kwargs.pop("parse", "number"),
           "max_score": 10.0, "max_tokens": 16, "timeout": kwargs.pop("judge_timeout", 4.0), "api_key_env": ""}
    return RewardService(FN, timeout=5.0, context={"judge": cfg}, **kwargs)


@pytest.fixture(autouse=True)
def quick_probes(monkeypatch):
    monkeypatch.setattr(judge_module, "PROBE_WAIT", 0.2)


def test_a_judge_scores_with_the_prompt_the_completion_and_the_row_concurrently():
    """The template gets the prompt, the completion and the row's fields; the model is the endpoint's first; the
    reply's number over max_score is the reward; calls run `concurrency` at once, not one at a time."""
    fake = FakeJudge(reply=lambda text: "8" if "A: it is 42" in text else "2", delay=0.2)
    try:
        with service(fake.url, prompt="Q: {prompt}\nA: {completion}\nExpected: {answer}\nScore?",
                     concurrency=4) as s:
            futures = [s.submit("it is 42" if i % 2 else "no idea", "what is 6 × 7?", answer="42") for i in range(8)]
            t0 = time.perf_counter()
            rewards = [f.result(30) for f in futures]
            seconds = time.perf_counter() - t0
        assert rewards == [0.2, 0.8] * 4
        assert fake.seen[0].startswith("Q: what is 6 × 7?\nA: ") and fake.seen[0].endswith("Expected: 42\nScore?")
        assert fake.most == 4 and seconds < 8 * 0.2  # bounded at 4, and not one at a time
    finally:
        fake.stop()


def test_unparsable_refused_and_slow_replies_are_failed_rewards_counted_and_named():
    """A reply without a score, an HTTP error and a reply past judge.timeout each fail that sample (the
    service's failure_reward, counted, the URL and the reason in last_error); the run goes on."""
    replies = iter(["I cannot say", 500, "9"])
    fake = FakeJudge(reply=lambda text: next(replies))
    try:
        with service(fake.url, retries=0, failure_reward=-1.0) as s:
            assert [s.submit("x").result(30) for _ in range(3)] == [-1.0, -1.0, 0.9]
            assert s.stats.errors == 2 and s.stats.failed == 2 and fake.url in s.last_error
            assert "HTTP 500" in s.last_error
        slow = FakeJudge(delay=2.0)
        with service(slow.url, retries=0, judge_timeout=0.5) as s:
            assert s.submit("x").result(30) == 0.0
            assert s.stats.timeouts == 1 and "no reply within 0.5s" in s.last_error
        slow.stop()
    finally:
        fake.stop()


def test_an_unreachable_judge_stops_the_run_naming_its_url():
    """Unreachable at start: the service does not start, naming the URL. Killed while running: the next calls
    fail, a probe confirms it is gone, and the service stops within seconds with one error naming the URL."""
    fake = FakeJudge()
    url = fake.url
    fake.stop()
    with pytest.raises(RuntimeError, match=f"judge at {url} cannot be reached"):
        service(url)
    fake = FakeJudge()
    with service(fake.url) as s:
        assert s.submit("x").result(30) == 0.7
        fake.stop()
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=f"judge at {fake.url} cannot be reached"):
            s.submit("x").result(60)
        assert time.perf_counter() - t0 < 30
        with pytest.raises(RuntimeError, match="cannot be reached"):
            s.submit("x")


@pytest.mark.parametrize("reply,how,want", [
    ("7", "number", 0.7), ("Score: 10/10", "number", 1.0), ("Yes.", "yes_no", 1.0), ("no, wrong", "yes_no", 0.0),
    ('{"score": 5, "why": "half"}', "json:score", 0.5), ('Here: {"score": 3}', "json:score", 0.3)])
def test_parse_reads_a_score(reply, how, want):
    assert parse(reply, how, 10.0) == pytest.approx(want)


@pytest.mark.parametrize("reply,how", [("none", "number"), ("maybe", "yes_no"), ('{"s": 1}', "json:score"),
                                       ("{not json}", "json:score")])
def test_parse_refuses_what_has_no_score(reply, how):
    with pytest.raises(ValueError, match="unparsable reply"):
        parse(reply, how, 10.0)


def test_a_template_field_the_row_lacks_is_named():
    with pytest.raises(KeyError, match="uses {answer}"):
        render("{completion} vs {answer}", prompt="p", completion="c")


def test_the_config_is_checked_at_start():
    """rewards.judge: the URL is required, the timeout below rewards.timeout, parse one of its forms, a template
    that formats."""
    from arealjax.config import ConfigError, parse
    from configs.default import get_config

    c = get_config()
    c.rewards.fn = FN
    c.rewards.judge.update(timeout=20.0, parse="score", prompt="{completion")
    with pytest.raises(ConfigError) as e:
        parse(c)
    for key in ("rewards.judge.base_url", "rewards.judge.timeout", "rewards.judge.parse", "rewards.judge.prompt"):
        assert key in str(e.value), (key, str(e.value))
    c.rewards.judge.update(timeout=4.0, parse="number", prompt="", base_url="http://127.0.0.1:1/v1",
                           serve="/no/such/model", serve_env="JAX_PLATFORMS")  # both places, no dir, no NAME=VALUE
    with pytest.raises(ConfigError) as e:
        parse(c)
    for key in ("rewards.judge.base_url", "rewards.judge.serve ", "rewards.judge.serve_env"):
        assert key in str(e.value), (key, str(e.value))


def test_a_judge_the_run_serves_that_cannot_serve_is_an_error_with_its_output(tmp_path):
    """rewards.judge.serve: a server that exits before serving (no model in the directory) ends the start with its
    command and the tail of its output, within seconds."""
    from arealjax.rewards.judge import served
    from configs.default import get_config

    section = get_config().rewards.judge
    section.serve = str(tmp_path)
    with pytest.raises(RuntimeError, match=r"(?s)rewards\.judge\.serve: `.*arealjax\.serve --model=.*` exited with "
                                           r"code [1-9]\d* before serving; its output:\n.+"):
        with served(section, start_seconds=120):
            pass


@pytest.mark.slow
def test_the_tiny_math_recipe_trains_on_a_judge_that_arealjax_serves(tiny_recipes, tmp_path):
    """main.py trains the tiny math recipe rewarded by a judge the run serves itself (rewards.judge.serve: the tiny
    Qwen3 through `python -m arealjax.serve`, random: it often answers without a number, a failed reward the run
    survives at max_failure_rate = 1), and stops it at the end. A run pointed at that judge's URL, gone with its
    run, ends at start-up with one error naming it."""
    import json
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    arg = f"model=tiny,ckpt={tiny_recipes},tfds={tiny_recipes / 'tfds'}"
    run = [sys.executable, "main.py", f"--config=configs/math.py:{arg}", "--config.curves=False",
           f"--config.rewards.fn={FN}", "--config.rewards.max_failure_rate=1.0", "--config.eval.num_problems=4"]
    done = subprocess.run([*run, f"--config.rewards.judge.serve={tiny_recipes / 'qwen3'}",
                           "--config.rewards.judge.serve_args=--max-len=512 --slots=16", f"--workdir={tmp_path / 'a'}"],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["status"] == "completed"
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward_failures" in r for r in rows)
    (url,) = re.findall(r"judge served by the run: \S+ at (\S+)", done.stderr)
    gone = subprocess.run([*run, f"--config.rewards.judge.base_url={url}", f"--workdir={tmp_path / 'b'}"], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert gone.returncode == 1 and f"judge at {url} cannot be reached" in gone.stderr, gone.stderr[-2000:]
