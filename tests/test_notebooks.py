"""Notebooks run top to bottom, headless, as a reader would run them from notebooks/."""

import os
import re
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
def test_notebook_runs(path, request, monkeypatch, tmp_path):
    """Each notebook in a Jupyter kernel (nbclient), top to bottom, in its small settings (AREALJAX_QUICK=1), its
    temporary files (a run's workdir) in this test's temporary directory, not left in the system's."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    assert any(c.cell_type == "code" and c.source.strip() for c in nb.cells), f"{path} has no code cells"
    run = request.getfixturevalue("gs_run") if path.name == "checkpoint_inspection.ipynb" else {}  # the emulator
    # The kernel inherits this environment (the emulator's address is in os.environ once started): the suite's
    # compiler flags (conftest.py: shared compiled programs) with the device count the notebook itself would set.
    (count,) = set(re.findall(r"--xla_force_host_platform_device_count=\d+", path.read_text())) or {""}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    monkeypatch.setenv("XLA_FLAGS", " ".join([count, *flags]).strip())
    for k, v in {**run, "AREALJAX_QUICK": "1", "TMPDIR": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    if "tempfile" in path.read_text():  # what it made (a run's workdir, an export) is here, for pytest to remove
        assert any(tmp_path.iterdir()), f"{path.name}: its temporary files are not in {tmp_path}"
