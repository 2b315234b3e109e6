"""The async RL loop end to end on 8 fake CPU devices (trainer and generator on disjoint pairs): staleness never
exceeds η on any trained batch, η = 0 is synchronous, every prompt is accounted for, and after a weight sync the
generator scores tokens exactly as the trainer does."""

import asyncio
import concurrent.futures
import json
import logging
import threading
import time

import jax
import numpy as np
import pytest
from conftest import scored

from arealjax import builders, train
from arealjax.api import SamplingParams
from arealjax.config import parse
from arealjax.controller import Prompt, RolloutController, Stopping
from arealjax.data.pipeline import format_prompt
from arealjax.data.prompts import train_prompts
from arealjax.generation.engine import Engine
from arealjax.generation.generator import Generator
from arealjax.metrics import Meter
from arealjax.rewards.service import RewardService
from arealjax.rl.advantages import AdvantageConfig, assign_advantages
from arealjax.rl.trainer import Trainer
from arealjax.rl.trajectory import Trajectory
from arealjax.sharding import LogicalSharding, normalize_rules, role_meshes, tree_shardings
from arealjax.staleness import StalenessManager
from arealjax.tokenizer import CharTokenizer
from arealjax.workflows import Turns
from configs.default import get_config


def small_config(max_staleness: int, steps: int = 4):
    c = get_config()
    c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    c.sft.steps = 0
    c.rl.update(steps=steps, batch_size=4, group_size=2, max_staleness=max_staleness, max_new_tokens=12,
                eval_every=0, max_concurrent=16)
    c.advantage.filter_uniform = False  # a random model scores 0 everywhere: keep every group
    c.generator.update(slots=8, max_len=32, max_prefill_batch=8)
    c.trainer.update(max_tokens=32, micro_rows=8)
    c.eval.num_problems = 4
    c.rewards.workers = 1
    return c


@pytest.mark.slow
@pytest.mark.parametrize("eta", [0, 1])
def test_async_loop_respects_staleness_and_accounts_for_every_prompt(tmp_path, eta, caplog):
    summary = train.run(small_config(eta), str(tmp_path))
    # stopping with groups in flight is quiet: no callback fails on the shut-down scorer
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["version"] for r in steps] == [1, 2, 3, 4]  # versions rise by one per step
    assert all(r["staleness_max"] <= eta for r in steps)  # the controller also raises on any violation
    if eta == 0:
        assert all(r["staleness_max"] == 0 for r in steps)
    p = summary["prompts"]
    assert p["submitted"] == p["trained"] + p["filtered"] + p["queued"] + p["in_flight"]
    assert p["trained"] == 4 * 4
    for name in ("curves.png", "summary.json", "model/config.json"):
        assert (tmp_path / name).is_file(), name
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


class RejectFirstEpisode:
    """Rejects episode 0 of every other prompt: groups of n and n − 1 in one batch."""

    async def run(self, ep):
        if ep.index == 0 and int(ep.prompt.id.split("-")[1]) % 2:
            return None
        c = await ep.generate(ep.prompt.tokens)
        turns = Turns(ep.prompt.tokens)
        turns.model(c)
        return turns.build(reward=float(ep.index))


def test_rejected_episodes_give_unequal_groups_that_train(tmp_path):
    """A workflow that rejects an episode used to crash the step ("groups must have equal sizes")."""
    c = small_config(1, steps=3)
    c.rl.group_size = 3
    c.workflow.path = "test_controller:RejectFirstEpisode"
    train.run(c, str(tmp_path))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 3 and all(np.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["rejected_episodes"] > 0 and sum(r["sequences"] for r in steps) < 3 * 4 * 3


def test_rollout_reward_has_no_value_when_nothing_was_scored():
    """It used to be logged as 0.0 for a step in which nothing was scored (a drop to 0 in the README's curve)."""
    counts = {"scored_samples_total": 10, "reward_sum_total": 4.0}
    meter = Meter({"controller": lambda: dict(counts)})
    assert "rollout_reward" not in meter.step()
    counts.update(scored_samples_total=14, reward_sum_total=7.0)
    assert meter.step()["rollout_reward"] == 0.75


def test_meter_reports_counter_changes_gauges_and_rates():
    """`_total` counters as their change per step, gauges as they are, rates over the step's time; mark() leaves
    what happened before it (an evaluation) out of the named source's counts and of the rates."""
    clock = iter([0.0, 2.0, 6.0, 7.0]).__next__
    gen = {"decode_steps_total": 5, "kv_pages_peak": 3, "generated_tokens_total": 100}
    meter = Meter({"backend": lambda: dict(gen)}, clock=clock)  # t = 0
    gen.update(decode_steps_total=9, generated_tokens_total=140)
    m = meter.step(batch_wait_seconds=0.5)  # t = 2
    assert m == {"decode_steps": 4, "kv_pages_peak": 3, "generated_tokens": 40, "generated_tokens_per_s": 20.0,
                 "batch_wait_seconds": 0.5, "wall_seconds": 2.0}
    gen.update(decode_steps_total=20, generated_tokens_total=200)
    meter.mark("backend")  # t = 6: an evaluation ran the backend
    gen.update(decode_steps_total=21, generated_tokens_total=210)
    m = meter.step()  # t = 7
    assert m["decode_steps"] == 1 and m["generated_tokens_per_s"] == 10.0 and m["wall_seconds"] == 7.0


def test_starved_trainer_stops_with_a_clear_error(tmp_path):
    """A random model scores 0 on every sample, so dynamic filtering drops every group: the run must stop with an
    error that says so (and shut its threads and workers down) instead of waiting forever for a batch."""
    c = small_config(1)
    c.advantage.filter_uniform = True
    c.rl.max_filtered_in_a_row = 6
    with pytest.raises(RuntimeError, match=r"dynamic filtering dropped 6 groups in a row .*mean of those rewards "
                                           r"0\.000.*advantage\.filter_uniform=False"):
        train.run(c, str(tmp_path))


def test_solved_task_ends_the_run_as_completed(tmp_path):
    """When every sample is right, dynamic filtering drops every group: the task is solved, the success the job
    exists for. The run must end as completed with its model, evaluation and summary (it used to fail with
    "dynamic filtering dropped 500 groups in a row")."""
    c = small_config(1, steps=50)
    c.advantage.filter_uniform = True
    c.rl.max_filtered_in_a_row = 6
    c.rewards.fn = "reward_fns:always_right"
    summary = train.run(c, str(tmp_path))
    assert summary["status"] == "completed" and summary["steps"] == 0, summary
    assert "the task is solved after step 0" in summary["stopped_early"]
    assert "every sample of the last 6 groups got reward ≥ 1.0" in summary["stopped_early"]
    assert summary["eval_accuracy_end"] == 1.0 and (tmp_path / "model/config.json").is_file()
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def test_a_task_solved_on_most_groups_ends_the_run_without_waiting_for_a_starved_trainer(tmp_path):
    """Near 100% a run used to crawl (each kept group costs many samples): with rl.solved_window the task is
    solved once rl.solved_share of the last groups were all right, even though some groups still train."""
    c = small_config(1, steps=50)
    c.advantage.filter_uniform = True
    c.rl.update(max_filtered_in_a_row=0, solved_window=8, solved_share=0.75)
    c.rewards.fn = "reward_fns:always_right"
    summary = train.run(c, str(tmp_path))
    assert summary["status"] == "completed", summary
    assert "8 of the last 8 groups had every sample at reward ≥ 1.0" in summary["stopped_early"]


def test_generator_scores_like_the_trainer_after_a_sync():
    c = small_config(1)
    rules = normalize_rules(c.sharding_rules)
    meshes = role_meshes(c.mesh)
    assert not set(meshes["trainer"].devices.flat) & set(meshes["generator"].devices.flat)
    tokenizer, model = builders.build(parse(c), meshes["trainer"], rules)
    trainer = Trainer(model, parse(c).trainer, mesh=meshes["trainer"], rules=rules)
    gen_model = model.to_mesh(meshes["generator"], rules)
    shard = LogicalSharding(meshes["generator"], rules)
    prompt = format_prompt(tokenizer, "12+34=")
    rng = np.random.RandomState(0)
    trajs = [Trajectory.from_completion(prompt, rng.randint(3, 40, 8), rng.normal(-3, 0.1, 8), np.zeros(8),
                                        advantage=rng.normal()) for _ in range(8)]
    trainer.train_step(trajs)
    with Generator(Engine(gen_model, slots=4, max_len=32, shard=shard), gen_model.params) as generator:
        params = jax.device_put(trainer.params, tree_shardings(gen_model.params, shard), may_alias=False)
        generator.update_weights(params, trainer.version).result(timeout=60)
        out = generator.submit(prompt, SamplingParams(temperature=0.0, max_new_tokens=10)).result(timeout=60)[0]
    assert set(out.versions.tolist()) == {1}
    traj = Trajectory.from_completion(prompt, out.output_tokens, out.logprobs, out.versions)
    batch = trainer.pack([traj])[0]
    got = scored(np.asarray(trainer.logprobs(trainer.params, batch)[0]), batch.micro(0), len(traj))[len(prompt):]
    np.testing.assert_allclose(out.logprobs, got, atol=2e-5)


def test_stop_before_start_returns_the_accounting():
    """An error before the controller starts (e.g. in the first evaluation) must surface as itself: stop() in the
    cleanup may not raise on a thread that never started."""
    controller = RolloutController(None, None, None, iter([]), StalenessManager(4, 0, 4), SamplingParams(),
                                   AdvantageConfig())
    assert controller.stop() == {"submitted": 0, "trained": 0, "filtered": 0, "queued": 0, "in_flight": 0}


def test_a_batch_put_back_is_taken_again_and_kept_by_a_checkpoint():
    """Multi-host: when another process cannot train the step, this one puts its batch back; the same groups are
    the next batch, the counts are as before, and a checkpoint taken meanwhile re-issues them."""
    c = small_config(1)
    prompts = train_prompts(parse(c), CharTokenizer(c.tokenizer.alphabet))
    controller = RolloutController(None, None, None, prompts, StalenessManager(2, 1, 4), SamplingParams(n=2),
                                   AdvantageConfig())
    for _ in range(4):  # admitted and scored, rewards 0 and 1: every group is kept
        group = controller._admit()
        controller._on_scored(group, [Trajectory.from_completion([1, 2], [3], [-1.0], [0], reward=r) for r in (0, 1)])
    first = controller.get_batch(0, timeout=5)
    assert controller.stats.trained == 2 and controller.queue_depth() == 2
    controller.put_back(first)
    assert controller.stats.trained == 0 and controller.queue_depth() == 4
    state = controller.checkpoint_state()
    assert [p["id"] for p in state["pending"]] == [f"train-{i}" for i in range(4)]
    again = controller.get_batch(0, timeout=5)
    assert [g.seq for g in again] == [g.seq for g in first] == [0, 1]
    assert controller.stats.trained == controller.staleness.trained == 2


def test_stop_with_groups_in_flight_is_quiet_and_accounted(caplog):
    """Stopping while the generator still holds admitted groups (what train.run does at the end): the generator's
    close fails their futures, and their callbacks must not try the shut-down scorer (no logged errors)."""
    c = small_config(4)
    rules = normalize_rules(c.sharding_rules)
    meshes = role_meshes(c.mesh)
    tokenizer, model = builders.build(parse(c), meshes["generator"], rules)
    engine = Engine(model, slots=2, max_len=32, shard=LogicalSharding(meshes["generator"], rules))
    generator = Generator(engine, model.params)
    sampling = SamplingParams(max_new_tokens=20, n=2, stop_token_ids=tuple(tokenizer.eos_ids))
    with RewardService(c.rewards.fn, workers=1) as rewards:
        controller = RolloutController(generator, rewards, tokenizer, train_prompts(parse(c), tokenizer),
                                       StalenessManager(4, 4, 16), sampling, AdvantageConfig()).start()
        deadline = time.monotonic() + 60
        while controller.stats.submitted < 16:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        accounting = controller.stop()
        generator.close()
    assert accounting["in_flight"] > 0
    assert accounting["submitted"] == sum(accounting[k] for k in ("trained", "filtered", "queued", "in_flight"))
    time.sleep(0.5)  # let the failed futures' callbacks run
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


class Gated:
    """Single-turn episodes that finish only when the test opens their prompt's gate: the test decides the order
    in which groups complete (generation itself is real)."""

    def __init__(self, gates: dict[str, threading.Event]):
        self.gates = gates

    async def run(self, ep):
        c = await ep.generate(ep.prompt.tokens)
        await asyncio.to_thread(self.gates[ep.prompt.id].wait)
        turns = Turns(ep.prompt.tokens)
        turns.model(c)
        return turns.build(reward=float(ep.index))


def test_fast_late_groups_do_not_strand_slow_early_ones():
    """The issue's repro on the real controller, generator and weight swaps: B = 1, η = 2; p0, p1, p2 admitted at
    version 0, p2 trained at step 0; p3 (admitted at version 1) finishes before p0 and p1. The old rule trained p3
    at step 1 and then raised at step 2 (p0 and p1 both due, one slot); now step 1 waits for p0."""
    c = small_config(2)
    rules = normalize_rules(c.sharding_rules)
    meshes = role_meshes(c.mesh)
    tokenizer, model = builders.build(parse(c), meshes["generator"], rules)
    gates = {f"p{i}": threading.Event() for i in range(8)}
    prompts = iter([Prompt(pid, format_prompt(tokenizer, f"{i}+{i}="), {}) for i, pid in enumerate(gates)])
    generator = Generator(Engine(model, slots=4, max_len=32, shard=LogicalSharding(meshes["generator"], rules)),
                          model.params)
    controller = RolloutController(generator, None, tokenizer, prompts, StalenessManager(1, 2, 16),
                                   SamplingParams(max_new_tokens=4, n=1), AdvantageConfig(filter_uniform=False),
                                   workflow=Gated(gates)).start()
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def wait_until(condition) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def step(version: int, release: list[str], waits_for: str | None = None) -> str:
        """Opens `release` and waits until they are scored, asks for the batch of `version` and, if `waits_for`,
        checks that it only comes once that prompt's gate opens too; then swaps in the next version's weights.
        Returns the trained prompt's id."""
        queued = controller.queue_depth() + len(release)
        for pid in release:
            gates[pid].set()
        wait_until(lambda: controller.queue_depth() == queued)
        fut = pool.submit(controller.get_batch, version, 60)
        if waits_for:
            with pytest.raises(concurrent.futures.TimeoutError):
                fut.result(timeout=1.0)
            gates[waits_for].set()
        (group,) = fut.result(timeout=60)
        generator.update_weights(model.params, version + 1).add_done_callback(
            lambda f: controller.on_weights_applied(version + 1))
        return group.prompt.id

    try:
        assert step(0, ["p2"]) == "p2"
        wait_until(lambda: controller.stats.submitted == 4)  # p3 is admitted once the generator serves version 1
        assert step(1, ["p3"], waits_for="p0") == "p0"
        assert step(2, [], waits_for="p1") == "p1"
        assert step(3, []) == "p3"
    finally:
        for g in gates.values():
            g.set()
        controller.stop()
        generator.close()
        pool.shutdown()


def test_prompts_draw_independent_samples_and_a_reissued_prompt_the_same_ones():
    """Every prompt used to sample with the run's one seed, so sample j of every prompt drew the same uniforms at
    each position (a duplicate row or a later epoch got identical samples). With a zero model (uniform logits) a
    token is its uniform, so equal seeds show as identical tokens: now a duplicate under another id and the same
    prompt in its next epoch draw independently, and re-issuing a prompt (a resume) draws exactly the same."""
    c = small_config(0)
    rules = normalize_rules(c.sharding_rules)
    meshes = role_meshes(c.mesh)
    tokenizer, model = builders.build(parse(c), meshes["generator"], rules)
    zero = jax.tree.map(jax.numpy.zeros_like, model.params)
    tokens = format_prompt(tokenizer, "12+34=")
    batch = [Prompt("a", tokens, {}), Prompt("b", tokens, {}), Prompt("a", tokens, {}, epoch=1)]

    def run(prompts):
        gates = {"a": threading.Event(), "b": threading.Event()}
        for g in gates.values():
            g.set()
        with Generator(Engine(model, slots=8, max_len=32, shard=LogicalSharding(meshes["generator"], rules)),
                       zero) as generator:
            controller = RolloutController(generator, None, tokenizer, iter(prompts),
                                           StalenessManager(len(prompts), 0, 8),
                                           SamplingParams(max_new_tokens=20, n=2, seed=c.seed),
                                           AdvantageConfig(filter_uniform=False), workflow=Gated(gates)).start()
            try:
                groups = sorted(controller.get_batch(0, timeout=60), key=lambda g: g.seq)
            finally:
                controller.stop()
        return [np.concatenate([t.tokens[len(tokens):] for t in g.trajectories]) for g in groups]

    a, b, a_next_epoch = run(batch)
    (a_again,) = run(batch[:1])
    assert len(a) == len(b) == 40
    np.testing.assert_array_equal(a, a_again)
    for other in (b, a_next_epoch):
        assert (a != other).mean() > 0.8 and abs(np.corrcoef(a, other)[0, 1]) < 0.6


def test_an_episode_that_yields_several_trajectories_is_one_sample_of_its_group():
    """An agent episode returning two trajectories and a plain one beside it: the group holds all three, each
    tagged with its episode, so advantages count two samples (rl/advantages.py), not three."""
    c = small_config(1)
    prompts = train_prompts(parse(c), CharTokenizer(c.tokenizer.alphabet))
    controller = RolloutController(None, None, None, prompts, StalenessManager(2, 1, 4), SamplingParams(n=2),
                                   AdvantageConfig(filter_uniform=False))
    traj = lambda r: Trajectory.from_completion([1, 2], [3], [-1.0], [0], reward=r)  # noqa: E731
    for _ in range(2):  # a batch of two groups
        controller._on_scored(controller._admit(), [[traj(1.0), traj(1.0)], traj(0.0)])
    batch, _ = controller.get_batch(0, timeout=5)
    assert [t.info["episode"] for t in batch.trajectories] == [0, 0, 1]
    assign_advantages([batch.trajectories], AdvantageConfig())
    a, b, other = (t.advantage for t in batch.trajectories)
    assert a == b == -other and a > 0  # two samples, 1 and 0: ± the same


def test_episodes_are_counted_once_rejected_ones_are_not_right_and_a_checkpoint_does_not_count_twice():
    """An episode of two trajectories counts once in the rollout reward; a group whose survivors are all right but
    which lost an episode (rejected, or an empty list) is not 'every sample right'; a checkpoint's counters leave
    out the queued groups it will re-run on resume, so they are not counted twice."""
    c = small_config(1)
    prompts = train_prompts(parse(c), CharTokenizer(c.tokenizer.alphabet))
    controller = RolloutController(None, None, None, prompts, StalenessManager(2, 1, 4), SamplingParams(n=3),
                                   AdvantageConfig(filter_uniform=False), stopping=Stopping(solved_window=2))
    traj = lambda r: Trajectory.from_completion([1, 2], [3], [-1.0], [0], reward=r)  # noqa: E731
    controller._on_scored(controller._admit(), [[traj(1.0), traj(1.0)], traj(0.0), None])
    assert (controller.stats.scored_samples, controller.stats.reward_sum, controller.stats.rejected_episodes) == \
        (2, 1.0, 1)
    state = controller.checkpoint_state()["stats"]  # the group is queued: re-run after a resume
    assert (state["scored_samples"], state["reward_sum"], state["rejected_episodes"], state["generated_tokens"]) \
        == (0, 0.0, 0, 0)
    for lost in (None, []):
        controller._on_scored(controller._admit(), [traj(1.0), traj(1.0), lost])
    assert not any(controller.starvation._all_right)  # two episodes right, one lost: not solved
    assert len(controller.get_batch(0, timeout=5)) == 2
    assert controller.checkpoint_state()["stats"]["scored_samples"] == 4  # the two trained groups' episodes


def test_a_trajectory_longer_than_the_trainers_rows_fails_the_run_naming_the_workflow():
    """A custom workflow that appends past the context: the run stops at once with the workflow, the prompt and
    the limit, not later inside a training step."""
    c = small_config(1)
    prompts = train_prompts(parse(c), CharTokenizer(c.tokenizer.alphabet))
    controller = RolloutController(None, None, None, prompts, StalenessManager(1, 1, 4), SamplingParams(n=1),
                                   AdvantageConfig(filter_uniform=False), max_tokens=8)
    controller._on_scored(controller._admit(), [Trajectory.from_completion([1] * 6, [3] * 3, np.zeros(3),
                                                                           np.zeros(3))])
    with pytest.raises(RuntimeError, match=r"workflow RLVR returned a trajectory of 9 tokens for prompt 'train-0'.*"
                                           r"trainer\.max_tokens = 8"):
        controller.get_batch(0, timeout=5)


def test_a_workflow_is_closed_on_the_controllers_loop_when_it_stops():
    """A workflow's `close()` (OpenAIAgent's endpoint for command agents lives on the controller's loop) runs there
    when the controller stops."""
    class Closing:
        loop = None

        async def run(self, ep):
            return None

        async def close(self):
            Closing.loop = asyncio.get_running_loop()

    controller = RolloutController(None, None, None, iter([]), StalenessManager(4, 0, 4), SamplingParams(),
                                   AdvantageConfig(), workflow=Closing()).start()
    controller.stop()
    assert Closing.loop is controller._loop


def test_a_workflow_that_rejects_every_episode_stops_the_run_saying_so():
    """Groups dropped because every episode was rejected (an agent failing on every prompt) stop the run naming the
    rejections, not as uniformly low rewards."""
    c = small_config(1)
    prompts = train_prompts(parse(c), CharTokenizer(c.tokenizer.alphabet))
    controller = RolloutController(None, None, None, prompts, StalenessManager(2, 1, 8), SamplingParams(n=2),
                                   AdvantageConfig(), stopping=Stopping(max_filtered_in_a_row=3))
    for _ in range(3):
        controller._on_scored(controller._admit(), [None, None])
    with pytest.raises(RuntimeError, match="the workflow rejected every episode of the last 3 groups"):
        controller.get_batch(0, timeout=5)
