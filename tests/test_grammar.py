"""Structured outputs (generation/grammar.py): constrained samples are valid values of their schema at every sampling
setting, their neighbours in the batch draw what they would have drawn, the behaviour logprob of a constrained
token is the policy's own (the trainer's ratio is 1 at that version), and agents asking for JSON get it (chat,
Responses, the Agents SDK's `output_type=`)."""

import asyncio
import dataclasses
import json

import numpy as np
import openai
import pydantic
import pytest

from arealjax.api import SamplingParams
from arealjax.generation.engine import Engine
from arealjax.generation.generator import Generator
from arealjax.generation.grammar import Grammars
from arealjax.generation.rpc import sampling_from_wire, sampling_to_wire
from arealjax.models import load_pretrained
from arealjax.rewards.service import RewardService
from arealjax.structured import json_grammar, response_grammar
from arealjax.tokenizer import CharTokenizer, load_tokenizer
from arealjax.workflows import Episode, Prompt
from arealjax.workflows.agent import OpenAIAgent, client_for
from arealjax.workflows.chat import ChatSession

SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "integer", "minimum": 0, "maximum": 999},
    "unit": {"enum": ["cm", "kg", "s"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "unit", "sure"], "additionalProperties": False}


class Answer(pydantic.BaseModel):
    answer: int = pydantic.Field(ge=0, le=999)  # bounded: a random model may otherwise write digits to the cap
    sure: bool


@pytest.fixture(scope="module")
def tiny(tiny_recipes):
    path = tiny_recipes / "qwen3"
    model, tok = load_pretrained(path), load_tokenizer(path)
    grammars = Grammars(lambda: tok, model.cfg.vocab_size)
    with Generator(Engine(model, slots=8, max_len=1024), model.params, decode_steps=4, grammars=grammars) as gen, \
            RewardService("reward_fns:length", workers=1) as rewards:
        yield model, tok, gen, rewards


def valid(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"answer", "unit", "sure"} and isinstance(value["answer"], int)
            and 0 <= value["answer"] <= 999 and value["unit"] in ("cm", "kg", "s") and isinstance(value["sure"], bool))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9), (0.0, 0, 1.0)])
def test_constrained_samples_are_values_of_their_schema_and_their_neighbours_draw_what_they_would(
        tiny, temperature, top_k, top_p):
    """n samples under a JSON schema, each valid, ended by the model's stop token; an unconstrained request decoded
    beside them (its calls run one step at a time while they are in flight) draws exactly what it draws alone."""
    _, tok, gen, _ = tiny
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "How long?"}]))
    base = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=48,
                          stop_token_ids=tuple(tok.eos_ids), seed=5)
    alone = gen.submit(prompt, dataclasses.replace(base, n=2)).result(timeout=120)
    together = gen.submit(prompt, dataclasses.replace(base, n=2))
    constrained = gen.submit(prompt, dataclasses.replace(base, n=3, grammar=json_grammar(SCHEMA))).result(timeout=120)
    for c in constrained:
        assert c.stop_reason == "stop" and c.output_tokens[-1] in tok.eos_ids
        assert valid(tok.decode(c.output_tokens[:-1])), tok.decode(c.output_tokens)
    assert [c.output_tokens for c in together.result(timeout=120)] == [c.output_tokens for c in alone]
    assert not any(valid_json(tok.decode(c.output_tokens)) for c in alone)  # what the grammar changed


def valid_json(text: str) -> bool:
    try:
        return valid(text)
    except (ValueError, AttributeError, TypeError):
        return False


def test_the_behaviour_logprob_of_a_constrained_token_is_the_policys_own(tiny):
    """Each recorded logprob is log softmax(logits / T) of a full forward at that token over the whole vocabulary
    (what the trainer recomputes: the ratio is 1 at the version that drew it), below the log of the masked,
    renormalised probability it was drawn with wherever the grammar removed mass."""
    model, tok, gen, _ = tiny
    t = 0.8
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Answer in JSON."}]))
    grammar = json_grammar(SCHEMA)
    (c,) = gen.submit(prompt, SamplingParams(temperature=t, max_new_tokens=48, stop_token_ids=tuple(tok.eos_ids),
                                             seed=11, grammar=grammar)).result(timeout=120)
    seq = prompt + c.output_tokens[:-1]
    logits = np.asarray(model(np.asarray([seq], np.int32)), np.float64)[0, len(prompt) - 1:] / t
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    policy = logp[np.arange(len(c.output_tokens)), c.output_tokens]
    np.testing.assert_allclose(c.logprobs, policy, atol=2e-4)
    matcher, masked = Grammars(lambda: tok, model.cfg.vocab_size).matcher(grammar), []
    for i, token in enumerate(c.output_tokens):
        bits = Grammars(lambda: tok, model.cfg.vocab_size).masks([(matcher, tuple(tok.eos_ids))], 1)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:model.cfg.vocab_size].astype(bool)
        assert allowed[token]
        masked.append(logp[i, token] - np.log(np.exp(logp[i][allowed]).sum()))
        matcher.consume_token(token)
    assert np.all(np.asarray(masked) >= policy - 1e-9) and np.any(np.asarray(masked) > policy + 0.1)


def test_masks_allow_everything_without_a_grammar_and_the_stop_tokens_where_it_may_end():
    tok = CharTokenizer('{}":, 0123456789abcdefghijklmnopqrstuvwxyz')
    grammars = Grammars(lambda: tok, 64)  # the model's vocabulary may be larger than the tokenizer's
    m = grammars.matcher(json_grammar({"type": "object", "properties": {"a": {"type": "integer"}},
                                       "required": ["a"], "additionalProperties": False}))
    bits = grammars.masks([(None, ()), (m, (2,))], 4)
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :64].astype(bool)
    assert allowed[0].all() and allowed[2:].all()
    assert [tok.decode([i]) for i in np.flatnonzero(allowed[1])] == ["{"]
    for token in tok.encode('{"a": 12}'):
        assert m.consume_token(token)
    bits = grammars.masks([(m, (2, 5))], 1)
    assert set(np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:64])) == {2, 5}


@pytest.mark.parametrize("fmt,match", [
    ({"type": "xml"}, "expected {'type': 'text' | 'json_object' | 'json_schema'"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "objectx"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "must be a JSON schema object"),
])
def test_a_format_that_cannot_be_served_is_refused_naming_it(tiny, fmt, match):
    _, tok, gen, rewards = tiny
    session = ChatSession(episode(tiny))

    async def agent():
        async with client_for(session) as client:
            return await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                        response_format=fmt)

    with pytest.raises(openai.BadRequestError, match=match) as e:
        asyncio.run(agent())
    assert e.value.body["param"] == "response_format" and session.counts.calls == 0
    with pytest.raises(ValueError, match="grammar"):
        gen.submit([1, 2], SamplingParams(grammar="start: %json {\"type\": \"objectx\"}"))


def episode(tiny, text="What is 2 + 3?", max_new_tokens=96):
    _, tok, gen, rewards = tiny
    prompt = Prompt("p", tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])), {}, text=text)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=tuple(tok.eos_ids),
                              seed=7)
    return Episode(prompt, 0, "p#0/0", gen, rewards, tok, sampling, 1024)


def test_the_sdk_parses_structured_replies_on_chat_and_responses_with_tools_beside_them(tiny):
    """`chat.completions.parse` and `responses.parse` with a pydantic model (the SDK sends a strict json_schema)
    get a parsed value; `json_object` gets an object (or its start, cut at the cap); with tools the reply is the
    schema's value or tool calls naming a tool with arguments of its schema."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "maximum": 99},
                                         "b": {"type": "integer", "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}]
    session = ChatSession(episode(tiny))
    user = [{"role": "user", "content": "What is 2 + 3? Answer in JSON."}]

    async def agent():
        async with client_for(session) as client:
            chat = await client.chat.completions.parse(model="m", messages=user, response_format=Answer, n=2)
            responses = await client.responses.parse(model="m", input=user, text_format=Answer)
            obj = await client.chat.completions.create(model="m", messages=user, n=4,
                                                       response_format={"type": "json_object"})
            called = await client.chat.completions.create(
                model="m", messages=user, tools=tools, n=4, response_format={
                    "type": "json_schema", "json_schema": {"name": "answer", "schema": Answer.model_json_schema()}})
            return chat, responses, obj, called

    chat, responses, obj, called = asyncio.run(agent())
    assert all(isinstance(c.message.parsed, Answer) for c in chat.choices)
    assert isinstance(responses.output_parsed, Answer) and responses.text.format.type == "json_schema"
    ended = [c for c in obj.choices if c.finish_reason == "stop"]  # any object: some run to the cap in strings
    assert ended and all(isinstance(json.loads(c.message.content), dict) for c in ended)
    assert all(c.message.content.startswith("{") for c in obj.choices)
    for c in called.choices:
        if c.message.tool_calls:
            args = [json.loads(x.function.arguments) for x in c.message.tool_calls]
            assert all(set(a) == {"a", "b"} for a in args) and c.finish_reason == "tool_calls"
        else:
            Answer.model_validate_json(c.message.content)
    assert session.counts.unparsed_tool_calls == 0


async def typed_agent(client, data: dict) -> None:
    """An Agents SDK agent with `output_type=` over its default Responses model, then over Chat Completions."""
    from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    for model in (OpenAIResponsesModel(model="m", openai_client=client),
                  OpenAIChatCompletionsModel(model="m", openai_client=client)):
        result = await Runner.run(Agent(name="typed", model=model, output_type=Answer, instructions="Answer."),
                                  data["prompt"], max_turns=1)
        assert isinstance(result.final_output, Answer)


def test_an_agents_sdk_agent_with_an_output_type_trains(tiny):
    """The Agents SDK's `output_type=` (a strict JSON schema, through the Responses API and through Chat
    Completions): the final output is the typed value, and both calls are the episode's trajectories."""
    wf = OpenAIAgent("test_grammar:typed_agent", timeout=120)
    ep = episode(tiny, "What is 12 * 7?")
    trajs = asyncio.run(wf.run(ep))
    assert trajs and wf.metrics()["agent_calls"] == 2, wf.metrics()
    assert all(np.asarray(t.loss_mask).any() for t in trajs)


def test_a_grammar_travels_to_generation_servers():
    s = SamplingParams(n=2, seed=3, grammar=response_grammar({"type": "json_object"}))
    assert sampling_from_wire(json.loads(json.dumps(sampling_to_wire(s)))) == s
