"""The trainer's speed/memory knobs leave a whole run unchanged, not only each op: the default job's code path
(`train.run`, what main.py calls: SFT warm start, then synchronous RL with evaluations), run twice from the same
seeds — every knob on (layers under lax.scan, chunked-vocabulary logprobs, the block-sparse attention `auto` picks on
CPU with its custom VJP, full remat, shared prefixes packed as a tree) and every knob off (unrolled layers, whole
logits, XLA einsum attention, no remat, trajectories packed whole); LoRA off in both. The optimizer must not amplify
the knobs' float noise into different params, different sampled tokens or different metrics: after SFT and after
RL the params agree to a few ULPs, the runs train the same prompts and their evaluations generate the same
completions token for token. (The pure-JAX flash attention and the Pallas kernels are held to the XLA attention,
values and gradients, over trees and packed rows, in tests/test_models.py and tests/test_tpu.py.)"""

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from arealjax import train
from arealjax.models import attention
from arealjax.rl import trainer
from configs.default import get_config

ON = dict(scan_layers=True, logits_chunk=48, attention="sparse", remat="full",  # 48: 3 chunks of 128, one padded
          share_prefixes=True)
OFF = dict(scan_layers=False, logits_chunk=0, attention="xla", remat="none", share_prefixes=False)
RL_STEPS = 3
# Measured |on − off|: 1.2e-7 after SFT (1 ULP of the ~1.0 norm scales), 2–4e-7 after RL (Adam turns gradient noise
# on near-zero gradients into update noise, up to lr / eps = 50× it). Each param tensor moves ≥ 1.1e-3 during RL, and
# a knob broken by 0.1% (the sparse attention's dk × 1.001) puts the runs 4e-5 apart already after SFT.
PARAM_ATOL = 5e-6
# Metrics that depend on the params and the sampled tokens only (not on timing or on thread interleaving).
EXACT = ("reward", "accuracy", "reward_mean", "reward_std", "trained_tokens", "sequences",
         "skipped_steps", "lr", "version", "eval_accuracy", "eval_greedy_accuracy", "eval_length_max")
CLOSE = ("loss", "grad_norm", "entropy", "approx_kl", "kl_behaviour_prox", "clip_fraction", "masked_fraction",
         "behaviour_weight_mean", "advantage_abs_mean")


def small_config(knobs: dict, sft_dir: Path):
    c = get_config()
    c.model.update(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)
    c.sft.update(steps=40, batch_size=32, micro_rows=8,  # 32 samples fill ~5 rows of 128 tokens
                 cache_dir=str(sft_dir))  # a cache per run: never reuse the other's SFT
    c.sft.optim.warmup_steps = 2
    c.rl.update(steps=RL_STEPS, batch_size=8, group_size=4, max_staleness=0, max_new_tokens=24, eval_every=0,
                temperature=0.7)  # ≠ 1: the logprobs' temperature is part of what must agree
    c.advantage.filter_uniform = False  # every group trains
    c.rewards.update(fn="reward_fns:digits", workers=1)  # dense: groups differ in reward after a short SFT
    c.trainer.optim.warmup_steps = 0  # the RL steps move the params at the full learning rate
    c.trainer.update(**knobs)
    c.generator.update(slots=32, max_prefill_batch=16)
    c.eval.num_problems = 8
    return c


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def run_all(tmp_path: Path) -> tuple[Path, Path, list]:
    """Runs every knob on, then off; returns their workdirs and (objective, knobs) of every Trainer each run
    built."""
    built = []
    make_steps = trainer.make_steps

    def recording(graphdef, params, cfg, *args, **kwargs):
        built[-1].append((cfg.ppo.objective, {k: getattr(cfg, k) for k in ON}))
        return make_steps(graphdef, params, cfg, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "make_steps", recording)
        # Blocks of 16 tokens: a 128-token row spans 8, so the blocks skipped above the diagonal and across
        # segments, and the blocked backward, all run.
        mp.setattr(attention, "attend_sparse", functools.partial(attention.attend_sparse, block=16))
        for name, knobs in (("on", ON), ("off", OFF)):
            built.append([])
            train.run(small_config(knobs, tmp_path / name / "sft"), str(tmp_path / name))
    return tmp_path / "on", tmp_path / "off", built


@pytest.mark.slow
def test_knobs_leave_a_whole_run_unchanged(tmp_path):
    on, off, built = run_all(tmp_path)
    # The knobs reached both trainers of each run: the SFT warm start's and the RL one's.
    assert built == [[("sft", ON), ("standard", ON)], [("sft", OFF), ("standard", OFF)]]
    assert_same_run(on, off)


def assert_same_run(on: Path, off: Path) -> None:
    sft = [load_file(d / "sft" / "model.safetensors") for d in (on, off)]
    final = [load_file(d / "model" / "model.safetensors") for d in (on, off)]
    sft_diff, final_diff = max_diff(*sft), max_diff(*final)
    assert sft_diff < PARAM_ATOL and final_diff < PARAM_ATOL, (sft_diff, final_diff)
    moved = min(float(np.max(np.abs(final[1][k] - sft[1][k]))) for k in final[1])
    assert moved > 100 * PARAM_ATOL  # not vacuous: RL moved every param tensor far beyond the tolerance

    assert rows(on / "trained_prompts.jsonl") == rows(off / "trained_prompts.jsonl")
    m_on, m_off = rows(on / "metrics.jsonl"), rows(off / "metrics.jsonl")
    assert [r["step"] for r in m_on] == [r["step"] for r in m_off] == list(range(RL_STEPS + 1))
    assert 0 < m_off[1]["reward_std"] and 0 < m_off[1]["grad_norm"]  # the RL steps had a signal to follow
    shared = [r["tokens"] < 0.9 * r_off["tokens"] for r, r_off in zip(m_on, m_off) if r.get("shared_fraction")]
    assert len(shared) >= RL_STEPS and all(shared)  # the same RL steps from fewer tokens computed
    for a, b in zip(m_on, m_off):
        for k in EXACT:
            assert a.get(k) == b.get(k), (a["step"], k, a.get(k), b.get(k))
        for k in CLOSE:  # measured: ≤ 2e-6 relative (grad_norm), ≤ 3e-8 absolute (losses, KLs near 0)
            assert (k in a) == (k in b), (a["step"], k)
            assert k not in a or a[k] == pytest.approx(b[k], rel=2e-5, abs=1e-6), (a["step"], k, a[k], b[k])
    for step in (0, RL_STEPS):  # after SFT and after RL: the same sampled and greedy completions, token for token
        texts = [[{k: v for k, v in r.items() if "seconds" not in k} for r in rows(d / "eval" / f"{step}.jsonl")]
                 for d in (on, off)]
        assert texts[0] == texts[1] and texts[0]
