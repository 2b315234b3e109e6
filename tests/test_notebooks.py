"""Notebooks run top to bottom, headless, as a reader would run them from notebooks/."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def gs_run(gcs_bucket, tmp_path_factory) -> dict[str, str]:
    """A tiny run whose checkpoints are on the emulated gs:// bucket, for checkpoint_inspection.ipynb."""
    from test_checkpoint import main_py

    workdir = tmp_path_factory.mktemp("run")
    checkpoints = f"{gcs_bucket}/notebook-run"
    proc = main_py(workdir, "--config.rl.steps=4", "--config.checkpoint.every_steps=2",
                   f"--config.checkpoint.dir={checkpoints}")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return {"AREALJAX_RUN": str(workdir), "AREALJAX_CHECKPOINTS": checkpoints}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, request):
    cells = json.loads(path.read_text())["cells"]
    code = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert code.strip(), f"{path} has no code cells"
    script = tmp_path / "nb.py"
    script.write_text(code)
    run = request.getfixturevalue("gs_run") if path.name == "checkpoint_inspection.ipynb" else {}  # the emulator
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # (its address is in os.environ once started)
    env.update(run)
    res = subprocess.run([sys.executable, str(script)], cwd=path.parent, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
