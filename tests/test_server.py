"""Generation servers in their own processes (generation/server.py) driven by the trainer's `remote` backend
(generation/remote.py): the same completions as the in-process generator, weights equal on every server after each
update, a killed server's requests sent again to the others (the same tokens: same seeds), a late server joining
with the current weights, servers stopping when the trainer dies, and a whole run through kill -9 of a server and
of everything."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from arealjax import builders, runtime
from arealjax.api import SamplingParams
from arealjax.config import parse
from arealjax.sharding import normalize_rules, role_meshes
from configs.default import get_config

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT = 5.0  # generator.servers.heartbeat_seconds here: short, with room for a loaded CI machine


DIGITS = "start: /[0-9]{1,3}/"  # a grammar (lark) the tiny character tokenizer can write


def small_config(**servers):
    c = get_config()
    c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    c.generator.update(slots=8, max_len=48, max_prefill_batch=8)
    c.generator.servers.update({"spawn": 2, "verify": True, "heartbeat_seconds": HEARTBEAT, **servers})
    return c


def backends(c, tmp_path, kinds=("local", "remote")):
    """(tokenizer, model, {kind: (backend, transport)}) for the same model."""
    rules = normalize_rules(c.sharding_rules)
    tokenizer, model = builders.build(parse(c), role_meshes(c.mesh)["trainer"], rules)
    out = {}
    for kind in kinds:
        c.generator.backend = kind
        out[kind] = builders.make_backend(parse(c), model, 0, builders.role_meshes_for(parse(c)), rules,
                                            workdir=str(tmp_path))
    return tokenizer, model, out


def requests(tokenizer, groups: int, samples: int = 3):
    """`samples` one-sample requests per group, numbered as the controller numbers them."""
    return [(f"p{k}#{k}/{j}", tokenizer.encode(f"{k}+{7 * k}="), j) for k in range(groups) for j in range(samples)]


def live_processes() -> list[tuple[int, str]]:
    """(pid, command line) of every process on this machine that is not a zombie."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and "zombie" not in (p / "status").read_text().lower():
                out.append((int(p.name), (p / "cmdline").read_text().replace("\0", " ")))
        except OSError:  # gone meanwhile
            pass
    return out


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_servers_generate_what_the_local_generator_does_and_serve_the_weights_they_are_sent(tmp_path):
    """Temperature ≠ 1 with top-k and top-p, greedy, and a grammar: the same tokens, logprobs, versions and (a
    mixture of experts here, every other test of this file a dense model) routes from two servers as from the
    in-process generator; a grammar that does not compile fails its request on every server, naming why, and the
    servers go on; a group's samples on one server, groups spread over both; after each update every server serves the
    trainer's version, and the weights it got have the trainer's fingerprint. Each server runs on the cores
    generator.servers.cpus gives it."""
    last = os.cpu_count() - 1
    c = small_config(cpus=f"0;{last}")
    c.model.update(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   norm_topk_prob=True)
    tokenizer, model, made = backends(c, tmp_path)
    (local, _), (remote, transport) = made["local"], made["remote"]
    try:
        for sampling in (SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=20, seed=3),
                         SamplingParams(temperature=0.0, max_new_tokens=12),
                         SamplingParams(max_new_tokens=8, seed=4, grammar=DIGITS,
                                        stop_token_ids=tuple(tokenizer.eos_ids))):
            reqs = requests(tokenizer, groups=6)
            theirs = {rid: remote.submit(p, sampling, request_id=rid, first_sample=j) for rid, p, j in reqs}
            routes = {rid: remote.server_of(rid) for rid in theirs}
            ours = {rid: local.submit(p, sampling, request_id=rid, first_sample=j) for rid, p, j in reqs}
            for rid in ours:
                (a,), (b,) = ours[rid].result(timeout=120), theirs[rid].result(timeout=120)
                assert a.output_tokens == b.output_tokens and a.sample == b.sample, rid
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
                assert list(a.versions) == list(b.versions) == [0] * len(a.output_tokens)
                assert b.routes.experts.shape == (len(b.prompt_tokens) + len(b.output_tokens), 1, 2)
                np.testing.assert_array_equal(a.routes.experts, b.routes.experts)
            by_group = {}
            for rid, server in routes.items():
                by_group.setdefault(rid.split("/")[0], set()).add(server)
            assert all(len(s) == 1 for s in by_group.values()), by_group  # a group's samples share a server
            assert {s for (s,) in by_group.values()} == {"server-0", "server-1"}  # and groups spread
            if sampling.grammar:
                outs = [f.result()[0] for f in theirs.values()]
                assert all(c.stop_reason == "stop" and re.fullmatch("[0-9]{1,3}", tokenizer.decode(c.output_tokens))
                           for c in outs)

        for version in (1, 2):
            params = jax.tree.map(lambda x, v=version: x * (1 + 0.01 * v), model.params)
            assert transport.push(params, version).result(timeout=60) >= 0
            servers = remote.servers()
            assert remote.version == version and all(s["version"] == version for s in servers.values())
            assert {s["fingerprint"] for s in servers.values()} == {transport.fingerprint(params)}
        bad = remote.submit(reqs[0][1], SamplingParams(grammar='start: %json {"type": "objectx"}'))
        with pytest.raises(RuntimeError, match="objectx"):  # a request's fault: every server fails it, names why
            bad.result(timeout=60)
        (after,) = remote.submit(reqs[0][1], SamplingParams(max_new_tokens=4)).result(timeout=60)
        assert list(after.versions) == [2] * 4
        assert {n: s["cpus"] for n, s in remote.servers().items()} == {"server-0": [0], "server-1": [last]}
        stats = remote.metrics()
        assert stats["servers_ready"] == 2 and stats["decode_steps_total"] > 0
        assert stats["weight_bytes_total"] >= 2 * 3 * transport.bytes  # the first weights and two updates, ×2
    finally:
        remote.close()
        local.close()


def test_pin_puts_every_thread_on_its_cores():
    """runtime.pin before JAX starts: every thread of the process (XLA's pools included) runs on the pinned core;
    a reversed span is refused by name."""
    code = ("from arealjax import runtime; runtime.pin('0'); import os, jax, jax.numpy as jnp; "
            "(jnp.ones((256, 256)) @ jnp.ones((256, 256))).block_until_ready(); "
            "print(sorted({tuple(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[(0,)]", out.stdout
    with pytest.raises(ValueError, match=r"cpus: '0,1-0' is not a list of CPU cores"):
        runtime.parse_cpus("0,1-0")


def test_a_child_process_gets_every_xla_flag_but_the_device_count():
    """runtime.child_env: a spawned server or main.py fakes its own device count (the parent's flag would win over
    its config) and keeps every other XLA flag the user set."""
    env = {"XLA_FLAGS": "--xla_dump_to=/d --xla_force_host_platform_device_count=8 --xla_cpu_use_thunk_runtime=true",
           "HOME": "/h"}
    assert runtime.child_env(env) == {"XLA_FLAGS": "--xla_dump_to=/d --xla_cpu_use_thunk_runtime=true", "HOME": "/h"}
    assert runtime.child_env({"XLA_FLAGS": " --xla_force_host_platform_device_count=2"}) == {}
    assert env["XLA_FLAGS"].count("device_count") == 1  # the given environment is left alone


def test_under_lora_and_bf16_only_the_adapters_travel_cast_and_servers_serve_the_merged_model(tmp_path):
    """LoRA (merged serving) with a bf16 generator: an update moves the adapters only, as bf16; each server gets
    exactly those bytes, merges them onto the base it got at join, and generates what the in-process generator
    does after the same update."""
    c = small_config()
    c.lora.rank, c.generator.dtype = 2, "bfloat16"
    rules = normalize_rules(c.sharding_rules)
    tokenizer, base = builders.build(parse(c), role_meshes(c.mesh)["trainer"], rules)
    trainer = builders.make_trainer(parse(c), base, role_meshes(c.mesh)["trainer"], rules)
    made = {}
    for kind in ("local", "remote"):
        c.generator.backend = kind
        made[kind] = builders.make_backend(parse(c), trainer.model, 0, builders.role_meshes_for(parse(c)), rules,
                                             workdir=str(tmp_path))
    (local, _), (remote, transport) = made["local"], made["remote"]
    try:
        rng = np.random.RandomState(0)
        adapters = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype), trainer.params)
        sent = remote.metrics()["weight_bytes_total"]
        for _, t in made.values():
            t.push(adapters, 1).result(timeout=60)
        count = sum(x.size for x in jax.tree.leaves(adapters))
        assert transport.bytes == 2 * count and count < sum(x.size for x in jax.tree.leaves(trainer.model.params)) / 5
        assert remote.metrics()["weight_bytes_total"] - sent == 2 * transport.bytes  # two servers, adapters only
        assert {s["fingerprint"] for s in remote.servers().values()} == {transport.fingerprint(adapters)}
        sampling = SamplingParams(temperature=0.8, max_new_tokens=16, seed=5)
        for rid, p, j in requests(tokenizer, groups=4, samples=2):
            (a,), (b,) = (made[k][0].submit(p, sampling, request_id=rid, first_sample=j).result(timeout=120)
                          for k in ("local", "remote"))
            assert a.output_tokens == b.output_tokens and list(b.versions) == [1] * len(b.output_tokens), rid
    finally:
        remote.close()
        local.close()


def kill_mid_generation_and_compare(local, remote, reqs, sampling, victim: str) -> int:
    """Submits `reqs` to both backends, kill -9 of server `victim` once generation started; every remote request
    must complete with the in-process generator's tokens (re-sent with the same seeds). Returns the victim's pid."""
    expected = {rid: local.submit(p, sampling, request_id=rid, first_sample=j) for rid, p, j in reqs}
    futures = {rid: remote.submit(p, sampling, request_id=rid, first_sample=j) for rid, p, j in reqs}
    pid = remote.servers()[victim]["pid"]
    wait_until(lambda: sum(remote.in_flight().values()) > 0, 60, "generation to start")
    os.kill(pid, signal.SIGKILL)
    for rid, fut in futures.items():
        (got,), (want,) = fut.result(timeout=120), expected[rid].result(timeout=120)
        assert got.output_tokens == want.output_tokens, rid
    return pid


def test_a_killed_server_loses_nothing_and_the_last_one_dying_is_named(tmp_path):
    """kill -9 of one server with requests in flight on both: every request completes with the tokens it would
    have had (re-sent to the other, same seeds), the backend counts the loss. Then the other dies too: what is
    waiting fails after servers.wait_seconds with an error naming both (a second, shorter than a server's start:
    the wait for servers to start is start_seconds). No restarts here (servers.respawns = 0)."""
    c = small_config(wait_seconds=1.0, respawns=0)
    tokenizer, _, made = backends(c, tmp_path)
    (local, _), (remote, _) = made["local"], made["remote"]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=40, seed=11)  # no stop token: every sample is long
    reqs = requests(tokenizer, groups=24, samples=2)
    try:
        kill_mid_generation_and_compare(local, remote, reqs, sampling, "server-0")
        stats = remote.metrics()
        assert stats["servers_lost_total"] == 1 and stats["servers_ready"] == 1
        assert stats["requests_reissued_total"] > 0, "the kill came after every request had finished"
        assert "exited with code -9" in remote.servers()["server-0"]["why"]

        os.kill(remote.servers()["server-1"]["pid"], signal.SIGKILL)
        wait_until(lambda: remote.metrics()["servers_ready"] == 0, 30, "the second loss to be noticed")
        unsent = remote.submit(reqs[0][1], sampling, request_id="unsent")  # no server: aborting it is immediate
        assert remote.abort("unsent") and [c.stop_reason for c in unsent.result(timeout=5)] == ["abort"]
        orphan = remote.submit(reqs[0][1], sampling, request_id="orphan")
        with pytest.raises(RuntimeError, match=r"no generation server left.*server-0 \(exited.*server-1 \(exited"):
            orphan.result(timeout=30)
    finally:
        remote.close()
        local.close()


def test_a_spawned_server_that_dies_is_started_again_and_serves_what_it_was_serving(tmp_path, caplog):
    """kill -9 of the only server mid-generation: it is started again (its log says why), joins with the current
    weights and every request completes with the tokens it would have had; past servers.respawns it is not."""
    c = small_config(spawn=1, respawns=1, wait_seconds=2.0)
    tokenizer, _, made = backends(c, tmp_path)
    (local, _), (remote, _) = made["local"], made["remote"]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=40, seed=5)
    reqs = requests(tokenizer, groups=8, samples=2)
    try:
        first = kill_mid_generation_and_compare(local, remote, reqs, sampling, "server-0")
        again = remote.servers()["server-0"]
        assert again["state"] == "ready" and again["pid"] != first
        assert any("server-0: starting it again (restart 1 of at most 1)" in m for m in caplog.messages)
        os.kill(again["pid"], signal.SIGKILL)
        wait_until(lambda: remote.servers()["server-0"]["state"] == "dead", 30, "the second loss")
        time.sleep(1.0)
        assert remote.servers()["server-0"]["pid"] == again["pid"], "started a third time"
    finally:
        remote.close()
        local.close()


def test_servers_that_do_not_start_in_start_seconds_are_a_clear_error(tmp_path):
    """None started here and none joins: the backend fails after start_seconds (not wait_seconds) with the
    command that starts one."""
    c = small_config(spawn=0, start_seconds=0.5, wait_seconds=600.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not start: 0 of 1 ready after 0.5 s \(generator.servers.start_"
                                           r"seconds\); start them with: python -m arealjax.generation.server"):
        backends(c, tmp_path, kinds=("remote",))
    assert time.monotonic() - t0 < 60


def test_a_late_server_joins_with_the_current_weights_and_servers_stop_when_the_trainer_dies(tmp_path):
    """A server started by hand after two updates serves the latest version (its fingerprint is the trainer's)
    and takes requests, and stops with the trainer. A trainer that hangs (alive, silent): its server stops after
    the heartbeat."""
    c = small_config(spawn=1)
    tokenizer, model, made = backends(c, tmp_path, kinds=("remote",))
    remote, transport = made["remote"]
    late = None
    try:
        for version in (1, 2):
            params = jax.tree.map(lambda x, v=version: x * (1 + 0.01 * v), model.params)
            transport.push(params, version).result(timeout=60)
        env = runtime.child_env()
        late = subprocess.Popen([sys.executable, "-m", "arealjax.generation.server", f"--trainer={remote.address}",
                                 "--devices=2", "--name=late"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
        wait_until(lambda: remote.servers().get("late", {}).get("state") == "ready", 60, "the late server")
        joined = remote.servers()["late"]
        assert joined["version"] == 2 and joined["fingerprint"] == transport.fingerprint(params)
        futures = [remote.submit(p, SamplingParams(max_new_tokens=4), request_id=rid, first_sample=j)
                   for rid, p, j in requests(tokenizer, groups=4, samples=1)]
        assert all(list(c.versions) == [2] * 4 for f in futures for c in f.result(timeout=60))
    finally:
        remote.close()
    assert late.wait(timeout=30) == 0  # the trainer's stop

    # a trainer that hangs (alive, silent): a trainer process with one server of its own, stopped with SIGSTOP
    script = ("import sys, time; sys.path.insert(0, '.'); from tests.test_server import small_config, backends; "
              "from pathlib import Path; _, _, made = backends(small_config(spawn=1), Path(sys.argv[1]), "
              "kinds=('remote',)); print(made['remote'][0].servers()['server-0']['pid'], flush=True); time.sleep(600)")
    trainer = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "hung")], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    try:
        server = int(trainer.stdout.readline())
        trainer.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        wait_until(lambda: server not in dict(live_processes()), 30, "the server of a silent trainer to stop")
        assert time.monotonic() - t0 < HEARTBEAT + 10, time.monotonic() - t0  # the heartbeat, and its exit
    finally:
        trainer.kill()
        trainer.wait()
    log = (tmp_path / "hung" / "servers" / "server-0.log").read_text()
    assert "no word from the trainer" in log, log[-2000:]


def test_a_server_the_trainer_started_stops_the_moment_the_trainer_dies_even_before_its_welcome(tmp_path):
    """A trainer killed with kill -9 before it welcomed a server it started (a restart under way, say): the server
    stops within seconds, not after the first contact's wait (10 minutes, for a trainer that starts late)."""
    script = tmp_path / "trainer.py"
    script.write_text(
        "import subprocess, time, zmq\n"
        "from arealjax.generation.fleet import spawn_command\n"
        "sock = zmq.Context().socket(zmq.ROUTER)\n"
        "port = sock.bind_to_random_port('tcp://127.0.0.1')\n"
        f"log = open({str(tmp_path / 'server.log')!r}, 'w')\n"
        "server = subprocess.Popen(spawn_command(f'127.0.0.1:{port}', 'server-0', 1, '', None), stdout=log,\n"
        "                          stderr=subprocess.STDOUT, start_new_session=True)\n"
        "print(server.pid, flush=True)\n"
        "sock.recv_multipart()  # the server is up (its hello or a ping), never answered\n"
        "print('heard', flush=True)\n"
        "time.sleep(600)\n")
    trainer = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                               env={**runtime.child_env(), "PYTHONPATH": str(ROOT)})
    try:
        server = int(trainer.stdout.readline())
        assert trainer.stdout.readline().strip() == "heard"
    finally:
        trainer.kill()
        trainer.wait()
    t0 = time.monotonic()
    wait_until(lambda: server not in dict(live_processes()), 30, "the server of a dead trainer to stop")
    assert time.monotonic() - t0 < 10, time.monotonic() - t0  # a tick, and its exit on a loaded machine
    log = (tmp_path / "server.log").read_text()
    assert f"the trainer that started it (pid {trainer.pid}) is gone: stopping" in log, log[-2000:]


def test_a_server_started_by_hand_rejoins_a_trainer_that_died_and_came_back(tmp_path):
    """A trainer killed with kill -9 and started again at the same address (a resume): the server started by hand
    notices the silence, drops what it held, says hello again and serves the new trainer."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ("import sys, time; sys.path.insert(0, '.'); from tests.test_server import small_config, backends; "
              "from pathlib import Path; backends(small_config(spawn=0, address=sys.argv[2]), Path(sys.argv[1]), "
              "kinds=('remote',)); print('ready', flush=True); time.sleep(600)")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    first = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "a"), f"127.0.0.1:{port}"], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True, env=env)
    server = subprocess.Popen([sys.executable, "-m", "arealjax.generation.server", f"--trainer=127.0.0.1:{port}",
                               "--devices=2", "--name=hand", "--rejoin-seconds=60"], cwd=ROOT, env=runtime.child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    remote = None
    try:
        assert first.stdout.readline().strip() == "ready"
        first.send_signal(signal.SIGKILL)
        first.wait()
        c = small_config(spawn=0, address=f"127.0.0.1:{port}", start_seconds=60.0)
        tokenizer, _, made = backends(c, tmp_path / "b", kinds=("remote",))
        remote, _ = made["remote"]
        assert remote.servers()["hand"]["state"] == "ready"
        rid, prompt, j = requests(tokenizer, groups=1, samples=1)[0]
        assert len(remote.submit(prompt, SamplingParams(max_new_tokens=4), request_id=rid).result(timeout=60)) == 1
    finally:
        if remote is not None:
            remote.close()
        first.kill()
    assert server.wait(timeout=30) == 0, server.stdout.read()[-3000:]  # the new trainer's stop
    assert "saying hello again for up to 60 s" in server.stdout.read()


@pytest.mark.slow
def test_a_synchronous_run_on_two_servers_trains_what_the_in_process_run_trains(tmp_path):
    """η = 0 through main.py, the in-process generator vs two generation servers: the same prompts in every step,
    the same rewards and losses, the same final params (to float noise)."""
    from safetensors.numpy import load_file

    from tests.test_checkpoint import TINY

    env = runtime.child_env()
    common = [*TINY, "--config.rl.steps=4", "--config.advantage.filter_uniform=True"]
    for name, extra in (("local", []), ("remote", ["--config.generator.backend=remote",
                                                   "--config.generator.servers.spawn=2"])):
        res = subprocess.run([sys.executable, "main.py", *common, *extra, f"--workdir={tmp_path / name}"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
    local, remote = tmp_path / "local", tmp_path / "remote"
    assert (local / "trained_prompts.jsonl").read_text() == (remote / "trained_prompts.jsonl").read_text()
    rows = {d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()][1:] for d in (local, remote)}
    assert [r["reward"] for r in rows[local]] == [r["reward"] for r in rows[remote]]
    assert len({r["reward"] for r in rows[local]}) > 1  # rewards that vary: a learning signal to compare
    np.testing.assert_allclose([r["loss"] for r in rows[remote]], [r["loss"] for r in rows[local]], rtol=1e-4,
                               atol=1e-7)
    a, b = load_file(str(local / "model/model.safetensors")), load_file(str(remote / "model/model.safetensors"))
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-5
    assert all(r["servers_ready"] == 2 for r in rows[remote])


LONGTAIL = ["--config=configs/longtail.py", "--config.sft.steps=0", "--config.rl.steps=10",
            "--config.rl.max_staleness=2", "--config.rl.eval_every=0", "--config.eval.num_problems=4",
            "--config.advantage.filter_uniform=False", "--config.checkpoint.every_steps=2",
            "--config.model.num_layers=1", "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
            "--config.model.num_heads=2", "--config.model.num_kv_heads=1", "--config.model.head_dim=16",
            "--config.rl.batch_size=4", "--config.rl.group_size=2", "--config.generator.slots=16",
            "--config.rewards.fn=tests.reward_fns:digits", "--config.generator.backend=remote",
            "--config.generator.servers.spawn=2", f"--config.generator.servers.heartbeat_seconds={HEARTBEAT}",
            "--config.generator.servers.verify=True", "--config.curves=False"]


@pytest.mark.slow
def test_a_run_on_two_servers_survives_a_server_kill_then_kill_9_of_everything_and_resumes_exactly(tmp_path):
    """η = 2 on the long-tail task with two servers: one killed with kill -9 after checkpoint 2 (the run goes on on
    the other, says so and starts it again), then the trainer killed after checkpoint 6 (its servers stop), then
    resumed to step 10 (new servers, the checkpoint's weights). Every step trains 4 prompts, none twice, none lost;
    versions one per step; staleness ≤ η throughout."""
    import orbax.checkpoint as ocp

    from tests.test_checkpoint import assert_resumed_exactly, trained

    env = runtime.child_env()
    run = tmp_path / "run"

    def start(*extra):
        return subprocess.Popen([sys.executable, "main.py", *LONGTAIL, f"--workdir={run}", *extra], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def server_pids(name: str = "server-") -> list[int]:
        """Live generation servers of this run (named `name`...): those serving the trainer address in its logs."""
        logs = " ".join(f.read_text() for f in (run / "servers").glob("*.log"))
        trainers = {f"--trainer={a} " for a in re.findall(r"welcomed by (\S+) ", logs)}
        return [pid for pid, cmd in live_processes() if "arealjax.generation.server" in cmd and
                f"--name={name}" in cmd and any(t in cmd + " " for t in trainers)]

    def checkpoint_at_least(step: int, proc) -> None:
        manager = ocp.CheckpointManager(run / "checkpoints", options=ocp.CheckpointManagerOptions(read_only=True))
        wait_until(lambda: proc.poll() is None and (run / "checkpoints").is_dir() and
                   (manager.reload() or manager.latest_step() or 0) >= step or proc.poll() is not None, 600,
                   f"checkpoint {step}")
        assert proc.poll() is None, proc.stdout.read()[-3000:]

    proc = start()
    checkpoint_at_least(2, proc)
    (victim,) = server_pids("server-0")
    os.kill(victim, signal.SIGKILL)
    checkpoint_at_least(6, proc)
    servers = server_pids()
    assert len(servers) == 2 and victim not in servers, servers  # server-1 still serving, server-0 started again
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer (its servers are in their own sessions: they outlive it)
    out = proc.stdout.read()
    proc.wait()
    assert re.search(r"generation server server-0 lost: exited with code -9 .*; 1 left \(server-1\)", out), out[-3000:]
    assert "generation server server-0: starting it again (restart 1 of at most 3)" in out, out[-3000:]
    wait_until(lambda: not server_pids(), HEARTBEAT + 10, "the servers to stop after the trainer's death")
    assert len(trained(run)) < 10, "the run finished before the kill"

    resumed = start("--config.resume=True")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    steps = assert_resumed_exactly(run, 10, per_step=4, eta=2)
    assert all(r["weight_bytes"] > 0 for r in steps[-3:])  # the resumed run streamed its weights too
