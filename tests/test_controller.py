"""The async RL loop end to end on 8 fake CPU devices (trainer and generator on disjoint pairs): staleness never
exceeds η on any trained batch, η = 0 is synchronous, every prompt is accounted for, and after a weight sync the
generator scores tokens exactly as the trainer does."""

import json
import logging
import time

import jax
import numpy as np
import pytest

from arealjax import train
from arealjax.data.pipeline import format_prompt
from arealjax.controller import RolloutController
from arealjax.rewards.service import RewardService
from arealjax.rl.advantages import AdvantageConfig
from arealjax.staleness import StalenessManager
from arealjax.generation import Engine, Generator, SamplingParams
from arealjax.rl.trainer import Trainer
from arealjax.rl.trajectory import Trajectory
from arealjax.sharding import LogicalSharding, normalize_rules, role_meshes, tree_shardings
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


def test_starved_trainer_stops_with_a_clear_error(tmp_path):
    """A random model scores 0 on every sample, so dynamic filtering drops every group: the run must stop with an
    error that says so (and shut its threads and workers down) instead of waiting forever for a batch."""
    c = small_config(1)
    c.advantage.filter_uniform = True
    c.rl.max_filtered_in_a_row = 6
    with pytest.raises(RuntimeError, match=r"dynamic filtering dropped 6 groups in a row .*mean of those rewards "
                                           r"0\.000.*advantage\.filter_uniform=False"):
        train.run(c, str(tmp_path))


def test_generator_scores_like_the_trainer_after_a_sync():
    c = small_config(1)
    rules = normalize_rules(c.sharding_rules)
    meshes = role_meshes(c.mesh)
    assert not set(meshes["trainer"].devices.flat) & set(meshes["generator"].devices.flat)
    tokenizer, model = train.build(c, meshes["trainer"], rules)
    trainer = Trainer(model, train.trainer_config(c.trainer), mesh=meshes["trainer"], rules=rules)
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
    logp = np.asarray(trainer.logprobs(trainer.params, batch)[0])
    row, cols = np.nonzero(batch.segment_ids[0] == 1)
    got = logp[row[0], cols[len(prompt) - 1:-1]]
    np.testing.assert_allclose(out.logprobs, got, atol=2e-5)


def test_stop_before_start_returns_the_accounting():
    """An error before the controller starts (e.g. in the first evaluation) must surface as itself: stop() in the
    cleanup may not raise on a thread that never started."""
    controller = RolloutController(None, None, None, iter([]), StalenessManager(4, 0, 4), SamplingParams(),
                                   AdvantageConfig())
    assert controller.stop() == {"submitted": 0, "trained": 0, "filtered": 0, "queued": 0, "in_flight": 0}


def test_stop_with_groups_in_flight_is_quiet_and_accounted(caplog):
    """Stopping while the generator still holds admitted groups (what train.run does at the end): the generator's
    close fails their futures, and their callbacks must not try the shut-down scorer (no logged errors)."""
    c = small_config(4)
    rules = normalize_rules(c.sharding_rules)
    meshes = role_meshes(c.mesh)
    tokenizer, model = train.build(c, meshes["generator"], rules)
    engine = Engine(model, slots=2, max_len=32, shard=LogicalSharding(meshes["generator"], rules))
    generator = Generator(engine, model.params)
    sampling = SamplingParams(max_new_tokens=20, n=2, stop_token_ids=tuple(tokenizer.eos_ids))
    with RewardService(c.rewards.fn, workers=1) as rewards:
        controller = RolloutController(generator, rewards, tokenizer, train.train_prompts(c, tokenizer),
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
