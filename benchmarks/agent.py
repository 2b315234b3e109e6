"""What the OpenAI API costs over the generator: per call, per agent episode, and served to concurrent clients.

  python benchmarks/agent.py            # benchmarks/results/agent.{json,md} (a few minutes on 2 CPU cores)
  python benchmarks/agent.py --smoke    # fewer calls, seconds: the script works (results in --work/smoke)

On the tiny Qwen3 (`python -m arealjax.tiny`: 2 layers, width 64, byte-level BPE, ChatML), one in-process generator:
  calls     one chat call at a time, every path answering the same prompt with the same seed (the same tokens):
            `ep.generate` (tokens in, a Completion out), the SDK through the in-process transport an agent gets
            (workflows/agent.py `client_for`), the SDK through the agent endpoint over loopback HTTP (what a
            command agent talks to), and the SDK against `arealjax.serve`; p50 / p99 milliseconds per call and the
            overhead of each path's median over `ep.generate`'s, interleaved --repeats times
  episodes  agent episodes per second (an agent of two calls: a question, then a follow-up carrying the reply) with
            `concurrency` episodes in flight, through OpenAIAgent in process
  serve     `arealjax.serve` under N concurrent clients (the SDK, loopback HTTP, each request --tokens tokens):
            requests and completion tokens per second, beside the generator fed directly at the same concurrency
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cells import commit, cpu_model, write_results  # noqa: E402

QUESTION = [{"role": "user", "content": "What is 12 + 30? Answer with a number."}]


def setup(work: Path, slots: int):
    """(generator, tokenizer) over the tiny Qwen3, made in `work` once."""
    from arealjax.generation.engine import Engine
    from arealjax.generation.generator import Generator
    from arealjax.models import load_pretrained
    from arealjax.tokenizer import load_tokenizer

    if not (work / "qwen3" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "arealjax.tiny", f"--out={work}"], cwd=ROOT, check=True,
                       capture_output=True)
    model = load_pretrained(work / "qwen3")
    return Generator(Engine(model, slots=slots, max_len=512), model.params), load_tokenizer(work / "qwen3")


def episode(gen, tok, tokens: int, seed: int = 0):
    from arealjax.api import SamplingParams
    from arealjax.workflows.base import Episode, Prompt

    sampling = SamplingParams(max_new_tokens=tokens, stop_token_ids=(), seed=seed)  # every call exactly `tokens`
    return Episode(Prompt(f"p{seed}", [], {}), 0, f"bench/{seed}", gen, None, tok, sampling, gen.max_len)


async def calls(gen, tok, tokens: int, repeats: int) -> dict:
    """Per-call latency of each path (module docstring), interleaved."""
    import openai

    from arealjax.serve import ModelServer
    from arealjax.workflows.agent import client_for
    from arealjax.workflows.chat import ChatSession
    from arealjax.workflows.endpoint import AgentEndpoint

    endpoint = AgentEndpoint()
    server = ModelServer(gen, tok, "tiny", port=0, sampling=episode(gen, tok, tokens).sampling)
    await server.start()
    served = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    prompt = tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True))
    ask = {"model": "tiny", "messages": QUESTION, "max_tokens": tokens}

    async def direct():
        await episode(gen, tok, tokens).generate(prompt)

    # one client per path for every call, as an agent holds one for its episode (its calls: new conversations)
    local = client_for(ChatSession(episode(gen, tok, tokens), max_calls=1 << 30))
    session = ChatSession(episode(gen, tok, tokens), max_calls=1 << 30)
    episodes = contextlib.AsyncExitStack()
    grant = await episodes.enter_async_context(endpoint.episode(session))
    remote = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=grant.key, max_retries=0)

    async def in_process():
        await local.chat.completions.create(**ask)

    async def agent_http():
        await remote.chat.completions.create(**ask)

    async def serve():
        await served.chat.completions.create(**ask, seed=0)

    paths = {"ep.generate": direct, "in-process client": in_process, "agent endpoint (HTTP)": agent_http,
             "arealjax.serve (HTTP)": serve}
    ms: dict[str, list[float]] = {name: [] for name in paths}
    for call in paths.values():  # warm-up: compilations, connections
        await call()
    for _ in range(repeats):
        for name, call in paths.items():
            t0 = time.perf_counter()
            await call()
            ms[name].append((time.perf_counter() - t0) * 1e3)
    for client in (local, remote, served):
        await client.close()
    await episodes.aclose()
    await server.close()
    await endpoint.close()
    base = statistics.median(ms["ep.generate"])
    return {name: {"p50_ms": statistics.median(v), "p99_ms": float(np.percentile(v, 99)),
                   "overhead_ms": statistics.median(v) - base, "ms_all": v} for name, v in ms.items()}


async def two_calls(client, data):
    """The benchmark's agent: a question, then a follow-up that carries the reply."""
    messages = [{"role": "user", "content": data["prompt"]}]
    r = await client.chat.completions.create(model="m", messages=messages, max_tokens=data["tokens"])
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "Are you sure?"}]
    await client.chat.completions.create(model="m", messages=messages, max_tokens=data["tokens"])
    return 1.0


async def episodes(gen, tok, tokens: int, concurrency: int, total: int) -> dict:
    """Agent episodes per second with `concurrency` in flight (OpenAIAgent, in process)."""
    from arealjax.workflows.agent import OpenAIAgent
    from arealjax.workflows.base import Prompt

    agent = OpenAIAgent(agent=f"{__name__}:two_calls")
    prompt = tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True))
    sem = asyncio.Semaphore(concurrency)

    async def one(i):
        async with sem:
            ep = dataclasses.replace(episode(gen, tok, tokens, seed=i),
                                     prompt=Prompt(f"p{i}", prompt, {"tokens": tokens}, text=QUESTION[0]["content"]))
            trajs = await agent.run(ep)
            assert trajs, f"episode {i} was rejected: {dict(agent.rejected)}"

    await asyncio.gather(*[one(i) for i in range(total)])  # warm-up: every batch size it meets compiled
    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(total)])
    seconds = time.perf_counter() - t0
    return {"concurrency": concurrency, "episodes": total, "episodes_per_s": total / seconds,
            "calls_per_s": 2 * total / seconds}


async def serve_clients(gen, tok, tokens: int, clients: int, per_client: int) -> dict:
    """`arealjax.serve` under `clients` concurrent SDK clients, beside the generator fed directly as many at once."""
    import openai

    from arealjax.serve import ModelServer

    server = ModelServer(gen, tok, "tiny", port=0, sampling=episode(gen, tok, tokens).sampling)
    await server.start()
    prompt = tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True))
    out = {"clients": clients, "requests": clients * per_client}

    async def client_loop(i, client):
        n = 0
        for j in range(per_client):
            r = await client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=tokens,
                                                     seed=i * 1000 + j, temperature=1.0)
            n += r.usage.completion_tokens
        return n

    async def direct_loop(i):
        n = 0
        for j in range(per_client):
            c = await episode(gen, tok, tokens, seed=i * 1000 + j).generate(prompt)
            n += len(c.output_tokens)
        return n

    sdk = [openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0) for _ in range(clients)]
    await asyncio.gather(*[client_loop(i, c) for i, c in enumerate(sdk)])  # warm-up
    for name, run in (("serve", lambda: [client_loop(i, c) for i, c in enumerate(sdk)]),
                      ("direct", lambda: [direct_loop(i) for i in range(clients)])):
        t0 = time.perf_counter()
        n = sum(await asyncio.gather(*run()))
        seconds = time.perf_counter() - t0
        out[f"{name}_requests_per_s"] = clients * per_client / seconds
        out[f"{name}_tokens_per_s"] = n / seconds
    out["serve_share_of_direct"] = out["serve_tokens_per_s"] / out["direct_tokens_per_s"]
    for c in sdk:
        await c.close()
    await server.close()
    return out


def markdown(r: dict) -> str:
    lines = ["# The OpenAI API over the generator: per call, per episode, served\n",
             f"`{r['command']}` at `{r['commit']}`, {r['date']}, {r['cpu']} ({r['cores']} cores); the tiny Qwen3 "
             f"(2 layers, width 64), {r['slots']} slots.\n",
             f"## One call at a time ({r['tokens']} tokens each, {r['repeats']} calls per path, interleaved)\n",
             "| path | p50 ms | p99 ms | overhead over ep.generate (median) |", "|---|---|---|---|"]
    for name, v in r["calls"].items():
        lines.append(f"| {name} | {v['p50_ms']:.1f} | {v['p99_ms']:.1f} | {v['overhead_ms']:+.1f} ms |")
    lines += ["", f"## Agent episodes (two calls each, {r['tokens']} tokens a call, in process)\n",
              "| episodes in flight | episodes / s | calls / s |", "|---|---|---|"]
    for v in r["episodes"]:
        lines.append(f"| {v['concurrency']} | {v['episodes_per_s']:.1f} | {v['calls_per_s']:.1f} |")
    lines += ["", f"## arealjax.serve under concurrent clients ({r['tokens']} tokens a request)\n",
              "| clients | requests | serve req / s | serve tokens / s | generator fed directly, tokens / s | "
              "serve / direct |",
              "|---|---|---|---|---|---|"]
    for v in r["serve"]:
        lines.append(f"| {v['clients']} | {v['requests']} | {v['serve_requests_per_s']:.1f} | "
                     f"{v['serve_tokens_per_s']:.0f} | {v['direct_tokens_per_s']:.0f} | "
                     f"**{v['serve_share_of_direct']:.2f}** |")
    lines += ["", "The clients run in the server's process: their SDK work (building requests, parsing replies) shares "
              "its cores with the server's, so on 2 cores serve / direct is a lower bound for the server."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="few calls, seconds; results in --work/smoke")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "arealjax_agent_bench"))
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--tokens", type=int, default=16, help="tokens per call")
    p.add_argument("--repeats", type=int, default=100, help="calls per path, interleaved")
    p.add_argument("--slots", type=int, default=32)
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    repeats, concurrency, clients, total, per_client = ((4, (1, 4), (1, 4), 8, 2) if args.smoke else
                                                        (args.repeats, (1, 8, 32), (1, 4, 16, 32), 128, 8))
    gen, tok = setup(work, args.slots)
    with gen:
        result = {"command": "python benchmarks/agent.py" + (" --smoke" if args.smoke else ""), "commit": commit(),
                  "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)),
                  "tokens": args.tokens, "repeats": repeats, "slots": args.slots,
                  "calls": asyncio.run(calls(gen, tok, args.tokens, repeats)),
                  "episodes": [asyncio.run(episodes(gen, tok, args.tokens, c, max(total, c))) for c in concurrency],
                  "serve": [asyncio.run(serve_clients(gen, tok, args.tokens, c, per_client)) for c in clients]}
    out = work / "smoke" if args.smoke else Path(args.results)
    write_results(out, "agent", result, markdown(result))


if __name__ == "__main__":
    main()
