"""The benchmarks' arithmetic on run metrics: training wall-clock leaves evaluations out, time to a target and
accuracy at a budget read the right evaluation. And nothing rots: every script in benchmarks/ prints its description
with --help and runs end to end with --smoke (seconds), leaving its result but never touching benchmarks/results."""

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest
from conftest import results_digest, run_script

from benchmarks import cells
from benchmarks.cells import training_curve
from benchmarks.vs_tunix import accuracy_at, time_to

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")  # a new script is tested as it lands
                 if "__main__" in p.read_text())  # (not the modules scripts share: cells.py)
# --smoke run by a test of its own in another file, which reads its results too (a long smoke in a file of its own:
# `--dist loadfile` can give it to the other worker)
OWN_SMOKE_TEST = {"accelerator.py": "test_accelerator.py", "real_model.py": "test_real_model.py"}
# What each --smoke leaves: text on stdout, and files under its temporary directory (TMPDIR). A script not listed
# only has to exit 0 and print something.
SMOKE_RESULTS = {
    "agent.py": (["| in-process client |", "| arealjax.serve (HTTP) |", "| 4 | 8 |"],
                 [f"arealjax_agent_bench/smoke/agent.{x}" for x in ("json", "md")]),
    "async_vs_sync.py": (["| η (overrides) |", "\n| 1 |"], ["arealjax_async_vs_sync/smoke/results.json"]),
    "checkpoint.py": (["| local disk |", "| gs:// (local emulator) |", "| stream prompts"], []),
    "disaggregated.py": (["| synchronous colocated | ", "| disaggregated η = 1 | ", "speedup_eta4 = None"],
                         [f"arealjax_disaggregated/smoke/disaggregated.{x}" for x in ("json", "md", "png")]),
    "generator.py": (["| long-tail | 4 |", "| short | 4 |", "(f) decode step", "| keep, N=16 |"], []),
    "learning.py": (["| default | 2 |", "| carry written | sum after a carry |"],
                    [f"arealjax_learning/smoke/learning.{x}" for x in ("json", "md", "png")]),
    "lora.py": (["| LoRA r=2 |", "| LoRA r=2, on_the_fly |", "on the fly / merged:"], []),
    "memory.py": (["| tiny (", "| FSDP 4 × TP 2 |", "Generator (bf16", "| 1 |", "| LoRA r=4 |", "| tiny-moe (",
                   "| EP 8 |", "| FSDP 16 |", "| tiny-moe | 256 |"], []),
    "model.py": (["| decode 4 tokens", "| reshard", "| the same, cast to bf16"], []),
    "moe.py": (["| 64 | 32 | 16 | 8 | 2 |"], ["arealjax_moe/smoke/moe.json", "arealjax_moe/smoke/moe.md"]),
    "objectives.py": (["| synchronous | 0 |", "| m2po | 1 |"],
                      [f"arealjax_objectives/smoke/objectives.{x}" for x in ("json", "md", "png")]),
    "profile_table.py": (["## decode: wall", "## train: wall", "| calls | total ms | mean µs | share |"], []),
    "rewards.py": (["| math (math-verify) | 1 | 16 |", "| code ("], []),
    "staleness_ablation.py": (["| η = 0 |", "| η = 1 (keep) |"],
                              [f"arealjax_ablation/smoke/staleness_ablation.{x}" for x in ("json", "md", "png")]),
    "suite.py": (["| test_advantages.py | ", "passed; ", " cores ("], []),  # its row (any count of tests)
    "trainer.py": (['"packed_over_naive"'], []),
    "prefixes.py": (["| default | 8 (timed 8) | 32 |"], ["arealjax_prefixes/smoke/prefixes.json",
                                                           "arealjax_prefixes/smoke/prefixes.md"]),
    "tunix_grpo.py": ([], ["arealjax_tunix_grpo/smoke/rows.json"]),
    "weights.py": (["| default | 0.6M | float32 | 1 |", "Default job on 1 server(s)"], []),
    "wire.py": (["| reads | ", "| reads + never reads | "], []),
    "vs_tunix.py": (["| default (budget", "arealjax η = 4", "arealjax η = 0"],
                    [f"arealjax_vs_tunix/smoke/vs_tunix.{x}" for x in ("json", "md", "png")]),
}


def test_training_curve_leaves_every_evaluation_out():
    # wall_seconds is taken before a step's evaluation; the step-0 evaluation runs before the clock starts.
    rows = [{"step": 0, "eval_accuracy": 0.5, "eval_greedy_accuracy": 0.4, "eval_seconds": 3.0},
            {"step": 1, "wall_seconds": 2.0},
            {"step": 2, "wall_seconds": 4.0, "eval_accuracy": 0.6, "eval_greedy_accuracy": 0.5, "eval_seconds": 5.0},
            {"step": 3, "wall_seconds": 11.0},
            {"step": 4, "wall_seconds": 13.0, "eval_accuracy": 0.7, "eval_greedy_accuracy": 0.8, "eval_seconds": 1.0},
            {"step": 5, "wall_seconds": 16.0}]
    wall, curve = training_curve(rows)
    assert wall == {0: 0.0, 1: 2.0, 2: 4.0, 3: 6.0, 4: 8.0, 5: 10.0}
    assert curve == [[0, 0.0, 0.5, 0.4], [2, 4.0, 0.6, 0.5], [4, 8.0, 0.7, 0.8]]


def test_a_finished_cell_is_reused_only_under_its_settings_and_layouts_split_the_cores_given(tmp_path, monkeypatch):
    args = argparse.Namespace(config="configs/longtail.py", steps=30, warmup=3, eval_every=10, eval_problems=256,
                              overrides=[], work=str(tmp_path), warm_up=True)
    c = cells.cell("disaggregated", 4, "decoupled", "keep", 1)
    assert c["name"] == "dis_eta4_decoupled_keep_seed1" and cells.load(c, args) is None  # not run yet
    (tmp_path / c["name"]).mkdir()
    (tmp_path / c["name"] / "cell.json").write_text(json.dumps({"settings": {**cells.settings(args), "steps": 20}}))
    with pytest.raises(SystemExit, match=r"dis_eta4_decoupled_keep_seed1/cell\.json: run with .*'steps': 20"):
        cells.load(c, args)
    args.warm_up = False  # cells timed on a cold compilation cache are not those of a warm one
    (tmp_path / c["name"] / "cell.json").write_text(json.dumps({"settings": {**cells.settings(args), "warm_up": True}}))
    with pytest.raises(SystemExit, match=r"'warm_up': True"):
        cells.load(c, args)
    monkeypatch.setattr(cells, "cores", lambda: [4, 5, 6, 7, 8])  # under `taskset -c 4-8`
    flags = cells.disaggregated_flags()
    assert "--config.cpus=4-5" in flags and "--config.generator.servers.cpus=6-8" in flags


def test_warm_up_runs_each_kind_of_cell_once_at_its_largest_eta(monkeypatch, tmp_path):
    """One unreported cell per (layout, swap mode), the kind's largest η at its first seed, under its own name."""
    ran = []
    monkeypatch.setattr(cells, "run", lambda c, args: ran.append(c["name"]))
    todo = [cells.cell("colocated", 0, "decoupled", "recompute", s) for s in (0, 1)]
    todo += [cells.cell("disaggregated", e, o, m, s) for s in (1, 2) for m in ("recompute", "keep") for e in (1, 4, 2)
             for o in ("standard", "decoupled")]
    cells.warm_up(todo, argparse.Namespace(work=str(tmp_path)))
    assert ran == ["warm_eta0_decoupled_recompute_seed0", "warm_dis_eta4_standard_recompute_seed1",
                   "warm_dis_eta4_standard_keep_seed1"]


def test_disaggregated_grid_puts_standard_ppo_beside_decoupled_and_compares_both_to_the_baseline():
    """benchmarks/disaggregated.py --objectives: standard-PPO cells at each η > 0 (at η = 0 the objectives are one),
    their own rows, speedups and planner predictions, never mixed with decoupled's."""
    from benchmarks import disaggregated as dis

    args = argparse.Namespace(objectives=["decoupled", "standard"], modes=["recompute", "keep"], etas=[0, 4],
                              seeds=[0])
    assert [c["name"] for c in dis.grid(args)] == [
        "eta0_decoupled_recompute_seed0", "dis_eta4_decoupled_recompute_seed0", "dis_eta0_decoupled_recompute_seed0",
        "dis_eta4_decoupled_keep_seed0", "dis_eta4_standard_recompute_seed0", "dis_eta4_standard_keep_seed0"]

    def result(c, tps):
        return {**c, "commit": "x", "cores_busy": None, "trained_tokens_per_s": tps, "staleness_histogram": [1.0],
                **dict.fromkeys(["seconds_per_step", "generated_tokens_per_s", "generator_idle_share",
                                 "trainer_idle_share", "weight_push_share", "weight_transfer_share",
                                 "trainer_step_seconds", "staleness_mean", "accuracy_start", "accuracy_end",
                                 "greedy_end"], 1.0)}

    results = [result(c, tps) for c, tps in zip(dis.grid(args), [100, 150, 110, 160, 180, 190])]
    planner = [{"seed": 0, "eta": 4, "mode": "recompute", "objective": o, "predicted_seconds_per_step": x}
               for o, x in (("decoupled", 2.0), ("standard", 3.0))]
    rows = {w["label"]: w for w in dis.configurations(results, planner)}
    assert list(rows) == ["synchronous colocated", "disaggregated η = 0", "disaggregated η = 4",
                          "disaggregated η = 4 (keep)", "disaggregated η = 4, standard PPO",
                          "disaggregated η = 4 (keep), standard PPO"]
    assert rows["disaggregated η = 4"]["speedup"] == 1.5 and rows["disaggregated η = 4, standard PPO"]["speedup"] == 1.8
    assert rows["disaggregated η = 4"]["predicted_seconds_per_step"] == 2.0
    assert rows["disaggregated η = 4, standard PPO"]["predicted_seconds_per_step"] == 3.0


def test_time_to_target_and_accuracy_at_budget():
    curve = [[0, 0.0, 0.5], [10, 30.0, 0.7], [20, 60.0, 0.85], [30, 90.0, 0.79]]
    assert time_to(curve, 0.8) == 60.0
    assert time_to(curve, 0.5) == 0.0
    assert time_to(curve, 0.9) is None
    assert accuracy_at(curve, 59.9) == 0.7
    assert accuracy_at(curve, 60.0) == 0.85
    assert accuracy_at(curve, 1000.0) == 0.79
    assert accuracy_at(curve, 0.0) == 0.5


def test_hardware_flops_count_what_the_trainer_executes():
    """benchmarks/trainer.py: HFU's FLOPs for one trajectory of 200 prompt and 56 output tokens filling a row of 256,
    by hand: layers 3·2N per position, the head 3·2DV per slot it scores (the 56 loss positions' 128-slot bucket,
    where MFU counts every token), XLA attention (query blocks of 128 read every key up to their end, ×3); full
    remat adds a forward of the layers and of attention, save_dots of attention only (not of our GPU kernel, whose
    outputs it keeps); a π_prox pass (second minibatch) and a reference pass add forwards; chunked logits add the
    head's forward. And the pairs each attention kernel scores on a packed row."""
    import numpy as np

    from arealjax.models import ModelConfig
    from arealjax.rl.losses import PPOConfig
    from arealjax.rl.trainer import TrainerConfig
    from arealjax.rl.trajectory import Trajectory
    from benchmarks.trainer import attention_pairs, hardware_flops, layer_params, model_flops

    cfg = ModelConfig.make(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8)
    traj = Trajectory.from_completion(np.full(200, 5), np.full(56, 6), np.zeros(56), np.zeros(56))
    layers, head, pair = 2 * layer_params(cfg), 2 * 32 * 64, 4 * 2 * 4 * 8
    pairs = 128 * 128 + 128 * 256
    base = TrainerConfig(max_tokens=256, micro_rows=1, attention="xla", logits_chunk=0)
    hfu = lambda trajs=(traj,), **kw: hardware_flops(cfg, list(trajs), dataclasses.replace(base, **kw))  # noqa: E731
    assert hfu() == 3 * (256 * layers + 128 * head + pairs * pair)
    assert model_flops(cfg, [traj]) == 3 * (256 * layers + 56 * head) + 3 * 256 * 257 / 2 * pair  # the head: 56 scored
    assert hfu(remat="full") - hfu() == 256 * layers + pairs * pair
    assert hfu(remat="save_dots") - hfu() == pairs * pair
    assert hfu(remat="save_dots", attention="pallas") == hfu(attention="pallas")  # keeps the kernel's outputs
    # our kernels' backward is two kernels, each scoring the pairs again: dq 3 matmuls, dk/dv 4 (the forward's 2)
    blocks = 64 * 64 * (1 + 2 + 3 + 4)  # one segment of 256 tokens: every block to the diagonal
    assert hfu(attention="pallas") == 3 * (256 * layers + 128 * head) + (1 + 3.5) * blocks * pair
    one = attention_pairs(np.ones((1, 256), int), "sparse")  # sparse's one backward scores them once
    assert hfu(attention="sparse") == 3 * (256 * layers + 128 * head) + (1 + 2.5) * one * pair
    assert hfu(remat="save_dots", attention="pallas_mha") > hfu(attention="pallas_mha")  # JAX's: runs it again
    assert hfu(logits_chunk=100) == hfu() + 128 * head  # 128 slots in 2 chunks of 64, recomputed
    two = hfu((traj, traj), ppo_n_minibatches=2, ppo=PPOConfig(kl_coef=0.1))
    assert two == 2 * hfu() + 3 * (256 * layers + 128 * head + pairs * pair)  # π_prox once, the reference twice
    segments = np.array([[1] * 100 + [2] * 100 + [0] * 56])  # two segments and padding
    assert attention_pairs(segments, "flash") == 256 * 256 and attention_pairs(segments, "xla") == pairs
    assert attention_pairs(segments, "pallas") == 64 * (64 + 128 + 128 + 192)  # key blocks from 0, 0, 1, 1
    # MFU counts the tokens computed: two samples of one 200-token prompt, shared, lay positions 0-198 once and
    # each sample's 199-254 (its branch token and 55 more), each reading its path's keys
    sample = Trajectory.from_completion(np.full(200, 5), np.full(56, 7), np.zeros(56), np.zeros(56))
    keys = sum(range(1, 200)) + 2 * sum(range(200, 256))
    assert model_flops(cfg, [traj, sample], TrainerConfig(max_tokens=512, micro_rows=1)) == (
        3 * ((199 + 2 * 56) * layers + 2 * 56 * head) + 3 * keys * pair)
    assert model_flops(cfg, [traj, sample], TrainerConfig(max_tokens=512, micro_rows=1, share_prefixes=False)) == (
        model_flops(cfg, [traj, sample]))


def test_learning_report_compares_tags_over_seeds():
    """benchmarks/learning.py: mean ± sd over seeds per (tag, job, η), and each tag against the first one with the
    standard error of the difference (Welch), so a change in accuracy can be told from seed noise."""
    from benchmarks.learning import report

    def cell(tag, seed, end):
        return dict(tag=tag, job="default", eta=2, seed=seed, commit=tag, command="cmd", stopped_early="",
                    accuracy_start=0.5, accuracy_end=end, greedy_start=0.4, greedy_end=end, seconds_per_step=2.0,
                    grad_norm_mean=0.7)

    old, new = [0.9, 0.8, 0.7], [0.6, 0.7, 0.8]
    text = report([cell("old", i, x) for i, x in enumerate(old)] + [cell("new", i, x) for i, x in enumerate(new)])
    assert "| old (old) | default | 2 | 0.50 ± 0.00 → **0.80 ± 0.10** |" in text
    assert "0: 0.60, 1: 0.70, 2: 0.80" in text
    # difference −0.10, standard error sqrt(0.01/3 + 0.01/3) = 0.0816, t = −1.2: not separable from noise
    assert "| default | 2 | new − old | -0.10 | 0.08 | -1.2 |" in text

    # a run's numbers depend on the machine: tags measured on another kind of machine are compared among themselves
    other = [dict(cell(tag, i, x), machine="Intel Xeon") for tag, xs in (("old-here", new), ("new-here", old))
             for i, x in enumerate(xs)]
    text = report([cell("old", i, x) for i, x in enumerate(old)] + [cell("new", i, x) for i, x in enumerate(new)]
                  + other)
    assert "| default | 2 | new − old | -0.10 |" in text and "| default | 2 | new-here − old-here | +0.10 |" in text
    assert "| 3 | Intel Xeon |" in text and "| 3 | — |" in text and "− old | +" not in text

    # runs of another length are compared among themselves; another learning rate is what a tag varies
    short = [dict(cell(tag, i, x), command=f"cmd --config.rl.steps=10{extra}") for tag, xs, extra in
             (("short", old, ""), ("short-lr", new, " --config.trainer.optim.lr=1e-4")) for i, x in enumerate(xs)]
    text = report([cell("old", i, x) for i, x in enumerate(old)] + short)
    assert "| default | 2 | short − old |" not in text and "| default | 2 | short-lr − short | -0.10 |" in text

    # the addition task's warm starts: what each seed's SFT result knows of carrying, in a table of their own
    skills = dict(carry_written=0.45, sum_after_carry=0.8, result_after_trace=0.99)
    text = report([dict(cell("old", 0, 0.9), warm_start=skills), dict(cell("old", 1, 0.9), warm_start=skills)])
    assert "| old (old) | default | 2 | 0.45 ± 0.00 | 0.80 ± 0.00 | 0.99 ± 0.00 | 0: 0.800, 1: 0.800 |" in text


def test_no_script_hides_a_module_it_imports():
    """`python benchmarks/x.py` puts benchmarks/ first on sys.path: a script named as an installed module (tree.py
    and dm-tree, which tensorflow_datasets imports) would be imported in its place."""
    import importlib.machinery
    import sys

    elsewhere = [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT / "benchmarks")]
    shadowing = [s for s in SCRIPTS if importlib.machinery.PathFinder.find_spec(Path(s).stem, elsewhere)]
    assert not shadowing, f"benchmarks/{shadowing}: named as an installed module; rename it"


@pytest.mark.parametrize("script", sorted(OWN_SMOKE_TEST))
def test_a_script_left_out_of_the_smoke_runs_here_has_its_own(script):
    text = (ROOT / "tests" / OWN_SMOKE_TEST[script]).read_text()
    assert f'run_script("{script}", ["--smoke"' in text, f"{OWN_SMOKE_TEST[script]} runs no {script} --smoke"


@pytest.mark.parametrize("script,mode", [(s, "--help") for s in SCRIPTS] + [
    pytest.param(s, "--smoke", marks=pytest.mark.slow) for s in SCRIPTS if s not in OWN_SMOKE_TEST])
def test_benchmark_runs(script, mode, tmp_path):
    """`--help` prints the script's description; `--smoke` runs it end to end at tiny sizes in a subprocess, prints
    or writes its result (SMOKE_RESULTS) under a temporary directory, and leaves benchmarks/results as it was."""
    before = results_digest()
    stdout, wall = run_script(script, [mode], tmp_path, 60 if mode == "--help" else 600)
    if mode == "--help":
        assert "--smoke" in stdout, f"{script} has no --smoke"
        after_usage = stdout.split("\n\n", 1)[-1]
        description = re.split(r"^(?:options|optional arguments):$", after_usage, flags=re.M)[0]
        assert len(description.split()) > 10, f"{script} --help: no description of what it measures\n{stdout}"
        return
    print(f"{script} --smoke: {wall:.1f} s")
    assert stdout.strip(), f"{script} --smoke printed nothing"
    texts, files = SMOKE_RESULTS.get(script, ([], []))
    for text in texts:
        assert text in stdout, f"{script} --smoke: {text!r} not in its output\n{stdout[-3000:]}"
    for f in files:
        assert (tmp_path / f).is_file() and (tmp_path / f).stat().st_size, f"{script} --smoke wrote no {f}"
    assert results_digest() == before, f"{script} --smoke changed benchmarks/results"


def test_a_resumed_grid_does_not_warm_up_a_kind_again(tmp_path, monkeypatch):
    """--warm-up runs one throwaway cell per kind (layout × swap mode); resuming a grid whose work directory holds
    a finished warm cell of that kind (its programs in the compilation cache) runs none for it."""
    ran = []
    monkeypatch.setattr(cells, "run", lambda c, args: ran.append(c["name"]))
    todo = [cells.cell("disaggregated", 4, "m2po", "recompute", 2), cells.cell("colocated", 0, "decoupled",
                                                                                  "recompute", 2)]
    args = argparse.Namespace(work=str(tmp_path))
    cells.warm_up(todo, args)
    assert sorted(ran) == sorted(f"warm_{c['name']}" for c in todo)
    (tmp_path / "warm_dis_eta4_decoupled_recompute_seed0").mkdir()
    (tmp_path / "warm_dis_eta4_decoupled_recompute_seed0" / "cell.json").write_text(
        json.dumps({"layout": "disaggregated", "mode": "recompute"}))
    ran.clear()
    cells.warm_up(todo, args)
    assert ran == [f"warm_{todo[1]['name']}"]


def test_results_files_record_commands_anyone_can_rerun():
    """Every command a results file records runs from the repository on any machine: no path of the machine that
    measured it (work folders, worktrees, output folders); `portable` writes a worktree as its commit."""
    from benchmarks.cells import portable

    assert portable(["--etas=4", "--work=/tmp/w", "--results", "/tmp/r", "--checkout=" + str(ROOT), "--tag=x",
                     f"--out={ROOT / 'benchmarks/results/x'}"]) == [
        "--etas=4", f"--checkout=<worktree of {cells.commit().removesuffix('+dirty')}>", "--tag=x",
        "--out=benchmarks/results/x"]
    commands = [(f.name, m.group(0)) for f in sorted((ROOT / "benchmarks" / "results").glob("*.md"))
                for m in re.finditer(r"python benchmarks/[\w.]+\.py[^`\n]*", f.read_text())]
    assert commands
    for name, cmd in commands:
        assert not re.search(r"(^|[\s=])/(tmp|work|root|home)\b", cmd), f"{name}: {cmd}"


def test_a_checkout_whose_only_changes_are_results_is_clean(tmp_path, monkeypatch):
    """A grid adds to benchmarks/results as it goes: its next cells still name the clean commit (learning.py tagged
    its second job's cells '+dirty' after its first job wrote learning.md)."""
    import subprocess

    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "learning.md").write_text("old\n")
    (tmp_path / "main.py").write_text("print()\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (tmp_path / "benchmarks" / "results" / "learning.md").write_text("new\n")
    assert not cells.commit(tmp_path).endswith("+dirty")
    (tmp_path / "main.py").write_text("print(1)\n")
    assert cells.commit(tmp_path).endswith("+dirty")
    monkeypatch.setenv("AREALJAX_COMMIT", "abc1234")  # a copy whose git directory is not its tree's names it
    assert cells.commit(tmp_path) == "abc1234"


def test_generator_benchmark_admits_on_one_schedule_however_requests_arrive(monkeypatch):
    """run_arealjax queues a run's requests whole before the loop admits any: requests arriving slowly (here 2 ms
    apart) into a running loop were admitted as they came, a schedule (and compiled shapes) of their own per run."""
    import time

    import jax.numpy as jnp

    from arealjax.generation.engine import Engine
    from arealjax.generation.generator import Generator
    from arealjax.models import ModelConfig, from_config
    from benchmarks.generator import run_arealjax, workload

    cfg = ModelConfig.make(family="qwen3", vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1,
                           num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True,
                           max_position_embeddings=128)
    model = from_config(cfg, dtype=jnp.float32)
    submit, take, admitted = Generator.submit, Generator._take_admissions, []

    def slow_submit(self, *a, **kw):
        out = submit(self, *a, **kw)
        time.sleep(0.002)
        return out

    def recorded(self, free):
        out = take(self, free)
        if out:
            admitted.append(len(out))
        return out

    monkeypatch.setattr(Generator, "submit", slow_submit)
    monkeypatch.setattr(Generator, "_take_admissions", recorded)
    prompts, lens = workload(24, 0, (4, 16), 6, 1.0, 24, vocab=cfg.vocab_size)
    engine = Engine(model, slots=8, max_len=64, page_size=8)
    for static in (False, True):
        admitted.clear()
        run_arealjax(engine, model.params, prompts, lens, static, 4)
        assert admitted[0] == 8 and sum(admitted) == 24, (static, admitted)


def test_no_benchmark_runs_under_the_suites_settings():
    """A benchmark measures what a user runs: none imports tests/conftest.py, which sets the suite's fast-compile XLA
    flags (optimization level 0) and 8 fake devices for everything the process does after it. Shared test helpers
    they need live in modules that set nothing (tests/hf_models.py)."""
    import ast

    offenders = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}:{node.lineno}" for n in names if n and n.split(".")[0] == "conftest"]
    assert not offenders, f"benchmarks import the test suite's conftest.py: {offenders}"


def test_suite_keeps_every_tests_seconds_and_why_a_test_failed(tmp_path):
    """benchmarks/suite.py reads pytest's JUnit XML: each test's seconds, and a failed test's traceback tail (a
    crashed worker's line naming its test) into the results, so a failed suite says why."""
    from benchmarks.suite import per_test

    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_a" name="test_ok" time="1.5"/>'
        '<testcase classname="tests.test_a" name="test_bad" time="2">'
        '<failure message="assert 1 == 2">a traceback\nE   assert 1 == 2</failure></testcase>'
        '<testcase classname="tests.test_b" name="test_crash" time="0">'
        "<failure message=\"worker 'gw1' crashed while running 'tests/test_b.py::test_crash'\"/></testcase>"
        '<testcase classname="tests.test_b" name="test_skip" time="0"><skipped message="no"/></testcase>'
        "</testsuite></testsuites>")
    tests, outcomes = per_test(junit)
    assert outcomes == {"passed": 1, "failure": 2, "skipped": 1}
    assert [(t["file"], t["seconds"], "why" in t) for t in tests] == [
        ("test_a.py", 1.5, False), ("test_a.py", 2.0, True), ("test_b.py", 0.0, True), ("test_b.py", 0.0, False)]
    assert "E   assert 1 == 2" in tests[1]["why"] and "crashed while running 'tests/test_b.py" in tests[2]["why"]
