"""main.py as a user runs it: the default job (shortened), a rerun reusing its warm start, then RL from the
exported model through --config.model_path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_main(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # main.py sets its own device count
    return subprocess.run([sys.executable, "main.py", "--config=configs/default.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


SMALL = ["--config.sft.steps=10", "--config.sft.optim.warmup_steps=2", "--config.rl.steps=3",
         "--config.rl.eval_every=0", "--config.eval.num_problems=8", "--config.advantage.filter_uniform=False",
         "--config.model.num_layers=1", "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
         "--config.model.num_heads=2", "--config.model.num_kv_heads=1", "--config.model.head_dim=16",
         "--config.generator.slots=32"]


@pytest.mark.slow
def test_default_job_then_reload_exported_model(tmp_path):
    first = run_main(f"--workdir={tmp_path / 'a'}", *SMALL)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((tmp_path / "a/summary.json").read_text())
    assert summary["steps"] == 3 and summary["prompts"]["trained"] == 3 * 16
    assert (tmp_path / "a/sft/sft_config.json").is_file() and (tmp_path / "a/curves.png").is_file()

    # Another run with the same SFT cache: the warm start is reused, not redone.
    again = run_main(f"--workdir={tmp_path / 'c'}", f"--config.sft.cache_dir={tmp_path / 'a/sft'}", *SMALL)
    assert again.returncode == 0 and "SFT warm start: reusing" in again.stderr, again.stderr[-3000:]

    # The exported directory is a HF checkpoint + tokenizer: RL from it, colocated on one device.
    second = run_main(f"--workdir={tmp_path / 'b'}", f"--config.model_path={tmp_path / 'a/model'}", *SMALL,
                      "--config.sft.steps=0", "--config.mesh.trainer.devices=1", "--config.mesh.generator.devices=0")
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads((tmp_path / "b/summary.json").read_text())["steps"] == 3


def test_bad_mesh_config_is_a_clear_error(tmp_path):
    res = run_main(f"--workdir={tmp_path}", "--config.mesh.trainer.devices=3", "--config.mesh.generator.devices=3")
    assert res.returncode != 0
    assert "device counts [3, 3] do not fit in 4 devices" in res.stderr
