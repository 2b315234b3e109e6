"""The package's layering: no import cycles between arealjax modules, and the lower layers (the model, sharding, the
process runtime) import nothing of the layers above them.

Checked twice: statically, over the imports of every module under arealjax/ (at module level and inside functions,
`import arealjax.x`, `from arealjax import x` and `from arealjax.x import y` all resolved to the module they load;
imports under `if TYPE_CHECKING:` never run and are left out), and at run time, in a fresh interpreter. A new rule
is a line in FORBIDDEN or LOADED below.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "arealjax"

ABOVE_THE_MODEL = ("arealjax.runtime", "arealjax.distributed", "arealjax.train", "arealjax.controller")

# module (a package covers its submodules) -> arealjax modules it must not import, directly or through others
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "arealjax.models": ABOVE_THE_MODEL,
    "arealjax.sharding": ABOVE_THE_MODEL,
    "arealjax.runtime": ("arealjax",),  # the leaf: main.py imports it first, everything may import it
    "arealjax.distributed": ("arealjax.train", "arealjax.controller"),
    # a rollout backend is reached through arealjax.api only (tests/test_api.py: evaluate.py, directly)
    "arealjax.controller": ("arealjax.generation",),
    "arealjax.workflows": ("arealjax.generation",),
    # the backends sit below the loop that builds them (a generation server runs one without the loop)
    "arealjax.generation": ("arealjax.builders", "arealjax.train", "arealjax.export", "arealjax.config",
                            "arealjax.controller", "arealjax.sft", "arealjax.evaluate"),
    "arealjax.validate": ("arealjax",),  # what every component's check imports
}

# module -> modules (a package covers its submodules) that `import module` must leave unloaded in a fresh interpreter
HEAVY = ("torch", "transformers", "tensorflow", "orbax", "grain", "matplotlib", "tensorboardX")  # (flax loads optax)
LOADED: dict[str, tuple[str, ...]] = {
    "arealjax.models": ABOVE_THE_MODEL + HEAVY,
    "arealjax.sharding": ABOVE_THE_MODEL + HEAVY,
    "arealjax.runtime": ("arealjax.distributed", "arealjax.sharding", "jax"),  # signals are caught before JAX loads
    # a generation server reads the wire and its flags before it configures JAX (--devices, --cpus)
    "arealjax.generation": ("jax",),
    "arealjax.generation.rpc": ("jax",),
    # what main.py loads for every run: datasets on disk are read through tensorflow_datasets, loaded only for them
    # (~0.2 s of each start; the suite starts main.py some 150 times)
    "arealjax.train": ("tensorflow_datasets", "torch", "transformers"),
    "arealjax.export": ("tensorflow_datasets", "torch", "transformers"),
}


def covers(name: str, module: str) -> bool:
    """Whether rule entry `name` (a module or a package) covers `module`."""
    return module == name or module.startswith(name + ".")


def find_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its __init__.py)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, module: str, is_package: bool, modules: set[str]) -> dict[str, int]:
    """The arealjax modules that `module`'s source imports anywhere in it -> the line of the first such import.
    `from p import x` is module p.x when that is a module, else p (x is a name defined in p)."""
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        while target not in modules and "." in target:  # `import a.b.c` where only a.b is ours: the longest known
            target = target.rpartition(".")[0]
        if target in modules and target != module:
            found.setdefault(target, line)

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if _is_type_checking(node.test):  # annotations only: never executed
                for child in node.orelse:
                    self.visit(child)
            else:
                self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            for alias in node.names:
                if covers(PACKAGE, alias.name):
                    add(alias.name, node.lineno)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:  # relative: from the package holding `module`
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not covers(PACKAGE, base):
                return
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base, node.lineno)

    Visitor().visit(ast.parse(source))
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported arealjax module: line}, over the whole package."""
    modules = find_modules()
    names = set(modules)
    return {m: imports_of(p.read_text(), m, p.name == "__init__.py", names) for m, p in modules.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (its path, first module repeated at the end) per strongly connected component of size > 1 (Tarjan),
    plus self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def connect(v: str) -> None:  # recursion depth ≤ number of modules
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(sorted(c), graph) for c in components]


def _cycle_in(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest cycle through the component's first module, staying inside the component (breadth first)."""
    start, inside = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w not in inside:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if v != start else [start, start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle in component {component}")


def describe(path: list[str], graph: dict[str, dict[str, int]]) -> str:
    """'a (line 3) -> b (line 9) -> a': each import with the line that makes it (a step from a module to a package
    holding it: loading the module runs the package's __init__)."""
    steps = [f"{a} (line {graph[a][b]})" if b in graph[a] else f"{a} (package __init__)"
             for a, b in zip(path, path[1:])]
    return " -> ".join([*steps, path[-1]])


def reachable(graph: dict[str, dict[str, int]], start: str) -> dict[str, str | None]:
    """Every module loaded by importing `start` -> the module it was reached from. Importing a.b.c also runs the
    __init__ of a and a.b, so those count as loaded too (reached from a.b.c)."""
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        parts = v.split(".")
        parents = {".".join(parts[:i]) for i in range(1, len(parts))} & set(graph)
        for w in sorted(set(graph[v]) | parents):
            if w not in parent:
                parent[w] = v
                queue.append(w)
    return parent


def chain(parent: dict[str, str | None], end: str) -> list[str]:
    out = [end]
    while parent[out[-1]] is not None:
        out.append(parent[out[-1]])
    return out[::-1]


GRAPH = import_graph()


def test_the_parser_resolves_every_import_form():
    modules = {"arealjax", "arealjax.a", "arealjax.b", "arealjax.b.c", "arealjax.d", "arealjax.e", "arealjax.f",
               "arealjax.g"}
    source = """
from typing import TYPE_CHECKING
import os
import arealjax.a
from arealjax import b, not_a_module
from arealjax.b import c
from . import d

def later():
    from arealjax.e import something

if TYPE_CHECKING:
    from arealjax.f import Only
else:
    import arealjax.g.deeper
"""
    found = imports_of(source, "arealjax.x", False, modules)
    assert found == {"arealjax.a": 4, "arealjax.b": 5, "arealjax": 5, "arealjax.b.c": 6, "arealjax.d": 7,
                     "arealjax.e": 10, "arealjax.g": 15}
    assert find_cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_the_graph_covers_the_package():
    assert len(GRAPH) > 20
    assert "arealjax.runtime" in GRAPH["arealjax.distributed"]
    assert "arealjax.models.transformer" in GRAPH["arealjax.models"]


def test_no_import_cycles():
    cycles = find_cycles(GRAPH)
    assert not cycles, "import cycles between arealjax modules:\n" + "\n".join(
        "  " + describe(c, GRAPH) for c in cycles)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_nothing_above_it(layer):
    shortest: dict[str, list[str]] = {}  # forbidden module reached -> the shortest chain that reaches it
    for module in sorted(m for m in GRAPH if covers(layer, m)):
        parent = reachable(GRAPH, module)
        for bad in FORBIDDEN[layer]:  # the module's own packages are no import of its: they load before it
            for hit in (m for m in parent if covers(bad, m) and not covers(layer, m) and not covers(m, module)):
                path = chain(parent, hit)
                if hit not in shortest or len(path) < len(shortest[hit]):
                    shortest[hit] = path
    assert not shortest, f"{layer} must not import {FORBIDDEN[layer]}:\n" + "\n".join(
        f"  {describe(shortest[hit], GRAPH)}" for hit in sorted(shortest))


@pytest.mark.parametrize("module", sorted(LOADED))
def test_importing_loads_nothing_above_it(module):
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    bad = sorted(m for m in loaded for name in LOADED[module] if covers(name, m))
    assert not bad, f"`import {module}` loads {bad}"


def test_a_runs_metrics_writer_loads_no_torch(tmp_path):
    """torch (requirements-dev, for parity tests) is no runtime dependency: tensorboardX would import it, 1-2 s of
    every main.py start, to accept torch tensors, and Google Cloud Storage (installed with gcsfs, ~0.3 s) for gs://
    event files; the writer leaves both out and still writes its event file in the workdir."""
    code = ("import sys; from arealjax.metrics import MetricsWriter; w = MetricsWriter(sys.argv[1]); "
            "w.write(1, {'reward': 0.5}); w.close(); print([m for m in ('torch', 'google.cloud.storage') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]", f"MetricsWriter imported {out.stdout.splitlines()[-1]}"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_requirement_lines_ask_for_no_extras():
    """An extra a requirement line asks for travels into that package's own requirements, where pip 23.2 (what a
    fresh Python 3.11 venv brings) may not match its spelling: `math-verify[antlr4-13-2]` warned on every install
    that latex2sympy2-extended has no extra 'antlr4_13_2'. The package the extra would add is its own line instead.
    (The accelerator extras, `jax[cuda12]` and `jax[tpu]`, are the user's install command, not a line here.)"""
    for name in ("requirements.txt", "requirements-dev.txt", "benchmarks/requirements.txt"):
        for n, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            spec = line.split("#", 1)[0].strip()
            assert "[" not in spec, f"{name}:{n}: {spec!r} asks for an extra; name what it adds on its own line"
