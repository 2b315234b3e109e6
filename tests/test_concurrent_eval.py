"""Evaluation that does not stall training (`eval.concurrent`, arealjax/concurrent_eval.py): each evaluation is of
the weights of its step exactly — what the trainer waiting for it measures — while training goes on unchanged."""

import json
import subprocess
import sys
from pathlib import Path

from arealjax.runtime import child_env

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--config=configs/default.py", "--config.sft.steps=0", "--config.rl.steps=3", "--config.rl.eval_every=1",
       "--config.rl.max_staleness=0", "--config.eval.num_problems=8", "--config.eval.n=2", "--config.eval.k=(1,2)",
       "--config.advantage.filter_uniform=False", "--config.model.num_layers=1", "--config.model.hidden_size=32",
       "--config.model.intermediate_size=64", "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
       "--config.model.head_dim=16", "--config.rl.batch_size=2", "--config.rl.group_size=2",
       "--config.generator.slots=8", "--config.rewards.workers=1", "--config.curves=True"]


def rows(workdir: Path, *args: str) -> list[dict]:
    out = subprocess.run([sys.executable, "main.py", *RUN, f"--workdir={workdir}", *args], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_a_concurrent_evaluation_measures_its_steps_weights_and_training_is_unchanged(tmp_path):
    """Synchronous RL (η = 0, every draw keyed by seed and position), evaluated after every step: waiting for each
    evaluation and evaluating concurrently give the same training rows and, for each step's weights, the same
    held-out results; each concurrent result names the step and version it evaluated, the last one is in the last
    row, and the per-problem files are the same."""
    blocking = rows(tmp_path / "blocking")
    concurrent = rows(tmp_path / "concurrent", "--config.eval.concurrent=True")
    train = lambda rs: [(r["step"], r["loss"], r["rollout_reward"]) for r in rs if "loss" in r]  # noqa: E731
    assert train(concurrent) == train(blocking) and len(train(blocking)) == 3
    evals = lambda rs: {int(r.get("eval_step", r["step"])): r for r in rs if "eval_accuracy" in r}  # noqa: E731
    b, c = evals(blocking), evals(concurrent)
    assert sorted(b) == sorted(c) == [0, 1, 2, 3]
    for step in b:
        assert {k: v for k, v in c[step].items() if k.startswith("eval_") and "seconds" not in k} == {
            k: v for k, v in b[step].items() if k.startswith("eval_") and "seconds" not in k}, step
        if step:
            assert c[step]["eval_version"] == step  # synchronous: step k's weights are version k
            assert (tmp_path / "concurrent/eval" / f"{step}.jsonl").read_text() == (
                tmp_path / "blocking/eval" / f"{step}.jsonl").read_text()
    assert concurrent[-1]["step"] == 3 and concurrent[-1]["eval_step"] == 3
    assert all(r["step"] >= r["eval_step"] for r in concurrent if "eval_step" in r)
    summary = json.loads((tmp_path / "concurrent/summary.json").read_text())
    assert summary["eval_accuracy_end"] == b[3]["eval_accuracy"] and (tmp_path / "concurrent/curves.png").is_file()
