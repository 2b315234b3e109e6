"""The config files: `key=value` arguments (arealjax.validate.parse_arg), every recipe variant builds, no recipe sets
a key the default job lacks (a typo would be a new key), and every key the code reads exists in the default job."""

import ast
import dataclasses
import inspect
from pathlib import Path

import ml_collections
import pytest

from arealjax.config import parse
from arealjax.data import TASKS
from arealjax.models import ModelConfig
from arealjax.validate import parse_arg
from configs import code, default, longtail, math, smollm2

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------- parse_arg


def test_parse_arg_defaults_and_typed_values():
    defaults = dict(model="qwen3-1.7b", data="", steps=3, lr=1e-3, lora=False)
    for arg in (None, ""):
        assert parse_arg(arg, "configs/x.py", **defaults).to_dict() == defaults
    got = parse_arg("data=gsm8k,steps=7,lr=2,lora=true", "configs/x.py", **defaults)
    assert got.to_dict() == dict(model="qwen3-1.7b", data="gsm8k", steps=7, lr=2.0, lora=True)
    assert type(got.lr) is float and type(got.steps) is int and got.lora is True
    assert parse_arg("lora=False", "configs/x.py", **defaults).lora is False
    assert parse_arg(" model = tiny ", "configs/x.py", **defaults).model == "tiny"
    assert parse_arg(None, "configs/default.py").to_dict() == {}


@pytest.mark.parametrize("arg, says", [
    ("modl=x", "unknown key 'modl'"),
    ("model", "'model' is not key=value"),
    ("model=tiny,", "'' is not key=value"),
    ("steps=1.5", "'steps=1.5': '1.5' is not an integer"),
    ("lr=fast", "'lr=fast': 'fast' is not a number"),
    ("lora=yes", "'lora=yes': 'yes' is not true or false"),
    ("model=a,model=b", "'model' is given twice"),
])
def test_parse_arg_errors_name_the_file_the_argument_the_part_and_the_keys(arg, says):
    with pytest.raises(ValueError) as e:
        parse_arg(arg, "configs/x.py", model="qwen3-1.7b", steps=3, lr=1e-3, lora=False)
    assert str(e.value).startswith(f"configs/x.py:{arg}: "), e.value
    assert says in str(e.value) and str(e.value).endswith("expected model, steps, lr, lora"), e.value


def test_a_config_without_arguments_refuses_one():
    with pytest.raises(ValueError, match="configs/longtail.py:model=tiny: .*takes none"):
        longtail.get_config("model=tiny")
    with pytest.raises(ValueError, match="configs/default.py: model=tiny: expected dense or moe"):
        default.get_config("model=tiny")
    with pytest.raises(TypeError, match="default of 'k'"):
        parse_arg("k=1", "configs/x.py", k=None)


# ------------------------------------------------------------------------------------------------ the recipes

VARIANTS = (
    [("math", f"model={m},data={d}") for m in math.MODELS if not m.startswith("tiny") for d in math.DATASETS]
    + [("math", f"model={m}") for m in math.MODELS]
    + [("math", f"model={m},data={d}") for m in ("tiny", "tiny-moe") for d in math.TINY_DATASETS]
    + [("math", ""), ("code", "")] + [("code", f"model={m}") for m in code.MODELS]
    + [("smollm2", ""), ("smollm2", "device=cpu"), ("smollm2", "device=gpu"), ("smollm2", "reward=judge"),
       ("longtail", ""), ("default", ""), ("default", "model=moe")])
MODULES = {"math": math, "code": code, "smollm2": smollm2, "longtail": longtail, "default": default}


def variant(name: str, arg: str) -> ml_collections.ConfigDict:
    return MODULES[name].get_config(arg or None)


@pytest.mark.parametrize("name, arg", VARIANTS)
def test_every_recipe_variant_builds(name, arg):
    """And parses into typed sections: every key it sets is a field of its section, of the field's kind (the
    values' checks need the model and data paths, absent here)."""
    config = variant(name, arg)
    assert config.rl.max_new_tokens > 0 and config.trainer.max_tokens >= config.data.max_prompt_tokens
    assert parse(config, check=False).rl.max_new_tokens == config.rl.max_new_tokens
    if "model=tiny" in arg:
        assert config.model_path.startswith(f"{math.TINY}/") and config.cpu_devices == 4
    if name == "math" and "data=" in arg:
        tiny = "model=tiny" in arg
        paths, root = (math.TINY_DATASETS, f"{math.TINY}/tfds") if tiny else (math.DATASETS, math.TFDS)
        assert config.data.path == f"{root}/{paths[arg.rsplit('data=', 1)[1]][0]}"


def paths_in(config) -> list[str]:
    """Every string value of a config that names an absolute path."""
    out = []
    for value in config.values():
        if isinstance(value, ml_collections.ConfigDict):
            out += paths_in(value)
        elif isinstance(value, dict):
            out += paths_in(ml_collections.ConfigDict(value))
        elif isinstance(value, str) and value.startswith("/"):
            out.append(value)
    return out


@pytest.mark.parametrize("name, arg, roots", [
    ("smollm2", "root=/mine", ("/mine",)), ("smollm2", "root=/mine,device=gpu", ("/mine",)),
    ("smollm2", "root=/mine,reward=judge", ("/mine",)),  # the judge served is the base model under root
    ("math", "ckpt=/mine/ckpt,tfds=/mine/tfds", ("/mine/ckpt", "/mine/tfds")),
    ("math", "model=tiny-moe,data=math,ckpt=/mine,tfds=/mine/tfds", ("/mine",)),
    ("code", "ckpt=/mine/ckpt,tfds=/mine/tfds", ("/mine/ckpt", "/mine/tfds")),
    ("code", "model=tiny,ckpt=/mine,tfds=/mine/tfds", ("/mine",)),
])
def test_one_argument_per_root_moves_every_path_a_recipe_reads(name, arg, roots):
    """A user who converted the model and data somewhere else gives the recipe that directory, not three keys:
    every path of the config (model, data, SFT data) is then under the roots given, none under the defaults."""
    config = variant(name, arg)
    paths = paths_in(config)
    assert config.model_path in paths and config.data.path in paths, paths
    assert all(path.startswith(roots) for path in paths), paths
    default_paths = paths_in(variant(name, ",".join(p for p in arg.split(",") if "/" not in p)))
    assert len(default_paths) == len(paths) and not set(default_paths) & set(paths), default_paths


def test_the_variants_differ_where_the_arguments_say():
    assert math.get_config().model_path == "/ckpt/Qwen3-1.7B"  # no argument: the default model and its dataset
    assert math.get_config().data.path == f"{math.TFDS}/{math.DATASETS['deepscaler'][0]}"
    assert math.get_config("model=qwen3-1.7b,data=gsm8k").data.max_prompt_tokens == 512
    assert code.get_config().model_path == "/ckpt/DeepSeek-R1-Distill-Qwen-1.5B"
    cpu, gpu = smollm2.get_config(), smollm2.get_config("device=gpu")
    assert cpu.to_dict() == smollm2.get_config("device=cpu").to_dict()
    assert (cpu.cpu_devices, cpu.lora.rank, cpu.rl.steps) == (2, 32, 20)
    assert (gpu.cpu_devices, gpu.lora.rank, gpu.rl.steps) == (0, 0, 250)
    judged = smollm2.get_config("reward=judge")
    assert (judged.rewards.fn, judged.rewards.judge.serve, judged.rewards.judge.parse) == (
        "arealjax.rewards.judge:judge", judged.model_path, "yes_no")
    assert "{answer}" in judged.rewards.judge.prompt and cpu.rewards.fn == "arealjax.rewards.math:math_reward"


@pytest.mark.parametrize("name, arg, says", [
    ("math", "model=qwen9", "model=qwen9: unknown model; expected one of qwen3-0.6b, "),
    ("math", "model=qwen3-0.6b,data=aime", "data=aime: unknown dataset for model=qwen3-0.6b; expected one of gsm8k, "
                                           "math, deepscaler"),
    ("math", "model=tiny,data=deepscaler", "data=deepscaler: unknown dataset for model=tiny; expected one of gsm8k, "
                                           "math"),
    ("math", "dataset=gsm8k", "unknown key 'dataset'; expected model, data, ckpt, tfds"),
    ("math", "qwen3-1.7b", "'qwen3-1.7b' is not key=value; expected model, data, ckpt, tfds"),
    ("code", "model=qwen9", "model=qwen9: unknown model; expected one of qwen3-0.6b, "),
    ("smollm2", "device=tpu", "device=tpu: expected one of cpu, gpu"),
    ("smollm2", "reward=llm", "reward=llm: expected one of rule, judge"),
    ("smollm2", "gpu", "'gpu' is not key=value; expected root, device"),
])
def test_a_bad_argument_names_the_allowed_values(name, arg, says):
    with pytest.raises(ValueError, match=f"^configs/{name}.py") as e:
        variant(name, arg)
    assert says in str(e.value), e.value
    if "unknown model" in says:
        assert str(e.value).endswith(", tiny" + (", tiny-moe" if name == "math" else "")), e.value


def test_no_recipe_imports_another():
    for name in ("math", "code", "smollm2", "longtail"):
        tree = ast.parse((ROOT / "configs" / f"{name}.py").read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "configs"
                    for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                     and n.module.startswith("configs.")}
        assert imported <= {"default"}, (name, imported)


# ------------------------------------------------------------------------------------------ no phantom keys

# Sections whose keys are checked at start-up by the dataclass (or function) they are passed to, not by the
# default job's keys: a recipe may set keys there that the default leaves at their defaults.
FREE = ("advantage", "trainer.ppo", "trainer.optim", "sft.optim", "sft.data", "wandb", "workflow.kwargs", "mesh")


def key_paths(config, prefix=""):
    for key, value in config.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, (ml_collections.ConfigDict, dict)) and path not in FREE and path != "task":
            yield from key_paths(value, f"{path}.")


def phantom_keys(config: ml_collections.ConfigDict) -> list[str]:
    """Keys of `config` the default job has not (outside FREE); `task`: its keys must be the synthetic task's
    (`sample_problems` keyword arguments, with name and seed); `model`: ModelConfig's fields."""
    known = set(key_paths(default.get_config()))
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    out = [p for p in key_paths(config) if p not in known and not (p.startswith("model.") and p[6:] in fields)]
    if config.task.name in TASKS:
        params = set(inspect.signature(TASKS[config.task.name].sample_problems).parameters) - {"n"}
        out += [f"task.{k}" for k in config.task if k not in params | {"name"}]
    return out


@pytest.mark.parametrize("name, arg", VARIANTS)
def test_no_phantom_keys(name, arg):
    assert phantom_keys(variant(name, arg)) == []


def test_a_phantom_key_is_caught():
    config = math.get_config("model=tiny")
    config.rl.max_staleneess = 4
    config.eval.nn = 2
    config.task.median_step = 3.0
    config.trainer.optim.b3 = 0.9  # a free section: the optimizer's dataclass checks it at start-up
    config.model = ml_collections.ConfigDict({"num_experts": 8, "num_expert": 8})  # ModelConfig's fields only
    assert sorted(phantom_keys(config)) == ["eval.nn", "model.num_expert", "rl.max_staleneess", "task.median_step"]


# ------------------------------------------------------------------------------- every key read exists

# ConfigDict / dict methods: a chain may end in one at a section.
METHODS = {"to_dict", "copy_and_resolve_references", "unlocked", "get", "items", "keys", "values", "to_json",
           "to_json_best_effort", "lock", "unlock", "is_locked", "get_ref", "update", "ignore_type", "to_yaml"}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _step(node: ast.AST) -> tuple[ast.AST, str] | None:
    """(inner expression, key) of one step of a chain: `x.key`, `x["key"]`, `x.get("key", ...)`."""
    if isinstance(node, ast.Attribute):
        return node.value, node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.value, node.slice.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.func.value, node.args[0].value
    return None


def _chain(node: ast.AST, roots: dict[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    """The key path `node` reads from the run config, given the names that hold a part of it (`roots`)."""
    keys = []
    while (step := _step(node)) is not None:
        node, key = step
        keys.append(key)
    if isinstance(node, ast.Name) and node.id in roots:
        return roots[node.id] + tuple(reversed(keys))
    return None


def _own_nodes(scope: ast.AST):
    """The nodes of `scope` outside the functions it defines (those are scopes of their own)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def _pairs(node: ast.Assign):
    """(name, value) of `a = x` and `a, b = x, y`."""
    for target in node.targets:
        if isinstance(target, ast.Name):
            yield target.id, node.value
        elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(target.elts) == len(
                node.value.elts):
            yield from ((t.id, v) for t, v in zip(target.elts, node.value.elts) if isinstance(t, ast.Name))


def _is_run_config(value: ast.AST) -> bool:
    """`config = <this>` keeps `config` the run config: `self.config`, `FLAGS.config`, `config.copy_...()`."""
    if isinstance(value, ast.Attribute) and value.attr == "config":
        return True
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and isinstance(value.func.value, ast.Name) and value.func.value.id == "config")


def _scan_scope(scope: ast.AST, roots: dict[str, tuple[str, ...]], out: list):
    nodes = list(_own_nodes(scope))
    params = set()
    if isinstance(scope, SCOPES):
        a = scope.args
        params = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}
    stores: dict[str, int] = {}
    for node in nodes:
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            stores[node.id] = stores.get(node.id, 0) + 1
    assigns = [pair for node in nodes if isinstance(node, ast.Assign) for pair in _pairs(node)]
    roots = {k: v for k, v in roots.items() if k not in params and k not in stores}  # rebound here: not ours
    if "config" in params or "config" in stores:
        foreign = stores.get("config", 0) > sum(1 for name, v in assigns if name == "config" and _is_run_config(v))
        if not foreign:
            roots["config"] = ()
    while True:  # aliases (`rl = config.rl`, `rl, g = config.rl, config.generator`), each bound once here
        new = {name: path for name, value in assigns if name not in roots and name not in params
               and stores.get(name) == 1 and (path := _chain(value, roots)) is not None}
        if not new:
            break
        roots.update(new)
    inner = {id(_step(n)[0]) for n in nodes if _step(n) is not None}
    inner |= {id(n.func) for n in nodes if isinstance(n, ast.Call) and _step(n) is not None}
    for node in nodes:
        if id(node) not in inner and _step(node) is not None and (path := _chain(node, roots)) is not None:
            out.append((node.lineno, path))
        if isinstance(node, SCOPES):
            _scan_scope(node, roots, out)


def config_reads(source: str) -> list[tuple[int, tuple[str, ...]]]:
    """(line, key path) of every chain read from the run config in `source`: rooted at a name `config` (unless the
    scope binds `config` to something else) or at a name bound once in its function to such a chain."""
    out: list = []
    _scan_scope(ast.parse(source), {}, out)
    return out


def missing(path: tuple[str, ...], config) -> str | None:
    """The first key of `path` that `config` lacks, as 'a.b.c' (None: the path resolves, ends in a section's
    method, or goes on into a value's own attributes)."""
    node = config
    for i, key in enumerate(path):
        if not isinstance(node, (ml_collections.ConfigDict, dict)):
            return None
        if key in node:
            node = node[key]
        elif key in METHODS:
            return None
        else:
            return ".".join(path[:i + 1])
    return None


def code_files():
    return [ROOT / "main.py", *sorted((ROOT / "arealjax").rglob("*.py"))]


def test_the_scan_reports_a_key_the_default_lacks():
    source = '''
def f(config):
    rl, g = config.rl, config.generator
    top = rl.top_p, rl.top_pp, g["slots"], g.get("slotz", 1), config.get("rl").get("top_k")
    d = config.data
    return config.rl.top_pp, d.path.split("/"), config.eval.k[0], config.rl.to_dict(), d.get("pathh")


def g(config):
    config = {"top_pp": 1}
    return config["top_pp"]
'''
    reads = config_reads(source)
    assert (4, ("rl", "top_p")) in reads and (4, ("rl", "top_k")) in reads and (6, ("data", "path", "split")) in reads
    misses = sorted({m for _, path in reads if (m := missing(path, default.get_config()))})
    assert misses == ["data.pathh", "generator.slotz", "rl.top_pp"]


def test_every_key_the_code_reads_exists_in_the_default_job():
    config = default.get_config()
    reads, misses = 0, []
    for file in code_files():
        for line, path in config_reads(file.read_text()):
            reads += 1
            if (key := missing(path, config)) is not None:
                misses.append(f"{file.relative_to(ROOT)}:{line}: {'.'.join(path)} ({key} is no key)")
    assert reads > 150, f"the scan found only {reads} config reads"
    assert not misses, "\n".join(misses)
