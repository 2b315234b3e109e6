"""The capacity planner's discrete-event model on cases with known answers, and its invariants under random
length distributions."""

import json

import numpy as np
import pytest

from arealjax import plan
from arealjax.plan import Costs, Workload, simulate

COSTS = Costs(decode_s=0.01, decode_row_s=0.001, prefill_token_s=0.0001, train_token_s=0.002, train_step_s=0.5,
              sync_s=0.2)


def fixed(eta: int, length: int = 50, **kw) -> Workload:
    return Workload(batch_size=4, group_size=2, eta=eta, slots=64, prompt_tokens=10, median_tokens=length, sigma=0.0,
                    max_new_tokens=1000, **{"steps": 8, "warmup": 2, **kw})


def test_synchronous_step_is_generation_then_training_then_sync_exactly():
    """η = 0, equal lengths, every row fits: one step = the 4 prompts' prefill (once per group) + L decode steps of
    8 rows + train + sync."""
    r = simulate(fixed(0), COSTS)
    rows, tokens = 4 * 2, 4 * 2 * (10 + 50)
    expected = (4 * 10 * 1e-4 + 50 * (0.01 + 0.001 * rows)) + (0.5 + 0.002 * tokens) + 0.2
    assert r.seconds_per_step == pytest.approx(expected, rel=1e-9)
    assert r.staleness_max == 0 and r.trainer_wait_seconds == pytest.approx(expected - 0.5 - 0.002 * tokens - 0.2)
    assert r.generator_idle_share == pytest.approx((0.5 + 0.002 * tokens + 0.2) / expected)


def test_a_trainer_that_shares_prefixes_computes_a_groups_prompt_once():
    """share_prefixes: the synchronous step trains each group's prompt once (4 groups × (10 + 2 × 50) tokens)."""
    flat, shared = simulate(fixed(0), COSTS), simulate(fixed(0, share_prefixes=True), COSTS)
    assert flat.seconds_per_step - shared.seconds_per_step == pytest.approx(0.002 * 4 * 10, rel=1e-9)


def test_async_step_is_bounded_by_the_slower_side():
    """With room to run ahead (η = 4) the step takes max(generation of a batch, train + sync): here the trainer is
    the slower side (generation of a batch ~0.6 s, train + sync 1.66 s) and the generator's idle share is large."""
    r = simulate(fixed(4), COSTS)
    train = 0.5 + 0.002 * 4 * 2 * 60 + 0.2
    assert r.seconds_per_step == pytest.approx(train, rel=1e-6)
    assert r.trainer_wait_seconds == pytest.approx(0.0, abs=1e-9)
    assert r.staleness_max >= 1


def test_shared_compute_slows_both_sides_while_they_overlap():
    alone = simulate(fixed(4), COSTS)
    shared = simulate(fixed(4), Costs(**{**COSTS.__dict__, "shared": 2.0}))
    assert shared.seconds_per_step > alone.seconds_per_step * 1.05


@pytest.mark.parametrize("seed", range(6))
def test_staleness_never_exceeds_eta_and_asynchrony_pays_on_heavy_tails(seed):
    """Random lognormal lengths (p99 ≫ p50), few slots so groups wait: every trained group is at most η versions old
    (the real batch rule, arealjax/staleness.py), and η = 4 is faster per step than η = 0."""
    rng = np.random.default_rng(seed)
    costs = Costs(decode_s=0.005, decode_row_s=float(rng.uniform(1e-4, 1e-3)), prefill_token_s=1e-5,
                  train_token_s=float(rng.uniform(1e-5, 1e-4)), train_step_s=0.1, sync_s=0.05,
                  shared=float(rng.choice([1.0, 1.5])))
    runs = {}
    for eta in (0, 1, 2, 4):
        w = Workload(batch_size=8, group_size=4, eta=eta, slots=int(rng.integers(16, 64)), prompt_tokens=20,
                     median_tokens=40, sigma=1.2, max_new_tokens=1000, steps=14, warmup=3,
                     mode=str(rng.choice(["recompute", "keep"])))
        runs[eta] = simulate(w, costs, seed=seed)
        assert runs[eta].staleness_max <= eta
    assert runs[4].seconds_per_step < runs[0].seconds_per_step
    assert runs[0].staleness_max == 0


def test_recompute_swaps_cost_prefill_that_keep_swaps_do_not():
    w = fixed(2, length=200, steps=10)
    slow_prefill = Costs(**{**COSTS.__dict__, "prefill_token_s": 0.01, "train_token_s": 1e-4})
    keep = simulate(Workload(**{**w.__dict__, "mode": "keep"}), slow_prefill)
    recompute = simulate(w, slow_prefill)
    assert recompute.seconds_per_step > keep.seconds_per_step


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError, match="mode"):
        simulate(fixed(0, mode="drop"), COSTS)
    with pytest.raises(ValueError, match="warmup"):
        simulate(fixed(0, warmup=8), COSTS)


def test_paper_preset_plans_a_split_and_async_beats_sync():
    out = plan.plan("paper-1.5b", devices=32, etas=[4], steps=5)
    (row,) = out["async"]
    assert row["trainer_devices"] + row["generator_devices"] == 32
    assert row["seconds_per_step"] < out["sync"]["seconds_per_step"] and row["staleness_max"] <= 4


def test_calibration_recovers_the_costs_of_a_synchronous_run(tmp_path):
    """A run's metrics built from known costs (with a little noise): the fit finds them, the measured s/step leaves
    the held-out evaluation out, and a run at η > 0 is refused as a calibration source."""
    rng = np.random.default_rng(0)
    truth = dict(decode_s=0.004, decode_row_s=2e-4, prefill_token_s=3e-5, train_token_s=1e-4, train_step_s=0.3)
    rows = []
    for step in range(1, 31):
        steps, gen, pre = rng.integers(40, 300), rng.integers(500, 4000), rng.integers(200, 900)
        tokens = gen + 16 * 20
        rows.append({"step": step, "step_seconds": truth["train_step_s"] + truth["train_token_s"] * tokens,
                     "tokens": int(tokens), "trained_tokens": int(gen), "sequences": 16, "decode_steps": int(steps),
                     "generated_tokens": int(gen), "prefill_tokens": int(pre), "refill_tokens": 0,
                     "generator_busy_seconds": (truth["decode_s"] * steps + truth["decode_row_s"] * gen +
                                                truth["prefill_token_s"] * pre) * rng.normal(1, 0.001),
                     "generator_idle_seconds": 0.5, "weight_sync_seconds": 0.01, "filtered_groups": step,
                     "wall_seconds": 2.0 * step + 3.0 * (step > 10), "staleness_max": 0})
        if step == 10:  # a held-out evaluation of 3 s after step 10: not training time
            rows.append({"step": step, "eval_accuracy": 0.5, "eval_seconds": 3.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"rl": {"max_staleness": 0, "batch_size": 4, "group_size": 4, "max_new_tokens": 64,
                     "max_concurrent": 64}, "generator": {"slots": 32, "mode": "recompute"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval/0.jsonl").write_text(json.dumps({"lengths": [10, 20, 30]}) + "\n")
    costs, facts = plan.calibrate([tmp_path])
    for k, v in truth.items():
        assert getattr(costs, k) == pytest.approx(v, rel=0.1), k
    assert facts["prompt_tokens"] == pytest.approx(20) and facts["sample"] == (10, 20, 30)
    shared = [{**r, "tokens": r["tokens"] - 12 * 20, "shared_fraction": 12 * 20 / r["tokens"]} if "tokens" in r
              else r for r in rows]  # the same steps, each group's prompt computed once
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shared))
    assert plan.calibrate([tmp_path])[1]["prompt_tokens"] == pytest.approx(20)  # tokens represented, not computed
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert facts["filtered"] == pytest.approx(30 / (30 + 30 * 4))
    assert plan.measured(tmp_path)["seconds_per_step"] == pytest.approx(2.0)
    config["rl"]["max_staleness"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="synchronous run"):
        plan.calibrate([tmp_path])
