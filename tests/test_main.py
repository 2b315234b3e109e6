"""main.py as a user runs it: the default config, then the exported model loaded back through --config.model_path."""

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


@pytest.mark.slow
def test_default_job_then_reload_exported_model(tmp_path):
    first = run_main(f"--workdir={tmp_path / 'a'}", "--config.smoke.max_new_tokens=8")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((tmp_path / "a/smoke.json").read_text())
    assert summary["greedy_matches_reference"] is True
    assert summary["trainer_devices"] == summary["generator_devices"] == 2
    assert summary["generated_tokens"] > 0

    # The exported directory is a HF checkpoint + tokenizer: run the same job on it, colocated on one device.
    second = run_main(f"--workdir={tmp_path / 'b'}", f"--config.model_path={tmp_path / 'a/model'}",
                      "--config.smoke.max_new_tokens=8", "--config.mesh.trainer.devices=1",
                      "--config.mesh.generator.devices=0")
    assert second.returncode == 0, second.stderr[-3000:]
    again = json.loads((tmp_path / "b/smoke.json").read_text())
    assert again["greedy_matches_reference"] is True and again["generator_devices"] == 1
    assert again["generated_tokens"] == summary["generated_tokens"]  # same weights, same greedy outputs


def test_bad_mesh_config_is_a_clear_error(tmp_path):
    res = run_main(f"--workdir={tmp_path}", "--config.mesh.trainer.devices=3", "--config.mesh.generator.devices=3")
    assert res.returncode != 0
    assert "device counts [3, 3] do not fit in 4 devices" in res.stderr
