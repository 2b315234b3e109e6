"""Runs one command agent and takes it along if the trainer dies: `python guard.py TRAINER_PID COMMAND`.

The trainer starts this file (not the package: the standard library only, a few milliseconds) in a session of its
own; the command's shell runs in this process's group, so one `killpg` (a timeout, a cancelled episode) ends both.
Linux signals this process when the trainer dies (PR_SET_PDEATHSIG), a kill -9 or an out-of-memory kill included,
and it kills its whole group: no agent outlives the run that started it."""

import ctypes
import os
import signal
import subprocess
import sys


def _kill_group(*_) -> None:
    os.killpg(0, signal.SIGKILL)


def main() -> None:
    trainer, command = int(sys.argv[1]), sys.argv[2]
    signal.signal(signal.SIGTERM, _kill_group)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the trainer's own cleanup is all there is
        pass
    if os.getppid() != trainer:  # the trainer died before the signal was armed
        _kill_group()
    code = subprocess.call(command, shell=True)
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
