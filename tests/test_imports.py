"""Imports run one way between the source folders, and never in a circle.

The three portions of `text_generation_server` stack: kernels <- quantizers <- server. A kernels
module imports nothing else of the project; a quantizers module imports quantizers and kernels
only. And no module reaches itself through imports, however deferred: an import inside a
function, under TYPE_CHECKING or through `importlib.import_module("...")` counts like one at the
top of the file, because deferring is how a cycle hides, not how it goes away.

The graph is read from the source with `ast`, never by importing it. Importing `a.b.c` runs
`a/__init__.py` and `a/b/__init__.py` first, so a module depends on every package above it and
on every package above what it imports: a package `__init__.py` that imports its own submodules
is a cycle with each of them (keep a package's `__init__.py` a docstring).
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "text_generation_server"
# Portions bottom-up: each may import itself and the ones before it.
PORTIONS = ("kernels", "quantizers", "server")
GENERATED = (f"{NAMESPACE}.pb",)  # protobuf stubs: generated from proto/, checked by test_proto_stubs
SERVER_TOP = {"cli", "settings", "launcher", "router", "shard", "engine", "models", "layers", "generation", "jobs",
              "utils", "pb", "assets"}


@dataclass(frozen=True)
class Module:
    name: str  # dotted; a package is named by its folder
    path: Path
    shown: str  # the path as messages print it: relative to the tree's root
    portion: str
    is_package: bool


@dataclass(frozen=True)
class Edge:
    """One import: `source` imports (or, as a submodule, runs) `target`, at path:line."""

    source: str
    target: str
    path: str  # as Module.shown
    line: int  # 0: not an import statement; the module is inside the package `target`

    def where(self) -> str:
        return f"{self.path}:{self.line}" if self.line else f"{self.path} (inside the package)"


def find_modules(root: Path, portions: tuple[str, ...] = PORTIONS) -> dict[str, Module]:
    """Every module of the portions under `root`, by dotted name (root/<portion>/text_generation_server/...)."""
    modules = {}
    for portion in portions:
        base = root / portion
        for path in sorted((base / NAMESPACE).rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            is_package = rel.name == "__init__"
            name = ".".join(rel.parts[:-1] if is_package else rel.parts)
            modules[name] = Module(name, path, path.relative_to(root).as_posix(), portion, is_package)
    return modules


def _chain(name: str) -> list[str]:
    """`a.b.c` -> [a, a.b, a.b.c]: what importing it runs."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _resolve(module: Module, name: str | None, level: int) -> str:
    """The absolute name of `from {'.' * level}{name} import ...` written in `module`."""
    if not level:
        return name or ""
    package = module.name.split(".")
    if not module.is_package:
        package = package[:-1]
    if level > 1:
        package = package[: -(level - 1)]
    return ".".join(package + ([name] if name else []))


def _imported_names(module: Module, node: ast.AST) -> list[str]:
    """The modules one AST node imports (possibly none, possibly outside the project)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _resolve(module, node.module, node.level)
        # `from pkg import name` imports pkg.name too when name is a submodule (filtered later).
        return [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if called == "import_module":  # importlib.import_module(name, package=None)
            name = node.args[0].value
            package = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "package"), None)
            if name.startswith(".") and isinstance(package, ast.Constant) and isinstance(package.value, str):
                level = len(name) - len(name.lstrip("."))
                anchor = Module(package.value, module.path, module.shown, module.portion, True)
                return [_resolve(anchor, name[level:] or None, level)]
            return [name]
        if called == "__import__":
            return [node.args[0].value]
    return []


def import_graph(modules: dict[str, Module], skip: tuple[str, ...] = GENERATED) -> dict[str, dict[str, Edge]]:
    """source -> target -> the first import of target in source, between project modules only.

    Every import in the file counts, wherever it is (module level, functions, methods,
    TYPE_CHECKING blocks). A module also depends on each package above it."""
    graph: dict[str, dict[str, Edge]] = {name: {} for name in modules}
    for module in modules.values():
        if any(module.name == s or module.name.startswith(s + ".") for s in skip):
            continue
        edges = graph[module.name]
        for parent in _chain(module.name)[:-1]:
            if parent in modules:
                edges[parent] = Edge(module.name, parent, module.shown, 0)
        tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))
        for node in ast.walk(tree):
            for name in _imported_names(module, node):
                for target in _chain(name):
                    if target in modules and target != module.name and target not in edges:
                        edges[target] = Edge(module.name, target, module.shown, node.lineno)
    return graph


def direction_violations(modules: dict[str, Module], graph: dict[str, dict[str, Edge]],
                         order: tuple[str, ...] = PORTIONS) -> list[str]:
    """Imports from a lower portion into a higher one ("kernels imports quantizers"), one message
    per import (importing a.b.c also runs a.b: only a.b.c is named)."""
    found = []
    for source, edges in graph.items():
        rank = order.index(modules[source].portion)
        upward = [e for e in edges.values() if order.index(modules[e.target].portion) > rank]
        for edge in upward:
            if any(o.line == edge.line and o.target.startswith(edge.target + ".") for o in upward):
                continue
            found.append(f"{edge.where()}: {modules[source].portion} module {source} imports "
                         f"{modules[edge.target].portion} module {edge.target}")
    return sorted(found)


def strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively; components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def _shortest_cycle(graph: dict[str, dict[str, Edge]], start: str, within: set[str]) -> list[Edge]:
    """The shortest path of imports from `start` back to itself inside one component."""
    came: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph[node]):
            if target not in within or target in came:
                continue
            came[target] = graph[node][target]
            if target == start:
                path = [came[start]]
                while path[-1].source != start:
                    path.append(came[path[-1].source])
                return path[::-1]
            queue.append(target)
    raise AssertionError(f"{start} is in a component but on no cycle")


SHOWN_CYCLES = 12  # per component; the rest of its modules are named


def cycles(graph: dict[str, dict[str, Edge]], component: list[str]) -> list[list[Edge]]:
    """Shortest cycles through the members of one component until each lies on one shown."""
    members = set(component)
    shown: set[str] = set()
    found = []
    for start in component:
        if start not in shown and len(found) < SHOWN_CYCLES:
            cycle = _shortest_cycle(graph, start, members)
            shown.update(edge.source for edge in cycle)
            found.append(cycle)
    return found


def describe(graph: dict[str, dict[str, Edge]], component: list[str]) -> str:
    """A component as its cycles, each a path of modules with the file:line of every import."""
    lines = [f"import cycle through {len(component)} modules:"]
    on_cycles: set[str] = set()
    for cycle in cycles(graph, component):
        lines.append(f"  {cycle[0].source}")
        lines += [f"    -> {edge.target}    ({edge.where()})" for edge in cycle]
        on_cycles.update(edge.source for edge in cycle)
    rest = [name for name in component if name not in on_cycles]
    if rest:
        lines.append(f"  and {len(rest)} more on cycles with these: {', '.join(rest)}")
    return "\n".join(lines)


def check(root: Path) -> list[str]:
    """Everything wrong with the imports of the tree at `root`, one message per upward import
    and per group of modules in a cycle (empty: all good)."""
    modules = find_modules(root)
    graph = import_graph(modules)
    return direction_violations(modules, graph) + [describe(graph, c) for c in strongly_connected(graph)]


# -- the project ----------------------------------------------------------------------------


def test_imports_point_down_the_portions_and_never_in_a_circle():
    modules = find_modules(REPO)
    assert {m.portion for m in modules.values()} == set(PORTIONS)
    assert len(modules) > 100, "the walk found too few modules to mean anything"
    graph = import_graph(modules)
    assert sum(map(len, graph.values())) > 300, "the walk found too few imports to mean anything"
    problems = check(REPO)
    assert not problems, f"{len(problems)} import problem(s):\n" + "\n".join(problems)


def test_server_modules_live_in_a_role_package():
    """The top of server/text_generation_server shows the processes and roles; only about.py
    (the version, read by the build) sits beside them."""
    top = REPO / "server" / NAMESPACE
    entries = {p.name for p in top.iterdir() if p.name != "__pycache__"}
    assert {p for p in entries if p.endswith(".py")} == {"about.py"}
    folders = {p.name for p in top.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == SERVER_TOP, f"unexpected: {sorted(folders - SERVER_TOP)}, missing: {sorted(SERVER_TOP - folders)}"


# -- the checker, on small trees --------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    """Writes {"kernels/a.py": source} as root/kernels/text_generation_server/kernels/a.py, with
    every package folder's __init__.py (a docstring) unless given."""
    for rel, source in files.items():
        portion, _, rest = rel.partition("/")
        top = root / portion / NAMESPACE
        path = top / (rest if portion == "server" else f"{portion}/{rest}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for portion in PORTIONS:
        for folder in (root / portion / NAMESPACE).rglob("*"):
            if folder.is_dir() and not (folder / "__init__.py").exists():
                (folder / "__init__.py").write_text('"""A package."""\n')
    return root


CLEAN = {
    "kernels/base.py": "import torch\n",
    "kernels/gemm.py": "from text_generation_server.kernels.base import x\nfrom . import base\n",
    "quantizers/sharding.py": "import math\n",
    "quantizers/weights.py": "from text_generation_server.kernels import gemm\n",
    "quantizers/gptq.py": "def load():\n    from .weights import W\n",
    "server/engine/step.py": "from text_generation_server.quantizers.gptq import load\n"
                             "import text_generation_server.kernels.gemm\n",
    "server/engine/warmup.py": "from text_generation_server.engine import step\n",
    "server/cli/main.py": "import importlib\nimportlib.import_module('text_generation_server.engine.warmup')\n",
}


def test_checker_passes_a_clean_tree(tmp_path):
    root = _tree(tmp_path, CLEAN)
    assert check(root) == []
    # and it saw the imports: deferred, relative, `from package import module`, importlib's
    graph = import_graph(find_modules(root))
    assert set(graph[f"{NAMESPACE}.quantizers.gptq"]) == {f"{NAMESPACE}.quantizers", f"{NAMESPACE}.quantizers.weights"}
    assert f"{NAMESPACE}.kernels.base" in graph[f"{NAMESPACE}.kernels.gemm"]
    assert f"{NAMESPACE}.engine.step" in graph[f"{NAMESPACE}.engine.warmup"]
    assert f"{NAMESPACE}.engine.warmup" in graph[f"{NAMESPACE}.cli.main"]
    # importing a.b.c runs a/__init__.py and a/b/__init__.py
    assert {f"{NAMESPACE}.kernels", f"{NAMESPACE}.kernels.gemm"} <= set(graph[f"{NAMESPACE}.engine.step"])


def test_checker_fails_an_upward_import(tmp_path):
    root = _tree(tmp_path, {**CLEAN, "kernels/base.py": "def f():\n    from text_generation_server.quantizers import"
                                                           " sharding\n"})
    assert check(root) == ["kernels/text_generation_server/kernels/base.py:2: kernels module "
                           "text_generation_server.kernels.base imports quantizers module "
                           "text_generation_server.quantizers.sharding"]
    root = _tree(tmp_path / "b", {**CLEAN, "quantizers/sharding.py": "import text_generation_server.engine.step\n"})
    assert check(root) == ["quantizers/text_generation_server/quantizers/sharding.py:1: quantizers module "
                           "text_generation_server.quantizers.sharding imports server module "
                           "text_generation_server.engine.step"]


def test_checker_fails_a_cycle_through_a_function_level_import(tmp_path):
    root = _tree(tmp_path, {**CLEAN, "server/engine/step.py": "class Step:\n    def warm(self):\n"
                                                              "        from text_generation_server.engine.warmup "
                                                              "import run\n"})
    assert check(root) == ["import cycle through 2 modules:\n"
                           "  text_generation_server.engine.step\n"
                           "    -> text_generation_server.engine.warmup    "
                           "(server/text_generation_server/engine/step.py:3)\n"
                           "    -> text_generation_server.engine.step    "
                           "(server/text_generation_server/engine/warmup.py:1)"]


@pytest.mark.parametrize("source", [
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine.warmup import run\n",
    "import importlib\ndef f():\n    importlib.import_module('.warmup', 'text_generation_server.engine')\n",
    "import text_generation_server.engine.warmup as w\n",
], ids=["type-only", "importlib-relative", "import-as"])
def test_checker_counts_every_kind_of_import(tmp_path, source):
    root = _tree(tmp_path, {**CLEAN, "server/engine/step.py": source})
    problems = check(root)
    assert len(problems) == 1 and problems[0].startswith("import cycle through 2 modules:"), problems


def test_checker_fails_a_package_that_imports_its_own_modules(tmp_path):
    """The package's __init__ (run before any of its modules) imports one of them: a cycle
    through the package, shown as the module running it."""
    root = _tree(tmp_path, {**CLEAN, "quantizers/__init__.py": "from text_generation_server.quantizers.sharding "
                                                                "import f\n"})
    assert check(root) == ["import cycle through 2 modules:\n"
                           "  text_generation_server.quantizers\n"
                           "    -> text_generation_server.quantizers.sharding    "
                           "(quantizers/text_generation_server/quantizers/__init__.py:1)\n"
                           "    -> text_generation_server.quantizers    "
                           "(quantizers/text_generation_server/quantizers/sharding.py (inside the package))"]
