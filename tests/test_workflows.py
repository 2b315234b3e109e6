"""Workflows: loss masks, logprobs and versions stay right across turns (env tokens untrained, every model token
with the logprob and version that sampled it), the turn discount, user workflows by import path, and a tool-call
episode end to end on a tiny model: it writes code, the sandbox runs it, the output comes back, it answers."""

import asyncio
import dataclasses

import jax
import numpy as np
import pytest
from conftest import scored
from test_controller import small_config

from arealjax import builders
from arealjax.api import Completion, SamplingParams
from arealjax.config import parse
from arealjax.controller import Prompt, RolloutController
from arealjax.data.pipeline import format_prompt
from arealjax.generation.engine import Engine
from arealjax.generation.generator import Generator
from arealjax.rewards.service import RewardService
from arealjax.rl.advantages import AdvantageConfig
from arealjax.rl.trainer import Trainer
from arealjax.sft import trainer_config
from arealjax.sharding import LogicalSharding, normalize_rules, role_meshes, tree_shardings
from arealjax.staleness import StalenessManager
from arealjax.tokenizer import CharTokenizer
from arealjax.workflows import Episode, MultiTurn, ToolCalls, Turns, load_workflow, user_turn

ALPHABET = "0123456789+-*=?.,:; abcdefghijklmnopqrstuvwxyz\n<>/()"


def setup(c):
    rules = normalize_rules(c.sharding_rules)
    meshes = role_meshes(c.mesh)
    tokenizer, model = builders.build(parse(c), meshes["trainer"], rules)
    gen_model = model.to_mesh(meshes["generator"], rules)
    shard = LogicalSharding(meshes["generator"], rules)
    return rules, meshes, tokenizer, model, gen_model, shard


def logprobs_of(trainer, params, traj):
    """Per token k of `traj` (k >= 1): log p(token k | tokens < k) under `params`, by a full forward (the model
    turns' tokens: the trainer scores its loss positions only, 0 elsewhere)."""
    batch = trainer.pack([dataclasses.replace(traj, advantage=0.0)])[0]
    return scored(np.asarray(trainer.logprobs(params, batch)[0]), batch.micro(0), len(traj))



class SwapAfterFirstTurn(Episode):
    """Moves the generator to the trainer's next version between the first and the second model turn."""
    swap = None

    async def generate(self, tokens, **overrides):
        if self._calls == 1:
            await asyncio.to_thread(self.swap)
        return await super().generate(tokens, **overrides)


def test_multi_turn_masks_logprobs_and_versions(tmp_path):
    c = small_config(1)
    c.trainer.max_tokens = 96
    rules, meshes, tokenizer, model, gen_model, shard = setup(c)
    trainer = Trainer(model, parse(c).trainer, mesh=meshes["trainer"], rules=rules)
    params_v0 = jax.tree.map(np.asarray, trainer.params)
    prompt = Prompt("p", format_prompt(tokenizer, "12+34="), {})
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=tuple(tokenizer.eos_ids), seed=3)
    feedback = user_turn(tokenizer, "wrong. again.", after_eos=True)
    assert tokenizer.decode(feedback) == "\nu:wrong. again.\na:"

    with Generator(Engine(gen_model, slots=4, max_len=96, shard=shard), gen_model.params) as generator, \
            RewardService("reward_fns:zero", workers=1) as rewards:
        def swap():
            rng = np.random.RandomState(0)
            t = Turns(prompt.tokens)
            t.model(Completion("", 0, [], list(rng.randint(3, 40, 6)), np.full(6, -3.0), np.zeros(6), "stop", 0))
            trainer.train_step([dataclasses.replace(t.build(0.0), advantage=1.0)])
            params = jax.device_put(trainer.params, tree_shardings(gen_model.params, shard), may_alias=False)
            generator.update_weights(params, trainer.version).result(timeout=60)

        SwapAfterFirstTurn.swap = staticmethod(swap)
        ep = SwapAfterFirstTurn(prompt, 1, "p#0/1", generator, rewards, tokenizer, sampling, 96)
        traj = asyncio.run(MultiTurn(max_turns=3, feedback="wrong. again.").run(ep))

    assert traj.info["turns"] == 3 and traj.reward == 0.0
    mask, versions = traj.loss_mask, traj.versions
    # segments: prompt | model turn | feedback | model turn | feedback | model turn
    edges = np.flatnonzero(np.diff(mask.astype(int))) + 1
    segments = np.split(np.arange(len(traj)), edges)
    assert [bool(mask[s[0]]) for s in segments] == [False, True, False, True, False, True]
    for s in segments[2::2]:
        assert traj.tokens[s].tolist() == feedback  # env tokens: the feedback turn, untrained, no version
        assert (versions[s] == -1).all() and (traj.logprobs[s] == 0).all()
    assert (versions[segments[1]] == 0).all()
    assert (versions[segments[3]] == 1).all() and (versions[segments[5]] == 1).all()
    # every model token's behaviour logprob is the logprob of that token in that context under its version
    for params, turns in ((params_v0, [1]), (trainer.params, [3, 5])):
        want = logprobs_of(trainer, params, traj)
        for i in turns:
            np.testing.assert_allclose(traj.logprobs[segments[i]], want[segments[i]], atol=2e-5)


def test_turn_discount_and_workflows_by_import_path(tmp_path):
    c = small_config(1)
    rules, meshes, tokenizer, model, gen_model, shard = setup(c)
    prompt = Prompt("p", format_prompt(tokenizer, "1+1="), {"marker": str(tmp_path / "m")})
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=tuple(tokenizer.eos_ids))
    workflow = load_workflow("arealjax.workflows:MultiTurn", {"max_turns": 4, "turn_discount": 0.5})
    with Generator(Engine(gen_model, slots=2, max_len=64, shard=shard), gen_model.params) as generator, \
            RewardService("reward_fns:right_from_second_call", workers=1) as rewards:
        traj = asyncio.run(workflow.run(Episode(prompt, 0, "p#0/0", generator, rewards, tokenizer, sampling, 64)))
    assert traj.info["turns"] == 2 and traj.info["raw_reward"] == 1.0 and traj.reward == 0.5
    with pytest.raises(ValueError, match="workflow 'arealjax.workflows:Nope' cannot be imported"):
        load_workflow("arealjax.workflows:Nope")
    with pytest.raises(ValueError, match="unexpected keyword argument 'turns'"):
        load_workflow("arealjax.workflows:MultiTurn", {"turns": 2})
    with pytest.raises(ValueError, match="async def run"):
        load_workflow("arealjax.workflows:Turns", {"prompt_tokens": []})


PROBLEMS = [("6*7?", "print(6*7)", "42"), ("8*9?", "print(8*9)", "72")]


def tool_demonstrations(tokenizer):
    """Prompt, the model's tool call, the tool's output (untrained), the model's answer."""
    out = []
    for question, code, answer in PROBLEMS:
        t = Turns(format_prompt(tokenizer, question))
        for kind, text in (("model", f"<code>{code}</code>"), ("env", f"<out>{answer}\n</out>"),
                           ("model", answer)):
            ids = tokenizer.encode(text) + ([tokenizer.eos_ids[0]] if text == answer else [])
            if kind == "env":
                t.env(ids)
            else:
                t.model(Completion("", 0, [], ids, np.zeros(len(ids)), np.zeros(len(ids)), "stop", 0))
        out.append(dataclasses.replace(t.build(0.0), advantage=0.0))
    return out


@pytest.mark.slow
def test_tool_call_episode_end_to_end_on_a_tiny_model():
    c = small_config(0)
    c.trainer.max_tokens = 64
    c.tokenizer.alphabet = ALPHABET
    c.model.update(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    rules, meshes, tokenizer, model, gen_model, shard = setup(c)
    assert isinstance(tokenizer, CharTokenizer)
    # teach it the protocol (call the tool, then answer from its output) at a high learning rate: 60 steps, where
    # 25 already make every greedy episode right
    c.sft.update(max_tokens=64, micro_rows=8, steps=60)
    c.sft.optim.update(lr=1e-2, warmup_steps=5)
    sft = Trainer(model, trainer_config(parse(c).sft, parse(c).trainer), mesh=meshes["trainer"], rules=rules)
    demos = tool_demonstrations(tokenizer)
    for _ in range(60):
        sft.train_step(demos * 4)
    trainer = Trainer(sft.model, parse(c).trainer, mesh=meshes["trainer"], rules=rules)
    gen_model = sft.model.to_mesh(meshes["generator"], rules)

    prompts = iter([Prompt(f"q{i}", format_prompt(tokenizer, q), {"answer": a})
                    for i, (q, _, a) in enumerate(PROBLEMS)])
    sampling = SamplingParams(temperature=0.0, max_new_tokens=40, n=2, stop_token_ids=tuple(tokenizer.eos_ids))
    with Generator(Engine(gen_model, slots=4, max_len=96, shard=shard), gen_model.params) as generator, \
            RewardService("arealjax.rewards.math:math_reward", workers=1) as rewards:
        controller = RolloutController(generator, rewards, tokenizer, prompts, StalenessManager(2, 0, 2), sampling,
                                       AdvantageConfig(filter_uniform=False), workflow=ToolCalls(max_calls=2))
        controller.start()
        try:
            batch = controller.get_batch(trainer_version=0, timeout=120)
        finally:
            controller.stop()
    for group, (_, code, answer) in zip(sorted(batch, key=lambda g: g.prompt.id), PROBLEMS):
        for traj in group.trajectories:
            text = lambda m, traj=traj: tokenizer.decode(traj.tokens[m])  # noqa: E731
            assert traj.info["tool_calls"] == 1 and traj.reward == 1.0, tokenizer.decode(traj.tokens)
            env = ~traj.loss_mask & (np.arange(len(traj)) >= len(group.prompt.tokens))
            assert text(env) == f"<out>{answer}\n</out>"  # what the sandbox printed, fed back untrained
            assert text(traj.loss_mask) == f"<code>{code}</code>{answer}"
            assert (traj.versions[traj.loss_mask] == 0).all() and (traj.versions[~traj.loss_mask] == -1).all()
            assert (traj.logprobs[traj.loss_mask] < 0).all() and (traj.logprobs[~traj.loss_mask] == 0).all()
    m = trainer.train_step([t for g in batch for t in g.trajectories])
    assert np.isfinite(m["loss"])
