"""A sandbox for untrusted generated code that a user can run on their training host.

    result = run_python(code, stdin="1 2\\n", limits=Limits(timeout=5))
    result.stdout, result.returncode, result.timed_out

Always: own session and process group, killed as a whole on timeout; rlimits (CPU seconds, address space, file
size, processes, open files, no core files); stdout/stderr capped; a minimal environment (nothing inherited); no
inherited file descriptors; `python -I -S` (no user site, no site-packages, no PYTHON* variables).
Where the host allows it (`isolation()` says what is active): fresh network, pid, IPC, UTS and mount namespaces via
`unshare` (no network; the code's processes die with it and cannot see or signal the host's); a new read-only root
holding only system libraries and the interpreter, with a small tmpfs as the working directory, so home and run
directories and the host's temp files are out of reach and nothing is written to the host; and an unprivileged
uid when started as root, so RLIMIT_NPROC binds and a fork bomb stays bounded.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

NOBODY = 65534
PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the forked child only calls it
# A sandboxed run gets SIGKILL when the thread that started it dies, so a reward worker killed on a timeout (or a
# killed training job) takes its runs along; with namespaces, everything inside dies with its init. setpriv sets
# it without a preexec_fn, which would run Python in a fork of a multithreaded (JAX) process.
_SETPRIV = [shutil.which("setpriv"), "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
_INIT = str(Path(__file__).with_name("sandbox_init.py"))
_STAGING = "arealjax-sandbox-"  # + pid of the process that runs the sandbox
_UNSHARE = ["--net", "--pid", "--ipc", "--uts", "--mount", "--fork", "--kill-child"]


@dataclasses.dataclass(frozen=True)
class Limits:
    timeout: float = 5.0  # wall-clock seconds
    cpu_seconds: int = 5
    memory_mb: int = 512  # address space
    file_size_mb: int = 8
    processes: int = 32  # for the sandbox uid (binds only when not root)
    open_files: int = 64
    output_bytes: int = 1 << 20  # per stream; beyond it the run is killed
    work_mb: int = 16  # the tmpfs working directory


@dataclasses.dataclass
class RunResult:
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool = False
    output_exceeded: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_exceeded


@functools.lru_cache(maxsize=1)
def isolation() -> dict[str, bool]:
    """Which protections beyond rlimits + timeouts + scrubbed env are active on this host (probed once)."""
    unshare = shutil.which("unshare")
    namespaces = bool(unshare) and subprocess.run(
        [unshare, *_UNSHARE, "true"], capture_output=True, timeout=30).returncode == 0
    out = {"namespaces": namespaces, "private_root": namespaces and sys.platform == "linux",
           "unprivileged_uid": True}  # already, or as root by dropping to nobody
    missing = [k for k, v in out.items() if not v]
    if missing:
        logging.warning("code sandbox: running without %s (rlimits, timeouts and a scrubbed environment still "
                        "apply)", ", ".join(missing))
    return out


def _read_only_paths() -> list[str]:
    """What the interpreter needs: system libraries and the Python installation (nothing under /home, /root, /tmp
    or the working directories other than that)."""
    paths = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/ld.so.cache", "/etc/localtime",
             "/etc/passwd", "/etc/group", "/etc/nsswitch.conf"]
    for key in ("stdlib", "platstdlib"):
        paths.append(str(Path(sysconfig.get_paths()[key]).resolve()))
    paths += [str(Path(sys.base_prefix).resolve() / d) for d in ("bin", "lib")]
    exe = Path(sys.executable).resolve()
    paths.append(str(exe))
    return sorted(set(paths))


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
    """Runs `code` with `python -I -S` in the sandbox, `stdin` as its standard input."""
    iso = isolation()
    python = str(Path(sys.executable).resolve())
    rlimits = {"RLIMIT_CPU": limits.cpu_seconds, "RLIMIT_AS": limits.memory_mb << 20,
               "RLIMIT_FSIZE": limits.file_size_mb << 20, "RLIMIT_NPROC": limits.processes,
               "RLIMIT_NOFILE": limits.open_files, "RLIMIT_CORE": 0}
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/sandbox", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONHASHSEED": "0"}
    _sweep()
    staging = tempfile.mkdtemp(prefix=f"{_STAGING}{os.getpid()}-")
    try:
        spec = {"python": python, "rlimits": rlimits, "env": env, "code": code, "work_mb": limits.work_mb,
                "uid": NOBODY if os.getuid() == 0 else None,
                "chroot": iso["private_root"], "root": staging, "read_only": _read_only_paths(),
                "workdir": staging}
        if not iso["private_root"]:
            Path(staging, "main.py").write_text(code)
            if spec["uid"] is not None:
                os.chown(staging, NOBODY, NOBODY)
        cmd = [python, "-I", "-S", _INIT, json.dumps(spec)]
        if iso["namespaces"]:
            cmd = [shutil.which("unshare"), *_UNSHARE, *cmd]
        return _run(_SETPRIV + cmd, stdin, limits)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _sweep() -> None:
    """Removes the staging directories of processes that died mid-run (a reward worker killed on a timeout)."""
    for d in Path(tempfile.gettempdir()).glob(f"{_STAGING}*"):
        pid = d.name[len(_STAGING):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def _run(cmd: list[str], stdin: str, limits: Limits) -> RunResult:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, close_fds=True, env={},
                            preexec_fn=None if _SETPRIV else _die_with_parent)
    streams: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
    exceeded = threading.Event()

    def drain(name: str, pipe) -> None:
        buf = streams[name]
        while chunk := pipe.read1(65536):
            room = limits.output_bytes - len(buf)
            buf += chunk[:max(room, 0)]
            if len(chunk) > room:
                exceeded.set()
                _kill(proc)
                return

    readers = [threading.Thread(target=drain, args=(n, getattr(proc, n)), daemon=True) for n in streams]
    for r in readers:
        r.start()
    try:
        proc.stdin.write(stdin.encode())
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    timed_out = False
    try:
        proc.wait(timeout=limits.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill(proc)  # the whole group: also whatever the code left running
    proc.wait()
    for r in readers:
        r.join(timeout=5)
    return RunResult(streams["stdout"].decode(errors="replace"), streams["stderr"].decode(errors="replace"),
                     None if timed_out else proc.returncode, timed_out, exceeded.is_set(), time.perf_counter() - t0)


def _die_with_parent() -> None:
    """In the forked child, where setpriv is missing: see _SETPRIV."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
