"""Runs inside the sandbox's fresh namespaces (started by sandbox.py through `unshare`), before the untrusted code.

    python -I -S sandbox_init.py '<json spec>'

Builds a new root from an allow-list (system libraries and the interpreter, read-only; a small writable tmpfs as
the working directory; fresh /proc), chroots into it, applies the rlimits, drops to an unprivileged uid and execs
the interpreter on the code. Standard library only: it runs with -I -S.
"""

import ctypes
import json
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)


def mount(source, target, fstype, flags, data=None):
    if _libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                   data and data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} -> {target}: {os.strerror(err)}")


def bind_readonly(path, root):
    target = root + path
    if os.path.islink(path):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(path, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(spec):
    root = spec["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    done = []
    for path in sorted(spec["read_only"]):  # parents first; a path under one already bound is covered
        if os.path.lexists(path) and not any(path.startswith(d.rstrip("/") + "/") for d in done):
            bind_readonly(path, root)
            done.append(path)
    for dev in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"):
        target = root + dev
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
        mount(dev, target, None, MS_BIND)
    os.makedirs(root + "/proc", exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV)
    work = root + "/sandbox"
    os.makedirs(work, exist_ok=True)
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['work_mb']}m,mode=777")
    with open(work + "/main.py", "w") as f:
        f.write(spec["code"])
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.chroot(root)
    os.chdir("/sandbox")


def main():
    spec = json.loads(sys.argv[1])
    if spec["chroot"]:
        build_root(spec)
    else:
        os.chdir(spec["workdir"])
    for name, value in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if os.getuid() == 0 and spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    # Dying with the parent (unshare --kill-child, or sandbox.py's own) is cleared by the uid change: set it again,
    # so a reward worker killed on a timeout takes this process, and with it the pid namespace, along.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.execve(spec["python"], [spec["python"], "-I", "-S", "-B", "main.py"], spec["env"])


if __name__ == "__main__":
    main()
