"""`python -m arealjax.serve`: a frozen model over the OpenAI API, driven by the real `openai` SDK over loopback."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from arealjax.generation.engine import Engine
from arealjax.generation.generator import Generator
from arealjax.models import load_pretrained
from arealjax.serve import ModelServer
from arealjax.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
USER = [{"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]


@pytest.fixture(scope="module")
def backend(tiny_recipes):
    path = tiny_recipes / "qwen3"
    model = load_pretrained(path)
    with Generator(Engine(model, slots=8, max_len=512), model.params) as gen:
        yield gen, load_tokenizer(path)


def serving(backend, test, **kwargs):
    """Runs `test(server, client)` against a ModelServer on a free loopback port; the server is stopped after."""
    gen, tok = backend

    async def main():
        server = ModelServer(gen, tok, "tiny-qwen3", port=0, **kwargs)
        await server.start()
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=kwargs.get("key") or "none", max_retries=0)
        try:
            return await test(server, client)
        finally:
            await client.close()
            await server.close()

    return asyncio.run(main())


def test_the_sdk_chats_streams_calls_tools_and_uses_responses(backend):
    """Chat with n, logprobs and a seed (the same seed, the same tokens), streaming, tools and the Responses API,
    through the SDK as any client sends them; /v1/models names the model."""

    async def test(server, client):
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny-qwen3"]
        r = await client.chat.completions.create(model="tiny-qwen3", messages=USER, max_tokens=12, n=3, seed=7,
                                                 logprobs=True, temperature=0.8)
        assert len(r.choices) == 3 and r.usage.completion_tokens > 0
        assert all(len(c.logprobs.content) > 0 and all(t.logprob <= 0 for t in c.logprobs.content) for c in r.choices)
        again = await client.chat.completions.create(model="tiny-qwen3", messages=USER, max_tokens=12, n=3, seed=7,
                                                     logprobs=True, temperature=0.8)
        assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
        other = await client.chat.completions.create(model="tiny-qwen3", messages=USER, max_tokens=12, n=3, seed=8,
                                                     temperature=0.8)
        assert [c.message.content for c in other.choices] != [c.message.content for c in r.choices]
        stream = await client.chat.completions.create(model="tiny-qwen3", messages=USER, max_tokens=12, seed=7,
                                                      temperature=0.8, stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        assert text == r.choices[0].message.content
        tools = await client.chat.completions.create(model="tiny-qwen3", messages=USER, tools=TOOLS, max_tokens=8)
        assert tools.choices[0].finish_reason in ("stop", "length", "tool_calls")
        resp = await client.responses.create(model="tiny-qwen3", input="What is 2 + 3?", max_output_tokens=8)
        assert resp.output_text is not None and resp.usage.output_tokens > 0

    serving(backend, test)


def test_refusals_keys_and_bounds(backend):
    """A refused field names itself (400, as the agent endpoint refuses it); a missing or wrong key gets 401; an
    oversized body 413; requests past --max-pending 429, which the SDK is allowed to retry; a non-loopback host
    without a key is refused before it listens."""

    async def test(server, client):
        with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
            await client.chat.completions.create(model="m", messages=USER, frequency_penalty=0.5)
        with pytest.raises(openai.BadRequestError, match="seed"):
            await client.chat.completions.create(model="m", messages=USER, seed="seven")
        wrong = openai.AsyncOpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="m", messages=USER, max_tokens=2)
        await wrong.close()
        async with httpx.AsyncClient() as http:
            url, auth = f"{server.base_url}/chat/completions", {"Authorization": "Bearer s3cret"}
            big = await http.post(url, content=b"x" * (5 << 20), headers=auth)
            assert big.status_code == 413
            one = http.post(url, json={"model": "m", "messages": USER, "max_tokens": 64}, headers=auth)
            two = http.post(url, json={"model": "m", "messages": USER, "max_tokens": 2}, headers=auth)
            answers = await asyncio.gather(one, two)
            codes = sorted(a.status_code for a in answers)
            assert codes == [200, 429], codes
            busy = next(a for a in answers if a.status_code == 429)
            assert "x-should-retry" not in busy.headers and busy.json()["error"]["type"] == "rate_limit_error"

    serving(backend, test, key="s3cret", max_pending=1)
    with pytest.raises(ValueError, match="key"):
        ModelServer(*backend, "m", host="0.0.0.0")


def test_concurrent_clients_share_decode_steps(backend):
    """Many clients at once are batched: the generator takes fewer decode steps than the tokens it returns."""
    gen, _ = backend

    async def test(server, client):
        before = gen.metrics()["decode_steps_total"]
        answers = await asyncio.gather(*[client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=16, temperature=1.0,
            seed=i) for i in range(12)])
        tokens = sum(a.usage.completion_tokens for a in answers)
        steps = gen.metrics()["decode_steps_total"] - before
        assert tokens > 12 and steps < tokens / 3, (steps, tokens)

    serving(backend, test)


OK_SCHEMA = {"type": "json_schema", "json_schema": {"name": "ok", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}


def serve_command(args: list[str], env: dict, name: str) -> str:
    """Starts `python -m arealjax.serve *args`, has the SDK chat with it (a reply in a JSON schema too), sends
    SIGTERM: it must exit 0 within seconds. Returns the reply."""
    proc = subprocess.Popen([sys.executable, "-m", "arealjax.serve", "--port=0", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, url = time.monotonic() + 180, None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the server exited before serving"
            if line.startswith("serving "):
                url = line.split(" at ")[1].split()[0]
        assert url, "the server did not say where it serves"
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == [name]
        r = client.chat.completions.create(model=name, messages=USER, max_tokens=4)
        assert r.model == name and r.choices[0].message.role == "assistant"
        typed = client.chat.completions.create(model=name, messages=USER, max_tokens=24, response_format=OK_SCHEMA)
        assert typed.choices[0].finish_reason == "stop" and isinstance(
            json.loads(typed.choices[0].message.content)["ok"], bool)  # structured outputs, decoded in the grammar
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
        return r.choices[0].message.content
    finally:
        proc.kill()


def test_the_command_serves_and_stops_on_sigterm(tiny_recipes):
    """`python -m arealjax.serve --model=DIR`: the SDK talks to it; SIGTERM ends it with exit code 0 within
    seconds. A public host without a key is refused at once, naming why (a PEFT directory too: test_main.py)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    serve_command([f"--model={tiny_recipes / 'qwen3'}", "--max-len=256", "--slots=4"], env, "qwen3")
    out = subprocess.run([sys.executable, "-m", "arealjax.serve", f"--model={tiny_recipes / 'qwen3'}",
                          "--host=0.0.0.0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "give the server a key" in out.stderr, out.stderr
