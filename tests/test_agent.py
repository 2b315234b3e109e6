"""Agents written against the OpenAI API (workflows/agent.py, workflows/chat.py): the real `openai.AsyncOpenAI`
routed in process to an episode's generator; trajectories hold exactly the tokens fed and produced across turns;
an edited history starts a trajectory of its own; what is not supported is refused naming the field; an agent that
fails is a rejected episode, counted."""

import asyncio
import json

import numpy as np
import openai
import pytest

from arealjax.api import Completion, SamplingParams
from arealjax.generation.engine import Engine
from arealjax.generation.generator import Generator
from arealjax.models import load_pretrained
from arealjax.rewards.service import RewardService
from arealjax.tokenizer import load_tokenizer
from arealjax.workflows import Episode, Prompt
from arealjax.workflows.agent import OpenAIAgent, client_for
from arealjax.workflows.chat import ChatSession

TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds two numbers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}}}}}]


class Recording(Episode):
    """Keeps what every generate call was fed and what it produced."""

    @property
    def fed(self) -> list:
        return self.__dict__.setdefault("_fed", [])

    async def generate(self, tokens, **overrides):
        c = await super().generate(tokens, **overrides)
        self.fed.append((list(tokens), c))
        return c


@pytest.fixture(scope="module")
def served(tiny_recipes):
    path = tiny_recipes / "qwen3"
    model, tok = load_pretrained(path), load_tokenizer(path)
    with Generator(Engine(model, slots=4, max_len=1024), model.params) as gen, \
            RewardService("reward_fns:length", workers=1) as rewards:
        yield gen, rewards, tok


def episode(served, text="What is 2 + 3?", index=0, stops=(), **reward_kwargs):
    gen, rewards, tok = served
    prompt = Prompt("p", tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])), reward_kwargs,
                    text=text)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=tuple(tok.eos_ids) + tuple(stops),
                              seed=7)
    return Recording(prompt, index, f"p#0/{index}", gen, rewards, tok, sampling, 1024)


def test_a_multi_turn_conversation_is_one_token_faithful_trajectory(served):
    """Three calls through the SDK, each sending back the history with the assistant's replies as returned: one
    trajectory whose tokens are exactly what each call was fed (the previous call's tokens, then only the new
    turn's) and produced; the model's tokens carry their logprobs and versions, the rest is masked."""
    ep = episode(served)
    session = ChatSession(ep)

    async def agent():
        async with client_for(session) as client:
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
            for turn in range(3):
                r = await client.chat.completions.create(model="any", messages=messages, tools=TOOLS,
                                                         max_tokens=12, logprobs=True)
                assert r.usage.completion_tokens == len(ep.fed[-1][1].output_tokens)
                assert [x.logprob for x in r.choices[0].logprobs.content] == pytest.approx(
                    list(ep.fed[-1][1].logprobs))
                messages += [r.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": f"Again, try {turn}."}]
            assert (await client.models.retrieve("Qwen/Qwen3-0.6B")).id == "Qwen/Qwen3-0.6B"
            return (await client.models.list()).data[0].id

    assert asyncio.run(agent()) == "arealjax"
    (traj,) = session.trajectories(1.0)
    assert session.counts.calls == 3 and session.counts.prefix_breaks == 0
    tokens = list(traj.tokens)
    for fed, c in ep.fed:  # each call was fed the trajectory so far, and its output follows in the trajectory
        n = len(fed)
        assert tokens[:n] == fed and tokens[n:n + len(c.output_tokens)] == list(c.output_tokens)
        assert traj.loss_mask[n:n + len(c.output_tokens)].all() and not traj.loss_mask[n - 1]
        np.testing.assert_array_equal(traj.logprobs[n:n + len(c.output_tokens)], c.logprobs)
    assert traj.loss_mask.sum() == sum(len(c.output_tokens) for _, c in ep.fed)
    tok = served[2]
    assert "<tools>" in tok.decode(ep.fed[0][0], skip_special_tokens=False)  # the Hermes block: no template tools


def test_an_edited_history_starts_a_trajectory_of_its_own(served):
    """The agent rewrites the assistant's first reply before the second call: the second call's prompt no longer
    extends the first call's tokens, so it is a trajectory of its own (counted); both get the episode's reward."""
    ep = episode(served)
    session = ChatSession(ep)

    async def agent():
        async with client_for(session) as client:
            messages = [{"role": "user", "content": "Say hi."}]
            await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
            messages += [{"role": "assistant", "content": "an edited reply"}, {"role": "user", "content": "More."}]
            await client.chat.completions.create(model="m", messages=messages, max_tokens=6)

    asyncio.run(agent())
    trajs = session.trajectories(0.5)
    assert session.counts.prefix_breaks == 1 and len(trajs) == 2 and {t.reward for t in trajs} == {0.5}
    assert list(trajs[1].tokens[:len(ep.fed[1][0])]) == ep.fed[1][0]


def test_a_streamed_completion_is_the_same_reply_in_chunks(served):
    """`stream: true` (the openai SDK's and LangChain's astream): server-sent chunks whose content deltas join into
    the reply the session recorded, the usage last when asked; LangChain's ChatOpenAI streams through the same
    client. Tool calls stream as deltas the SDK's chunk type reads back."""
    from langchain_openai import ChatOpenAI
    from openai.types.chat import ChatCompletionChunk

    from arealjax.workflows.chat import stream_events

    ep = episode(served)
    session = ChatSession(ep)

    async def agent():
        async with client_for(session) as client:
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=10, stream=True,
                stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            llm = ChatOpenAI(model="m", api_key="x", async_client=client.chat.completions, root_async_client=client,
                             max_tokens=6)
            pieces = [m.content async for m in llm.astream("hello")]
            return chunks, pieces

    chunks, pieces = asyncio.run(agent())
    (_, first), (_, second) = ep.fed
    tok = served[2]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tok.decode(
        first.output_tokens, skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == len(first.output_tokens) and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert "".join(pieces) == tok.decode(second.output_tokens, skip_special_tokens=True)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    response = {"id": "x", "created": 0, "model": "m", "usage": {}, "choices": [{
        "index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
        "finish_reason": "tool_calls", "logprobs": None}]}
    events = stream_events(response, False).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    parsed = [ChatCompletionChunk.model_validate(json.loads(e.removeprefix("data: "))) for e in events[:-2]]
    (delta,) = [c.choices[0].delta.tool_calls for c in parsed if c.choices[0].delta.tool_calls]
    assert delta[0].model_dump(exclude_none=True) == {"index": 0, **call}


@pytest.mark.parametrize("field,value,match", [
    ("stream_options", {"chunk_size": 3}, r"'stream_options' = .*only \{'include_usage': bool\}"),
    ("frobnicate", 1, "unsupported field 'frobnicate'"),
    ("stop", "a long stop string", "only single-token stop"),
    ("temperature", 5, "'temperature' = 5"),
    ("temperature", True, "'temperature' = True"),
    ("max_tokens", True, "'max_tokens' = True"),
    ("n", True, "'n' = True"),
    ("seed", 3, "'seed': draws are keyed by"),
    ("messages", [{"role": "wizard", "content": "x"}], r"messages\[0\]"),
])
def test_what_is_not_supported_is_refused_naming_the_field(served, field, value, match):
    session = ChatSession(episode(served))

    async def agent():
        async with client_for(session) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
            return await client.chat.completions.create(**body) if field != "frobnicate" else \
                await client.chat.completions.create(model="m", messages=body["messages"], extra_body={field: value})

    with pytest.raises(openai.BadRequestError, match=match) as e:
        asyncio.run(agent())
    assert e.value.status_code == 400 and session.counts.calls == 0 and not session.chains


def test_tool_calls_parse_back_and_a_broken_one_stays_text(served):
    session = ChatSession(episode(served))
    text = ('I will add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": [1]}</tool_call>')
    calls, content = session._parse_calls(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("add", {"a": 2,
                                                                                                          "b": 3})]
    assert content.startswith("I will add.") and '"arguments": [1]' in content
    assert session.counts.unparsed_tool_calls == 1  # (returned calls are counted as a reply carries them)


async def agent_sees_the_row(client, data):
    """Handed the row: the prompt as written (not the chat-templated tokens) and the reward kwargs."""
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": data["prompt"]}],
                                         max_tokens=4)
    return float(data == {"prompt": "What is 2 + 3?", "answer": "5"})


async def agent_answers(client, data):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": data["prompt"]}],
                                         max_tokens=8)
    return None if "score me" in data["prompt"] else 1.0


async def agent_raises(client, data):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    raise RuntimeError("the agent's own bug")


async def agent_hangs(client, data):
    await asyncio.sleep(60)


def test_the_workflow_trains_what_agents_return_and_rejects_what_fails(served):
    """OpenAIAgent: a returned reward and a None (the run's reward function scores the last reply: `length`) give
    trajectories; an agent that raises or hangs past the timeout is a rejected episode with its reason counted."""
    (seen,) = asyncio.run(OpenAIAgent("test_agent:agent_sees_the_row").run(episode(served, answer="5")))
    assert seen.reward == 1.0
    wf = OpenAIAgent("test_agent:agent_answers")
    (traj,) = asyncio.run(wf.run(episode(served)))
    assert traj.reward == 1.0 and traj.loss_mask.any() and wf.metrics()["agent_calls"] == 1
    (scored,) = asyncio.run(wf.run(episode(served, "score me")))
    assert scored.reward == float(len(served[2].decode(scored.tokens[scored.loss_mask], skip_special_tokens=True)))
    for name, reason, kw in (("agent_raises", "error", {}), ("agent_hangs", "timeout", {"timeout": 0.5})):
        wf = OpenAIAgent(f"test_agent:{name}", **kw)
        assert asyncio.run(wf.run(episode(served))) is None
        assert wf.metrics()[f"agent_rejected_{reason}"] == 1



class Queued(Recording):
    """An episode whose every model call waits `wait` seconds first, as behind a busy generator."""

    wait = 0.0

    async def generate(self, tokens, **overrides):
        await asyncio.sleep(self.wait)
        return await super().generate(tokens, **overrides)


async def agent_returns_nan(client, data):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return float("nan")


async def agent_returns_numpy(client, data):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return np.float32(0.5)


async def agent_survives_a_refused_call(client, data):
    try:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 2000}])
    except openai.BadRequestError as e:
        assert e.code == "context_length_exceeded", e.body
    return 1.0


def test_a_reward_must_be_a_finite_number_and_an_episode_without_a_model_turn_is_rejected(served):
    """A NaN reward would make its group's advantages NaN: the episode is rejected (`bad_reward`); a numpy number
    is a number. An agent that catches a refused over-long call (OpenAI's `context_length_exceeded`) and returns a
    reward had no model turn: rejected with its reason, counted."""
    for name, reason in (("agent_returns_nan", "bad_reward"), ("agent_survives_a_refused_call", "no_call")):
        wf = OpenAIAgent(f"test_agent:{name}")
        assert asyncio.run(wf.run(episode(served))) is None
        assert wf.metrics()[f"agent_rejected_{reason}"] == 1, wf.metrics()
    (traj,) = asyncio.run(OpenAIAgent("test_agent:agent_returns_numpy").run(episode(served)))
    assert traj.reward == 0.5


def test_concurrent_calls_and_n_alternatives_are_each_a_faithful_trajectory_of_independent_draws(served):
    """Two identical calls at once and one call with n = 3: five trajectories, each exactly the prompt it was fed
    and the tokens it produced (concurrent calls never append to one another's chain), and five different draws
    (each call and each alternative samples anew). The calls limit counts every alternative."""
    ep = episode(served)
    session = ChatSession(ep, max_calls=6)
    messages = [{"role": "user", "content": "Name a colour."}]

    async def agent():
        async with client_for(session) as client:
            await asyncio.gather(*[client.chat.completions.create(model="m", messages=messages, max_tokens=8)
                                   for _ in range(2)])
            r = await client.chat.completions.create(model="m", messages=messages, max_tokens=8, n=3)
            assert [c.index for c in r.choices] == [0, 1, 2]
            with pytest.raises(openai.BadRequestError, match="limit"):
                await client.chat.completions.create(model="m", messages=messages, max_tokens=8, n=2)

    asyncio.run(agent())
    trajs = session.trajectories(1.0)
    assert len(trajs) == len(ep.fed) == 5 and session.counts.calls == 5
    built = sorted(list(t.tokens) for t in trajs)
    assert built == sorted(fed + list(c.output_tokens) for fed, c in ep.fed)
    for t in trajs:
        (fed, c), = [(f, c) for f, c in ep.fed if list(t.tokens) == f + list(c.output_tokens)]
        assert list(t.loss_mask) == [False] * len(fed) + [True] * len(c.output_tokens)
        np.testing.assert_array_equal(t.logprobs[len(fed):], c.logprobs)
    assert len({tuple(c.output_tokens) for _, c in ep.fed}) == 5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_fidelity_over_random_conversations(served, seed):
    """A property over random agents: calls that extend a returned conversation, edit its history, go back to an
    earlier turn, run two at once, ask n = 2, switch tools, temperature or stop strings. Every model segment of
    every trajectory is exactly one call's output (up to where a stop string cut it), preceded by exactly the tokens
    that call was fed, with its logprobs and versions; every call is in exactly one trajectory."""
    rng = np.random.RandomState(seed)
    tok = served[2]
    ep = episode(served)
    session = ChatSession(ep, max_calls=64)
    stops = [s for s in (",", ".", " the", "\n") if len(tok.encode(s)) == 1]

    async def agent():
        async with client_for(session) as client:
            states = [[{"role": "user", "content": "Start."}]]  # conversations as the agent holds them

            async def call(messages, **kw):
                r = await client.chat.completions.create(model="m", messages=messages, max_tokens=6, **kw)
                for choice in r.choices:
                    states.append(messages + [choice.message.model_dump(exclude_none=True)])

            for turn in range(8):
                base = states[rng.randint(len(states))]
                action = rng.choice(["extend", "extend", "edit", "back", "gather", "n"])
                if action == "edit" and base[-1]["role"] == "assistant":
                    base = base[:-1] + [{"role": "assistant", "content": f"edited {turn}"}]
                elif action == "back" and len(base) > 2:
                    base = base[:-2]
                messages = base + ([{"role": "user", "content": f"Go on {turn}."}]
                                   if base[-1]["role"] == "assistant" else [])
                kw = {}
                if rng.rand() < 0.3:
                    kw["tools"] = TOOLS
                if rng.rand() < 0.3:
                    kw["temperature"] = 0.7
                if stops and rng.rand() < 0.3:
                    kw["stop"] = stops[rng.randint(len(stops))]
                if action == "gather":
                    await asyncio.gather(call(messages, **kw), call(messages, **kw))
                else:
                    await call(messages, **({"n": 2} if action == "n" else {}), **kw)

    asyncio.run(agent())
    trajs = session.trajectories(1.0)
    used = set()
    for t in trajs:
        mask = np.concatenate([[False], t.loss_mask, [False]]).astype(int)
        starts, ends = np.flatnonzero(np.diff(mask) == 1), np.flatnonzero(np.diff(mask) == -1)
        assert len(starts) == t.info["turns"]
        for a, b in zip(starts, ends):
            match = [i for i, (fed, c) in enumerate(ep.fed) if i not in used and fed == list(t.tokens[:a])
                     and list(c.output_tokens[:b - a]) == list(t.tokens[a:b])]
            assert match, (seed, a, b)
            used.add(match[0])
            fed, c = ep.fed[match[0]]
            kept = list(c.output_tokens[:b - a])
            if len(kept) < len(c.output_tokens):  # cut where its text first held a stop string, not elsewhere
                assert any(x in tok.decode(kept) for x in stops), (seed, kept)
                assert not any(x in tok.decode(kept[:-1]) for x in stops), (seed, kept)
            np.testing.assert_array_equal(t.logprobs[a:b], c.logprobs[:b - a])
            np.testing.assert_array_equal(t.versions[a:b], c.versions[:b - a])
    assert len(used) == len(ep.fed) == session.counts.calls  # every call, once
    assert session.counts.prefix_breaks > 0


class Scripted(Recording):
    """An episode whose model writes `reply` (the parsing under test, not the model)."""

    reply = ""

    async def generate(self, tokens, draw=0, **overrides):
        out = self.tokenizer.encode(self.reply) + [self.tokenizer.eos_ids[0]]
        c = Completion(self.request_id, self.index, list(tokens), out, np.full(len(out), -0.5, np.float32),
                       np.zeros(len(out), np.int32), "stop", 0)
        self.fed.append((list(tokens), c))
        return c


def test_parallel_tool_calls_false_returns_at_most_one_call(served):
    """A reply with two tool calls: both by default, the first only with parallel_tool_calls false (OpenAI's
    meaning); the trajectory holds the model's whole reply either way."""
    call = '<tool_call>{{"name": "add", "arguments": {{"a": {}, "b": 2}}}}</tool_call>'
    counts = {}
    for parallel in (True, False):
        e = episode(served)
        ep = Scripted(e.prompt, e.index, e.request_id, e.backend, e.rewards, e.tokenizer, e.sampling, e.max_len)
        ep.reply = call.format(1) + "\n" + call.format(3)
        session = ChatSession(ep)

        async def agent(session, parallel):
            async with client_for(session) as client:
                return await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                            tools=TOOLS, parallel_tool_calls=parallel)

        r = asyncio.run(agent(session, parallel))
        calls = r.choices[0].message.tool_calls
        counts[parallel] = (len(calls), session.counts.tool_calls)
        assert json.loads(calls[0].function.arguments) == {"a": 1, "b": 2}
        (traj,) = session.trajectories(0.0)
        assert list(traj.tokens[traj.loss_mask]) == list(ep.fed[0][1].output_tokens)
    assert counts == {True: (2, 2), False: (1, 1)}


def test_a_stop_string_ends_the_reply_and_is_left_out_of_its_content(served):
    """`stop`: the reply ends where its text first contains a stop string, whether the model wrote the stop's own
    token or a token holding it among other characters; the content leaves the stop string out (as OpenAI's) and
    the trajectory keeps exactly the tokens up to the one that held it."""
    tok = served[2]
    messages = [{"role": "user", "content": "Count to ten."}]

    async def ask(**kw):
        session = ChatSession(episode(served))
        async with client_for(session) as client:
            r = await client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=1,
                                                     **kw)
        return r.choices[0], session

    _, free = asyncio.run(ask())
    produced = list(free.ep.fed[0][1].output_tokens)
    own, held = [], []  # stops that are a produced token's whole text / one character inside a produced token
    for j, t in enumerate(produced):
        piece, before = tok.decode([t]), tok.decode(produced[:j])
        if piece.strip() and tok.encode(piece) == [t] and piece not in before:
            own.append((j, piece))
        held += [(j, ch) for ch in dict.fromkeys(piece) if ch.strip() and ch not in before and ch != piece
                 and len(tok.encode(ch)) == 1][:1]
    assert own and held, (produced, tok.decode(produced))
    for j, stop in own[:2] + held[:2]:
        choice, session = asyncio.run(ask(stop=stop))
        (traj,) = session.trajectories(0.0)
        assert list(traj.tokens[traj.loss_mask]) == produced[:j + 1], (j, stop)
        text = tok.decode(produced[:j + 1])
        assert choice.message.content == text[:text.index(stop)] and choice.finish_reason == "stop", (j, stop)


def test_episodes_starting_at_once_share_one_endpoint():
    """The endpoint starts once per event loop, however many episodes start on it at the same moment."""
    from arealjax.workflows.endpoint import AgentEndpoint

    endpoint = AgentEndpoint()

    async def one(seen):
        async with endpoint.episode(None):
            seen.append(endpoint.base_url)
            await asyncio.sleep(0.05)
            seen.append(endpoint.base_url)

    async def many():
        seen = []
        await asyncio.gather(*[one(seen) for _ in range(4)])
        await endpoint.close()
        return seen

    assert len(set(asyncio.run(many()))) == 1


async def agent_calls_twice(client, data):
    for _ in range(2):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return 1.0


async def agent_calls_then_hangs(client, data):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    await asyncio.sleep(60)


def test_the_timeout_counts_the_agents_own_time_not_the_wait_for_a_busy_generator(served):
    """workflow timeout: an agent whose calls wait 1.5 s each for the model (queued behind other episodes) is not
    rejected by a 1 s timeout; one that hangs on its own after a slow call is, after about its timeout."""
    import time

    ep = episode(served)
    ep.__class__ = Queued
    Queued.wait = 1.5
    wf = OpenAIAgent("test_agent:agent_calls_twice", timeout=1.0)
    trajs = asyncio.run(wf.run(ep))  # the same message twice: two chains
    assert [t.reward for t in trajs] == [1.0, 1.0] and wf.metrics()["agent_calls"] == 2 and len(ep.fed) == 2
    ep = episode(served)
    ep.__class__ = Queued
    wf = OpenAIAgent("test_agent:agent_calls_then_hangs", timeout=1.0)
    t0 = time.monotonic()
    assert asyncio.run(wf.run(ep)) is None and wf.metrics()["agent_rejected_timeout"] == 1
    assert 2.4 < time.monotonic() - t0 < 10


async def agent_graded(client, data):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": data["prompt"]}],
                                         max_tokens=6)
    if data["answer"] == "raise":
        raise RuntimeError("the agent's own bug")
    return float(data["answer"] == "5")


FINAL_REPLIES: list[str] = []


async def agent_picks_the_first_of_two(client, data):
    messages = [{"role": "user", "content": data["prompt"]}]
    r = await client.chat.completions.create(model="m", messages=messages, max_tokens=4, n=2)
    messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Final answer?"}]
    final = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    FINAL_REPLIES.append(final.choices[0].message.content)
    return 1.0


def test_an_agents_answer_is_its_last_reply_whichever_chain_holds_it(served):
    """An agent that asks for two alternatives and carries on with the first: the episode has two trajectories,
    and evaluation reads its answer from the reply it ended with, not from the alternative it dropped."""
    from arealjax import evaluate as evaluation

    gen, rewards, tok = served
    prompts = [Prompt("p0", tok.encode(tok.apply_chat_template([{"role": "user", "content": "2 + 3?"}])), {},
                      text="2 + 3?")]
    spec = evaluation.EvalSpec(SamplingParams(temperature=1.0, max_new_tokens=12, seed=3), n=1, ks=(1,),
                               greedy=False)
    FINAL_REPLIES.clear()
    _, rows = evaluation.evaluate(gen, rewards, tok, prompts, spec,
                                  workflow=OpenAIAgent("test_agent:agent_picks_the_first_of_two"))
    assert rows[0]["completions"] == FINAL_REPLIES and len(FINAL_REPLIES) == 1


class Closed(OpenAIAgent):
    closed = 0

    async def close(self):
        type(self).closed += 1


def test_held_out_evaluation_runs_the_agent_as_training_does(served):
    """eval.workflow: every sample is an episode of the workflow: its reward is the agent's, a rejected episode scores
    0 and is counted, a reply cut at its token cap counts as truncated, the workflow is closed at the end. The
    single-turn workflow evaluated this way samples exactly what the plain evaluation samples (episode j draws as
    sample j of the prompt)."""
    from arealjax import evaluate as evaluation
    from arealjax.workflows import RLVR

    gen, rewards, tok = served
    prompts = [Prompt(f"p{i}", tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])),
                      {"answer": a}, text=q) for i, (q, a) in enumerate([("What is 2 + 3?", "5"), ("Hi?", "raise"),
                                                                         ("What is 1 + 1?", "3")])]
    spec = evaluation.EvalSpec(SamplingParams(temperature=1.0, max_new_tokens=12, seed=3), n=2, ks=(1, 2))
    summary, rows = evaluation.evaluate(gen, rewards, tok, prompts, spec, workflow=Closed("test_agent:agent_graded"))
    assert [r["rewards"] for r in rows] == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    assert [r["rejected"] for r in rows] == [0, 2, 0] and [r["greedy_reward"] for r in rows] == [1.0, 0.0, 0.0]
    assert summary["eval_rejected"] == pytest.approx(2 / 6) and summary["pass@1"] == pytest.approx(1 / 3)
    assert all(0 < n <= 6 for n in rows[0]["lengths"]) and rows[1]["lengths"] == [] and Closed.closed == 1
    assert rows[0]["truncated"] == sum(n == 6 for n in rows[0]["lengths"]) > 0  # cut at the agent's max_tokens
    assert summary["eval_truncated"] == pytest.approx(sum(r["truncated"] for r in rows) / 4)  # of 4 not rejected

    plain = evaluation.evaluate(gen, rewards, tok, prompts, spec)[1]
    episodes = evaluation.evaluate(gen, rewards, tok, prompts, spec, workflow=RLVR())[1]
    for a, b in zip(plain, episodes):
        assert {k: a[k] for k in a} == {k: b[k] for k in a} and b["rejected"] == 0


@pytest.mark.parametrize("example", ["calculator_agents_sdk:solve_chat", "calculator_langgraph:solve"])
def test_agents_written_with_real_frameworks_train_unchanged(served, example):
    """The examples/agents calculator agent written with the OpenAI Agents SDK (Agent, function_tool, Runner over
    OpenAIChatCompletionsModel) and with LangGraph (create_react_agent over
    langchain-openai's ChatOpenAI), each given the episode's client, run as episodes: every call each made is in
    its trajectories, token-faithful, scored by the run's reward function."""
    wf = OpenAIAgent(f"examples.agents.{example}", timeout=120)
    ep = episode(served, "What is 12 * 7?")
    trajs = asyncio.run(wf.run(ep))
    assert trajs, wf.metrics()
    assert wf.metrics()["agent_calls"] == len(ep.fed) >= 1
    produced = [list(c.output_tokens) for _, c in ep.fed]
    for traj in trajs:  # the model's tokens are exactly what some call produced
        tokens, mask = np.asarray(traj.tokens), np.asarray(traj.loss_mask)
        assert mask.any() and traj.reward == trajs[0].reward
        assert any(list(tokens[mask][:len(p)]) == p for p in produced if p)


def test_the_example_calculator_computes_arithmetic_and_refuses_the_rest():
    from examples.agents.calculator import calculate, evaluate

    assert evaluate("(12 + 3) * 7 / 5") == 21.0 and evaluate("-2 * 3") == -6
    with pytest.raises(ValueError, match="not arithmetic"):
        evaluate("__import__('os').getcwd()")
    assert calculate("1 / 0").startswith("error:") and calculate("2 ** 8").startswith("error:")


def test_the_responses_api_continues_one_trajectory_and_refuses_what_it_does_not_serve(served):
    """/v1/responses through the SDK: a reply's output items sent back with a new user turn continue the same
    token-faithful trajectory; usage and status as the API gives them; streaming, stored responses, built-in
    tools and unknown items are refused naming the field."""
    ep = episode(served)
    session = ChatSession(ep)
    tools = [{"type": "function", "name": "add", "description": "adds", "strict": True,
              "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}]

    async def agent():
        async with client_for(session) as client:
            r1 = await client.responses.create(model="m", instructions="Be brief.", input="What is 2 + 3?",
                                               tools=tools, max_output_tokens=8, include=[])
            history = [{"role": "user", "content": "What is 2 + 3?"},
                       *[o.model_dump(exclude_none=True) for o in r1.output],
                       {"role": "user", "content": [{"type": "input_text", "text": "Again."}]}]
            r2 = await client.responses.create(model="m", instructions="Be brief.", input=history, tools=tools,
                                               max_output_tokens=8)
            refused = []
            for kw in ({"stream": True}, {"previous_response_id": "resp_1"}, {"tools": [{"type": "web_search"}]},
                       {"input": [{"type": "image_generation_call", "id": "x"}]}):
                with pytest.raises(openai.BadRequestError) as e:
                    await client.responses.create(**{"model": "m", "input": "hi", **kw})
                refused.append(e.value.body["param"])
            return r1, r2, refused

    r1, r2, refused = asyncio.run(agent())
    assert refused == ["stream", "previous_response_id", "tools", "input[0]"]
    assert session.counts.calls == 2 and session.counts.prefix_breaks == 0 and len(session.chains) == 1
    (p1, c1), (p2, c2) = ep.fed
    assert p2[:len(p1) + len(c1.output_tokens)] == p1 + list(c1.output_tokens)  # one trajectory, extended
    for r, c in ((r1, c1), (r2, c2)):
        assert r.usage.output_tokens == len(c.output_tokens) and r.status in ("completed", "incomplete")
        assert (r.status == "incomplete") == (c.stop_reason == "length")
        text = served[2].decode(c.output_tokens, skip_special_tokens=True)
        assert r.output_text == text.strip()  # with tools, the text around calls is stripped (as on the chat route)


def test_responses_input_items_become_the_chat_turns_they_came_as():
    """A reply's message and function calls, sent back as items, are one assistant turn (so the session recognises
    its own reply); function_call_output items are tool messages; calls without a message open a turn."""
    from arealjax.workflows.responses import _messages

    call = lambda i: {"type": "function_call", "id": f"fc_{i}", "call_id": f"call_{i}", "name": "add",  # noqa: E731
                      "arguments": '{"a": 1}', "status": "completed"}
    said = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Adding.", "annotations": [], "logprobs": []}]}
    out = _messages({"instructions": "sys", "input": [
        {"role": "user", "content": "q"}, said, call(1), call(2),
        {"type": "function_call_output", "call_id": "call_1", "output": "1"},
        {"type": "function_call_output", "call_id": "call_2", "output": "2"}, call(3),
        {"type": "function_call_output", "call_id": "call_3", "output": "3"}]})
    tc = lambda i: {"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}  # noqa: E731
    assert out == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
                   {"role": "assistant", "content": "Adding.", "tool_calls": [tc(1), tc(2)]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "1"},
                   {"role": "tool", "tool_call_id": "call_2", "content": "2"},
                   {"role": "assistant", "content": "", "tool_calls": [tc(3)]},
                   {"role": "tool", "tool_call_id": "call_3", "content": "3"}]



def test_an_agents_sdk_agent_on_its_default_responses_model_trains_and_a_cut_reply_rejects_its_episode(served):
    """The Agents SDK's default model speaks the Responses API. A reply cut by the generation cap is `incomplete`
    (reason max_output_tokens) as OpenAI reports it, and the SDK raises on it: the episode is rejected and counted.
    The same episode (its draws are keyed by seed, prompt and position) ending at a stop token instead completes:
    its calls are its trajectories, scored by the run's reward function."""
    wf = OpenAIAgent("examples.agents.calculator_agents_sdk:solve", timeout=120)
    cut = episode(served, "What is 12 * 7?")
    assert asyncio.run(wf.run(cut)) is None
    assert wf.metrics()["agent_rejected_error"] == 1 and cut.fed[0][1].stop_reason == "length"
    first = cut.fed[0][1].output_tokens[0]
    ep = episode(served, "What is 12 * 7?", stops=(first,))  # the same reply, ending at its first token
    trajs = asyncio.run(wf.run(ep))
    assert trajs and list(ep.fed[0][1].output_tokens) == [first] and wf.metrics()["agent_calls"] == 2
    (traj,) = trajs
    assert list(np.asarray(traj.tokens)[np.asarray(traj.loss_mask)]) == [first]


COMMAND_AGENTS = {  # name -> script: each an agent as a program, run with the episode's endpoint and key
    "posts": """
import os, httpx, openai
c = openai.OpenAI(max_retries=0)
c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
h = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
httpx.post(os.environ["OPENAI_BASE_URL"] + "/rl/reward", json={"reward": 0.25}, headers=h).raise_for_status()
""",
    "prints": """
import openai
openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4)
print("thinking...")
print(0.5)
""",
    "prints_nan": """
import openai
openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4)
print("nan")
""",
    "hostile": """
import os, httpx
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
auth = lambda k: {"Authorization": "Bearer " + k}
codes = [httpx.post(base + "/chat/completions", json=body).status_code,
         httpx.post(base + "/chat/completions", json=body, headers=auth(key[:-1] + "x")).status_code,
         httpx.post(base + "/chat/completions", json=body, headers=auth(os.environ["OLD_KEY"])).status_code,
         httpx.post(base + "/rl/reward", json={"reward": 9}, headers=auth("wrong")).status_code,
         httpx.post(base + "/chat/completions", content=b"x" * (5 << 20), headers=auth(key)).status_code,
         httpx.post(base + "/rl/reward", json={"reward": "high"}, headers=auth(key)).status_code,
         httpx.post(base + "/rl/reward", content=b'{"reward": NaN}', headers=auth(key)).status_code]
open(os.environ["OUT"], "w").write(" ".join(map(str, codes)) + " " + key)
print(1.0)
""",
    "chatty": """
import sys, openai
openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4)
for _ in range(800):
    sys.stdout.write("x" * (1 << 16) + "\\n")
    sys.stderr.write("y" * (1 << 16) + "\\n")
print(0.75)
""",
    "crashes": "import sys; sys.exit('the agent broke')",
    "hangs": "import time; time.sleep(60)",
    "silent": """
import openai
openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4)
print("done")
""",
}


def test_agents_run_as_commands_through_the_episode_endpoint(served, tmp_path, monkeypatch):
    """`command`: each episode runs the program with OPENAI_BASE_URL (127.0.0.1), its own OPENAI_API_KEY and
    AREALJAX_DATA. Its calls are the episode's trajectories; its reward is what it posted or printed last. No key,
    a wrong key or an expired one gets 401 and touches nothing; a body over the bound 413; a bad reward 400. A
    program that exits non-zero, hangs past the timeout (killed) or reports no reward is a rejected episode; one
    that prints 50 MiB to each stream is read to its last line in bounded memory (`TAIL_BYTES` of each kept)."""
    import sys
    import tracemalloc

    scripts = {}
    for name, code in COMMAND_AGENTS.items():
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(code)
    monkeypatch.setenv("OUT", str(tmp_path / "hostile.txt"))
    run = lambda name, **kw: OpenAIAgent(command=f"{sys.executable} {scripts[name]}", **kw)  # noqa: E731

    async def episodes():
        out = {}
        for name, kw in (("posts", {}), ("prints", {}), ("chatty", {}), ("hostile", {}), ("crashes", {}),
                         ("hangs", {"timeout": 2}), ("silent", {}), ("prints_nan", {})):
            wf = run(name, **kw)
            async with wf.endpoint.episode(ChatSession(episode(served))) as old:  # an episode that has ended
                pass
            monkeypatch.setenv("OLD_KEY", old.key)
            ep = episode(served, "What is 2 + 3?")
            tracemalloc.start()
            out[name] = (await wf.run(ep), wf.metrics(), ep, wf.endpoint.base_url, tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
            await wf.close()
        return out

    out = asyncio.run(episodes())
    for name, reward in (("posts", 0.25), ("prints", 0.5), ("chatty", 0.75)):
        trajs, m, ep, base, _ = out[name]
        assert base.startswith("http://127.0.0.1:") and m["agent_calls"] == len(ep.fed) == 1
        (traj,) = trajs
        assert traj.reward == reward and list(traj.tokens[:len(ep.fed[0][0])]) == ep.fed[0][0]
    *codes, key = (tmp_path / "hostile.txt").read_text().split()
    assert codes == ["401", "401", "401", "401", "413", "400", "400"] and len(key) >= 43  # no key, wrong, ...
    assert out["chatty"][4] < 16 << 20, out["chatty"][4]  # 100 MiB printed; what was kept of it: little
    trajs, m, ep, _, _ = out["hostile"]
    assert trajs is None and not ep.fed and m["agent_rejected_no_call"] == 1  # nothing reached the episode
    for name, reason in (("crashes", "exit"), ("hangs", "timeout"), ("silent", "no_reward"),
                         ("prints_nan", "bad_reward")):
        trajs, m, _, _, _ = out[name]
        assert trajs is None and m[f"agent_rejected_{reason}"] == 1, (name, m)


def test_the_example_command_agent_trains_through_the_endpoint(served):
    """examples/agents/calculator_command.py, plain `openai` calls in a program of its own: its calls are the
    episode's trajectory and its reward (the row's answer checked against its \\boxed{}, posted) the episode's."""
    import sys

    wf = OpenAIAgent(command=f"{sys.executable} examples/agents/calculator_command.py", timeout=120)

    async def one():
        try:
            return await wf.run(ep)
        finally:
            await wf.close()

    ep = episode(served, "What is 12 * 7?", answer="84")
    trajs = asyncio.run(one())
    assert trajs and {t.reward for t in trajs} == {0.0} and wf.metrics()["agent_calls"] == len(ep.fed) >= 1


def test_agent_http_calls_do_not_log_a_line_each():
    """httpx logs every request at INFO: with agents, one line per chat call would bury the run's log."""
    import logging

    from arealjax.runtime import log_above_bars

    root, level = logging.root.handlers[:], logging.root.level
    try:
        log_above_bars()
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        assert logging.getLogger("arealjax.workflows.agent").isEnabledFor(logging.INFO)
    finally:
        logging.root.handlers, logging.root.level = root, level
        logging.getLogger("httpx").setLevel(logging.NOTSET)


def test_a_command_agent_dies_with_its_trainer_killed_by_sigkill(tmp_path):
    """A command agent runs in a session of its own (a timeout kills its whole process group), so a trainer killed
    with SIGKILL (an out-of-memory kill, say) left it running forever; its guard (workflows/guard.py) now kills it,
    what it started included, within seconds."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pids = tmp_path / "pids"
    agent = tmp_path / "agent.py"
    agent.write_text("import os, subprocess, sys, time\n"
                     "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                     "open(os.environ['PIDS'], 'w').write(f'{os.getpid()} {child.pid}')\n"
                     "time.sleep(600)\n")
    trainer = tmp_path / "trainer.py"
    trainer.write_text("import asyncio, os, sys\n"
                       "from arealjax.workflows.agent import start_command\n"
                       "async def main():\n"
                       f"    await start_command(f'{{sys.executable}} {agent}', dict(os.environ))\n"
                       "    await asyncio.sleep(600)\n"
                       "asyncio.run(main())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, str(trainer)], cwd=root,
                            env={**os.environ, "PIDS": str(pids), "PYTHONPATH": root})
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and len(pids.read_text().split()) == 2):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        started = [int(p) for p in pids.read_text().split()]
        proc.kill()  # the trainer only
        proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = [p for p in started if _alive(p)]
        for p in survivors:
            os.kill(p, signal.SIGKILL)
        assert not survivors
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    """Running, not a zombie left for its parent to reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
