"""The rollout interface (arealjax/api.py): the controller, the workflows and evaluation see a RolloutBackend and
nothing of the generator behind it, so another backend (a generation server in its own process, an external
engine) plugs in without touching them."""

import ast
from pathlib import Path

import pytest

from arealjax import builders, evaluate
from arealjax.api import RolloutBackend, SamplingParams, WeightTransport
from arealjax.config import ConfigError, parse
from arealjax.controller import RolloutController
from arealjax.data.prompts import eval_prompts, train_prompts
from arealjax.rewards.service import RewardService
from arealjax.rl.advantages import AdvantageConfig
from arealjax.sharding import normalize_rules
from arealjax.staleness import StalenessManager
from arealjax.workflows import MultiTurn
from configs.default import get_config

ROOT = Path(__file__).resolve().parents[1] / "arealjax"
BACKEND_USERS = ["controller.py", "evaluate.py", "workflows"]  # typed against api.RolloutBackend only


def imported_modules(path: Path) -> set[str]:
    """Every arealjax module `path` imports (at module level or inside functions), names resolved to modules."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("arealjax")}


@pytest.mark.parametrize("user", BACKEND_USERS)
def test_backend_users_import_no_concrete_generator(user):
    files = sorted((ROOT / user).glob("*.py")) if (ROOT / user).is_dir() else [ROOT / user]
    for f in files:
        concrete = {m for m in imported_modules(f) if m.startswith("arealjax.generation") or m.endswith(".Generator")}
        assert not concrete, f"{f.relative_to(ROOT.parent)} imports {sorted(concrete)}: use arealjax.api instead"


def small_config():
    c = get_config()
    c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    c.generator.update(slots=8, max_len=48, max_prefill_batch=8)
    c.rewards.workers = 1
    return c


class ProtocolOnly:
    """The real backend seen through the protocol alone: any other attribute (`engine`, `counters`, ...) raises,
    so a component that reaches through the interface fails here."""

    MEMBERS = {"version", "max_len", "submit", "update_weights", "abort", "pause", "resume", "in_flight", "metrics",
               "close"}

    def __init__(self, backend):
        self._backend, self.calls = backend, []

    def __getattr__(self, name):
        if name not in self.MEMBERS:
            raise AttributeError(f"'{name}' is not part of api.RolloutBackend")
        self.calls.append(name)
        return getattr(self._backend, name)


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_backends_and_transports_satisfy_the_protocols_and_serve_through_them(kind, tmp_path, monkeypatch,
                                                                                   capsys):
    """The in-process generator and a generation server in its own process (generation/remote.py; several:
    tests/test_server.py) serve the controller (a multi-turn workflow), a weight push and evaluation (with its
    progress bar) through the protocol alone."""
    c = small_config()
    c.generator.backend = kind
    c.generator.servers.spawn = 1
    rules = normalize_rules(c.sharding_rules)
    meshes = builders.role_meshes_for(parse(c))
    tokenizer, model = builders.build(parse(c), meshes["trainer"], rules)
    backend, transport = builders.make_backend(parse(c), model, 0, meshes, rules, workdir=str(tmp_path))
    try:
        assert isinstance(backend, RolloutBackend) and isinstance(transport, WeightTransport)
        assert backend.max_len == 48 and transport.bytes > 0
        proxy = ProtocolOnly(backend)
        assert isinstance(proxy.metrics(), dict) and all(isinstance(v, (int, float)) for v in proxy.metrics().values())

        # the controller with a multi-turn workflow, through the protocol only
        sampling = SamplingParams(max_new_tokens=6, n=2, stop_token_ids=tuple(tokenizer.eos_ids), seed=1)
        with RewardService(c.rewards.fn, workers=1) as rewards:
            controller = RolloutController(proxy, rewards, tokenizer, train_prompts(parse(c), tokenizer),
                                           StalenessManager(2, 1, 4), sampling, AdvantageConfig(filter_uniform=False),
                                           workflow=MultiTurn(max_turns=2, feedback="again")).start()
            try:
                batch = controller.get_batch(0)
            finally:
                controller.stop()
            assert len(batch) == 2 and all(len(g.trajectories) == 2 for g in batch)

            # a weight push lands: the backend serves the new version, and tokens sampled after it carry it
            transport.push(model.params, 1).result(timeout=60)
            assert proxy.version == 1

            # evaluation, through the protocol only, its bar redrawn at every sample scored (BAR_SECONDS = 0)
            monkeypatch.setattr(evaluate, "BAR_SECONDS", 0.0)
            capsys.readouterr()
            spec = evaluate.EvalSpec(SamplingParams(max_new_tokens=6), n=2, ks=(1, 2))
            summary, rows = evaluate.evaluate(proxy, rewards, tokenizer, eval_prompts(parse(c), tokenizer)[:3], spec,
                                              progress=True, desc="held out")
        assert summary["problems"] == 3 and len(rows) == 3
        # the bar counts samples as they are scored (3 problems x 2, then 3 greedy) with the running accuracies,
        # which end at the summary's
        bar = capsys.readouterr().err
        shown = [bar.index(f"{done}/9") for done in (2, 4, 6, 7, 9)]
        assert shown == sorted(shown) and bar.startswith("\rheld out:"), bar
        assert f"acc={summary['eval_accuracy']:.3f}, greedy={summary['eval_greedy_accuracy']:.3f}" in bar, bar
        assert {"submit", "max_len"} <= set(proxy.calls)
    finally:
        backend.close()


def test_unknown_backend_is_refused_by_name():
    """At start-up (the config's check), and by the builder of a config changed after it."""
    c = small_config()
    c.generator.backend = "vllm"
    with pytest.raises(ConfigError, match="generator.backend = 'vllm'"):
        parse(c)
    c.generator.backend = "local"
    config = parse(c)
    rules = normalize_rules(config.sharding_rules)
    meshes = builders.role_meshes_for(config)
    _, model = builders.build(config, meshes["trainer"], rules)
    with pytest.raises(ValueError, match="generator.backend = 'vllm'"):
        builders.make_backend(config.replace(generator__backend="vllm"), model, 0, meshes, rules)



BACKEND_OF_ONES_OWN = '''
"""A rollout backend of one's own: the local generator behind a wrapper that counts submits, in one file."""
from arealjax.generation import local

OWNS_GENERATOR_DEVICES = True
SUBMITTED = []


def check(config, problems):
    local.check(config, problems)
    problems.need(config.generator.slots <= 16, "generator.slots", "≤ 16 with the counting backend")


class Counting:
    def __init__(self, inner):
        self.inner = inner

    def submit(self, prompt, sampling, **kw):
        SUBMITTED.append(list(prompt))
        return self.inner.submit(prompt, sampling, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def build(config, model, version, meshes, rules, workdir=None):
    generator, transport = local.build(config, model, version, meshes, rules, workdir)
    return Counting(generator), transport
'''


def test_a_backend_of_ones_own_is_one_file(tmp_path, monkeypatch):
    """generator.backend names any module with build, check and OWNS_GENERATOR_DEVICES: the start-up check runs
    its check, the builders build it, and it serves the controller; nothing else in arealjax changes."""

    (tmp_path / "counting_backend.py").write_text(BACKEND_OF_ONES_OWN)
    monkeypatch.syspath_prepend(str(tmp_path))
    c = small_config()
    c.generator.backend = "counting_backend"
    c.generator.slots = 32
    with pytest.raises(ConfigError, match=r"generator\.slots = 32: expected ≤ 16 with the counting backend"):
        parse(c)
    c.generator.slots = 8
    parse(c)
    rules = normalize_rules(c.sharding_rules)
    meshes = builders.role_meshes_for(parse(c))
    tokenizer, model = builders.build(parse(c), meshes["trainer"], rules)
    backend, transport = builders.make_backend(parse(c), model, 0, meshes, rules)
    import counting_backend

    try:
        assert isinstance(backend, counting_backend.Counting) and isinstance(backend, RolloutBackend)
        sampling = SamplingParams(max_new_tokens=4, n=2, stop_token_ids=tuple(tokenizer.eos_ids), seed=1)
        with RewardService(c.rewards.fn, workers=1) as rewards:
            controller = RolloutController(backend, rewards, tokenizer, train_prompts(parse(c), tokenizer),
                                           StalenessManager(2, 0, 2), sampling,
                                           AdvantageConfig(filter_uniform=False)).start()
            try:
                assert len(controller.get_batch(0)) == 2
            finally:
                controller.stop()
        assert len(counting_backend.SUBMITTED) >= 2
        transport.push(model.params, 1).result(timeout=60)
        assert backend.version == 1
    finally:
        backend.close()
