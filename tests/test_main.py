"""main.py as a user runs it: the default job (shortened), then RL from the exported model through
--config.model_path."""

import json
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_serve import serve_command

from arealjax.runtime import child_env

ROOT = Path(__file__).resolve().parents[1]


def run_main(*args: str) -> subprocess.CompletedProcess:
    env = child_env()  # main.py sets its own device count
    return subprocess.run([sys.executable, "main.py", "--config=configs/default.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


SMALL = ["--config.sft.steps=10", "--config.sft.optim.warmup_steps=2", "--config.rl.steps=3",
         "--config.rl.eval_every=0", "--config.eval.num_problems=8", "--config.advantage.filter_uniform=False",
         "--config.model.num_layers=1", "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
         "--config.model.num_heads=2", "--config.model.num_kv_heads=1", "--config.model.head_dim=16",
         "--config.generator.slots=32"]


def wandb_records(path: Path) -> list:
    """The records of an offline W&B run file (LevelDB log blocks of protobuf `Record`s, wandb's own format)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, out, part = path.read_bytes(), 7, [], b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == kind == 0:
            break
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            out.append(pb.Record.FromString(part))
            part = b""
    return out


def log_lines_inside_bars(stderr: str) -> list[str]:
    """Log records (absl's form: 'I1126 10:26:59…') that do not start their line: written after a progress bar's
    text, which ends with a carriage return, not a newline."""
    return [seg for line in stderr.split("\n") for seg in line.split("\r")
            if re.search(r".[IWE]\d{4} \d\d:\d\d:\d\d", seg)]


@pytest.mark.slow
def test_default_job_then_reload_exported_model(tmp_path):
    first = run_main(f"--workdir={tmp_path / 'a'}", *SMALL, "--config.checkpoint.every_steps=1",
                     "--config.wandb.project=arealjax-test", "--config.wandb.mode=offline")
    assert first.returncode == 0, first.stderr[-3000:]
    # a checkpoint's log line at every step, each above the RL bar, never inside it
    assert first.stderr.count("checkpoint ") >= 3 and not log_lines_inside_bars(first.stderr), first.stderr[-3000:]
    # Weights & Biases (offline): the run config, every step's metrics as metrics.jsonl has them, the curves
    run_file, = (tmp_path / "a/wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.stem == "run-" + (tmp_path / "a/wandb_run_id").read_text().strip()
    logged = wandb_records(run_file)
    run_config = {u.key: json.loads(u.value_json) for r in logged if r.WhichOneof("record_type") == "run"
                  for u in r.run.config.update}
    assert run_config["trainer"]["optim"]["lr"] == 5e-4 and run_config["rl"]["steps"] == 3
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in logged
               if r.WhichOneof("record_type") == "history"]
    jsonl = [json.loads(x) for x in (tmp_path / "a/metrics.jsonl").read_text().splitlines()]
    for row in jsonl:
        got = {k: v for h in history if h.get("_step") == row["step"] for k, v in h.items()}
        assert all(got[k] == pytest.approx(v) for k, v in row.items() if k != "step" and math.isfinite(v)), row
    assert any(h.get("curves/_type") == "image-file" for h in history)
    summary = json.loads((tmp_path / "a/summary.json").read_text())
    assert summary["steps"] == 3 and summary["prompts"]["trained"] == 3 * 16
    assert (tmp_path / "a/sft/sft_config.json").is_file() and (tmp_path / "a/curves.png").is_file()

    # The exported directory is a HF checkpoint + tokenizer: RL from it, colocated on one device. Without the greedy
    # evaluation (eval.greedy=False used to end the run with "error: eval_greedy_accuracy" after its first
    # evaluation). A rerun reusing the SFT cache: tests/test_distributed.py (every run there reuses one).
    second = run_main(f"--workdir={tmp_path / 'b'}", f"--config.model_path={tmp_path / 'a/model'}", *SMALL,
                      "--config.sft.steps=0", "--config.mesh.trainer.devices=1", "--config.mesh.generator.devices=0",
                      "--config.eval.greedy=False", "--config.curves=False")
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads((tmp_path / "b/summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["eval_greedy_accuracy_end"] is None
    assert not (tmp_path / "b/curves.png").exists()  # curves = False
    assert 0 <= summary["eval_accuracy_end"] <= 1


def test_bad_mesh_config_is_a_clear_error(tmp_path):
    res = run_main(f"--workdir={tmp_path}", "--config.mesh.trainer.devices=3", "--config.mesh.generator.devices=3")
    assert res.returncode != 0
    assert "device counts [3, 3] do not fit in 4 devices" in res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["math+moe", "code+lora"])
def test_recipe_tiny_trains_through_main_then_evaluates(tmp_path_factory, tiny_recipes, recipe):
    """Each recipe's tiny variant (a random checkpoint of the recipe's family with a BPE tokenizer and chat
    template, a dataset in the real layout; code: an SFT stage on conversations first) trains through main.py, and
    the evaluation command scores the run's latest checkpoint. The math run is the mixture of experts
    (:model=tiny-moe: the generator's routes replayed by the trainer, which reports the routers' disagreement); the
    code run trains LoRA adapters after its (full) SFT stage: the weight sync moves the adapters only, the run
    exports them in PEFT's format, and the evaluation restores them onto the SFT result."""
    root = tiny_recipes
    name = recipe.split("+")[0]
    # the recipe finds the tiny build where the fixture made it by its ckpt= and tfds= arguments
    arg = {"math": "model=tiny-moe", "code": "model=tiny"}[name] + f",ckpt={root},tfds={root / 'tfds'}"
    paths = ["--config.curves=False"]  # the default job's test checks them
    if recipe == "code+lora":
        paths += ["--config.lora.rank=4", "--config.lora.export=adapters", "--config.lora.generator=on_the_fly"]
    workdir = tmp_path_factory.mktemp(name)
    env = child_env()
    run = subprocess.run([sys.executable, "main.py", f"--config=configs/{name}.py:{arg}", f"--workdir={workdir}",
                          *paths], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "evaluate (step 0):" in run.stderr and "evaluate (step 3):" in run.stderr  # the evaluations' bars
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert "eval_pass_at_4" in rows[-1] and "eval_pass_at_4" in rows[0]
    assert all(("router_disagreement" in r) == (name == "math") for r in rows if "loss" in r)
    if recipe == "code+lora":
        assert (workdir / "sft" / "sft_config.json").is_file()  # the SFT stage ran on the conversations
        config = json.loads((workdir / "model" / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["peft_type"] == "LORA"
        full_bytes = sum(f.stat().st_size for f in (workdir / "sft").glob("*.safetensors"))
        assert 0 < rows[-1]["weight_sync_bytes"] < full_bytes / 10  # adapters only (fp32 both)

    out = workdir / "evaluation"
    ev = subprocess.run([sys.executable, "-m", "arealjax.evaluate", f"--config=configs/{name}.py:{arg}",
                         f"--workdir={workdir}", f"--out={out}", *paths], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "evaluate:" in ev.stderr and "sample/s" in ev.stderr  # its progress bar
    result = json.loads((out / "summary.json").read_text())
    assert result["problems"] == 8 and result["samples_per_problem"] == 4
    assert {"pass@1", "pass@2", "pass@4", "eval_greedy_accuracy"} <= set(result)
    assert ("maj@4" in result) == (name == "math") and "| pass@4 |" in ev.stdout
    problems = [json.loads(x) for x in (out / "problems.jsonl").read_text().splitlines()]
    assert len(problems) == 8 and all(len(p["completions"]) == 4 for p in problems)
    if recipe == "code+lora":  # served as it trained: the SFT base with the adapters on the fly; the PEFT export
        # alone is refused, naming what to serve instead
        serve_command([f"--config=configs/{name}.py:{arg}", f"--workdir={workdir}", *paths], env, workdir.name)
        peft = subprocess.run([sys.executable, "-m", "arealjax.serve", f"--model={workdir / 'model'}"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=60)
        assert peft.returncode == 2 and "LoRA adapters only" in peft.stderr, peft.stderr


def test_rl_loop_keeps_one_copy_of_the_weights_on_the_trainer(tmp_path):
    """Once the trainer is built the loaded model is dropped: the trainer's devices hold the trained params and
    their two Adam moments, not a fourth, unused copy of every weight (0.5 GB for SmolLM2-135M, 16 GB for an 8B
    model in bf16)."""
    import contextlib

    import jax

    from arealjax import train
    from arealjax.config import parse
    from arealjax.distributed import Processes
    from arealjax.runtime import Stop
    from configs import default

    config = default.get_config()
    config.sft.steps, config.rl.steps, config.model.hidden_size = 0, 1, 48  # a width no other array has
    config = parse(config)
    stop = Stop()
    with contextlib.ExitStack() as stack:
        processes = Processes(stop)
        start = train.Start.of(config, tmp_path, stop, stack, processes)
        loop = train.RLLoop(config, tmp_path, stop, stack, {}, processes, start)
        trainer_devices = set(loop.trainer.params["embed_tokens"].get_value().devices())
        shape = loop.trainer.params["embed_tokens"].get_value().shape
        copies = [x for x in jax.live_arrays() if x.shape == shape and set(x.devices()) <= trainer_devices]
        assert len(copies) == 3, [x.dtype for x in copies]  # params, Adam's mu and nu
