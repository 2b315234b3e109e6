"""The code sandbox and code rewards: right verdicts for correct, wrong, crashing and slow solutions, and an
adversarial suite that must score 0, leave nothing running or written, and not slow the next call."""

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from arealjax.rewards.code import code_reward, extract_code
from arealjax.rewards.sandbox import NOBODY, Limits, isolation, run_python
from arealjax.rewards.service import RewardService

ADD = [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2", "output": "42"}]


def block(code: str) -> str:
    return f"Let me solve it.\n```python\n{code}\n```\nDone."


def sandbox_processes() -> list[str]:
    out = subprocess.run(["ps", "-u", str(NOBODY), "-o", "pid=,cmd="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def test_isolation_is_reported_and_active_here():
    iso = isolation()
    assert set(iso) == {"namespaces", "private_root", "unprivileged_uid"}
    assert all(iso.values()), iso  # the CI host supports all of it; a host that does not gets a warning


@pytest.mark.parametrize("code,expected", [
    ("a, b = map(int, input().split())\nprint(a + b)", 1.0),  # correct
    ("a, b = map(int, input().split())\nprint(a - b)", 0.0),  # wrong
    ("a, b = map(int, input().split())\nprint(a + b)\nraise ValueError('late crash')", 0.0),  # crashing
    ("import time\ntime.sleep(30)\nprint(3)", 0.0),  # slow
    ("print(3)", 0.0),  # passes one test of two
])
def test_stdin_stdout_verdicts(code, expected):
    assert code_reward(block(code), ADD, timeout=2.0) == expected


def test_call_based_tests_partial_credit_and_extraction():
    code = block("def solve(xs, k):\n    return sorted(xs)[:k]")
    tests = [{"fn_name": "solve", "args": [[3, 1, 2], 2], "expected": [1, 2]},
             {"fn_name": "solve", "args": {"xs": [5, 4], "k": 1}, "expected": [4]},
             {"fn_name": "solve", "args": [[1], 1], "expected": [2]}]
    assert code_reward(code, tests) == 0.0
    assert code_reward(code, tests, partial=True) == pytest.approx(2 / 3)
    assert code_reward(code, tests[:2]) == 1.0
    assert code_reward("no code here", ADD) == 0.0
    assert extract_code("```python\nx = 1\n```\ntext\n```\ny = 2\n```") == "y = 2\n"
    with pytest.raises(ValueError, match="expected keys 'input' and 'output'"):
        code_reward(block("print(1)"), [{"stdin": "1"}])


def test_adversarial_suite_scores_zero_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("AREALJAX_TEST_SECRET", "s3cret-env")
    home_secret = Path.home() / ".arealjax_test_secret"
    home_secret.write_text("s3cret-home")
    home_secret.chmod(0o600)
    run_secret = tmp_path / "credentials.json"  # a world-readable file in a run directory
    run_secret.write_text("s3cret-run")
    run_secret.chmod(0o644)
    decoy = subprocess.Popen(["sleep", "120"])  # stands in for the parent / any host process
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    outside = Path("/tmp/arealjax_sandbox_escape")
    secret_test = [{"input": "", "output": "s3cret"}]  # reward 1 only if a secret leaks
    attacks = {
        "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", ADD),
        "memory bomb": ("x = []\nwhile True:\n    x.append(bytearray(1 << 26))", ADD),
        "infinite loop": ("while True:\n    pass", ADD),
        "busy child outlives the parent": (
            "import os, sys\nif os.fork() == 0:\n    os.setsid()\n    while True:\n        pass\nsys.exit(0)", ADD),
        "writes outside the temp dir": (
            f"wrote = 0\nfor p in ['{outside}', '{tmp_path}/escape', '/root/escape', '/escape']:\n"
            "    try:\n        open(p, 'w').write('x')\n        wrote = 1\n    except OSError:\n        pass\n"
            "print(3 if wrote else 0)", [ADD[0]]),  # reward 1 only if a write got through
        "reads other users' files and run dirs": (
            f"import sys\nfor p in ['{home_secret}', '{run_secret}', '/etc/shadow']:\n"
            "    try:\n        sys.stdout.write(open(p).read()[:6])\n    except OSError:\n        pass",
            secret_test),
        "reads the parent's environment": (
            "import os, sys\nsys.stdout.write(os.environ.get('AREALJAX_TEST_SECRET', '')[:6])\n"
            "for pid in os.listdir('/proc'):\n    try:\n"
            "        e = open(f'/proc/{pid}/environ').read()\n    except OSError:\n        continue\n"
            "    if 's3cret' in e:\n        sys.stdout.write('s3cret')\n        break", secret_test),
        "opens a network connection": (
            f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('s3cret')\nexcept OSError:\n    pass", secret_test),
        "signals the parent": (
            f"import os, signal\nfor pid in [os.getppid(), {decoy.pid}, {os.getpid()}]:\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass", ADD),
        "prints 1 GB": ("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)",
                        ADD),
    }
    service = RewardService("arealjax.rewards.code:code_reward", workers=1, timeout=30.0, retries=0)
    try:
        for name, (code, tests) in attacks.items():
            t0 = time.perf_counter()
            assert service.submit(block(code), tests=tests, timeout=2.0, total_timeout=10.0).result() == 0.0, name
            assert time.perf_counter() - t0 < 15, name
            deadline = time.monotonic() + 5
            while sandbox_processes() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not sandbox_processes(), (name, sandbox_processes())
            assert decoy.poll() is None, f"{name}: the decoy host process was killed"
            assert not outside.exists() and not (tmp_path / "escape").exists() and not Path("/escape").exists()
            assert not Path("/root/escape").exists(), name
            assert not list(Path("/tmp").glob("arealjax-sandbox-*")), name
            # the service keeps serving at normal latency right after
            t0 = time.perf_counter()
            assert service.submit(block("a, b = map(int, input().split())\nprint(a + b)"), tests=ADD).result() == 1.0
            assert time.perf_counter() - t0 < 3, name
        assert service.stats.ok == 2 * len(attacks) and service.stats.restarts == 0  # no worker was lost
    finally:
        service.close()
        decoy.kill()
        server.close()
        home_secret.unlink()
        outside.unlink(missing_ok=True)


def test_output_cap_and_timeout_are_reported():
    r = run_python("import sys\nwhile True:\n    sys.stdout.write('y' * 4096)", limits=Limits(output_bytes=1 << 16))
    assert r.output_exceeded and not r.ok and len(r.stdout) == 1 << 16
    r = run_python("while True: pass", limits=Limits(timeout=0.5, cpu_seconds=10))
    assert r.timed_out and r.returncode is None and r.seconds < 5
    r = run_python("import os\nprint(os.getuid(), os.getcwd(), sorted(os.environ))")
    assert r.ok and r.stdout.split()[:2] == [str(NOBODY), "/sandbox"]
    assert "AREALJAX" not in r.stdout and os.environ.get("PATH", "") not in r.stdout.replace("/usr/bin:/bin", "")
