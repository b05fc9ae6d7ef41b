"""The package layout's rules (DESIGN.md's layer table), checked by parsing every import with ``ast``, function-level
imports included:

1. no package imports a package of a higher layer;
2. the packages' import graph has no circle (packages of one layer may import each other, never both ways);
3. the files' import graph has no circle. A package ``__init__`` that imports its own modules so they register
   (the registry pattern: the modules read the registry objects defined above those imports) is not a circle.
"""

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "tidal"

LAYER = {
    "types": 0, "registry": 0, "config": 0, "utils": 0, "inspector": 0,
    "api": 1,
    "algo": 2, "rewards": 2, "envs": 2, "tasks": 2, "optim": 2, "models": 2,
    "rollout": 3, "train": 3, "data": 3,  # train: the RL step; data: its RL blocks sample with the rollout engine
    "integrity": 4, "distill": 4, "serve": 4,  # SDC detection and fault injection; teacher data; the OpenAI endpoint
    "parallel": 5,  # FSDP2, DiLoCo, elastic replicas: handed to the trainer, never imported by train/
    "stages": 6,  # supervised stages around RL (warm start, pre-training with DiLoCo, SFT, DPO, reward models)
    "system": 7,  # the controller, its admission rules and the run's wiring
    "launch": 8, "sim": 8, "recipes": 8,  # launch: torchrun and elastic processes around a run
    "bench": 9, "cli": 9,
}
NO_TORCH = {"rewards", "envs"}  # reward workers must start fast and never pay for torch


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def _imports(path: Path) -> list[str]:
    """Every absolute import in the file (``from a import b`` counts ``a`` and ``a.b``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return names


def _resolve(name: str) -> str | None:
    """The tidal module an imported name lives in (``tidal.algo.POLICY_LOSSES`` -> ``tidal.algo``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _file_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in MODULES.items():
        registers = path.name == "__init__.py"
        for name in _imports(path):
            target = _resolve(name) if name.startswith("tidal.") else None
            if target is None or target in (mod, "tidal"):
                continue
            if registers and target.startswith(mod + "."):
                continue  # the registry pattern (see the module docstring)
            graph[mod].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_every_package_has_a_layer():
    top = {_package(m) for m in MODULES if m != "tidal"}
    assert top <= set(LAYER), f"add these to the layer table: {sorted(top - set(LAYER))}"


def test_lower_layers_never_import_higher_ones():
    violations = []
    for mod, path in MODULES.items():
        if mod == "tidal":
            continue
        mine = _package(mod)
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "tidal" and len(parts) > 1 and parts[1] in LAYER and LAYER[parts[1]] > LAYER[mine]:
                violations.append(f"{mod} (L{LAYER[mine]}) imports {name} (L{LAYER[parts[1]]})")
            if parts[0] == "torch" and mine in NO_TORCH:
                violations.append(f"{mod} imports torch")
    assert not violations, "\n".join(violations)


def test_no_import_circles_between_packages():
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, targets in _file_graph().items():
        graph[_package(mod)] |= {_package(t) for t in targets if _package(t) != _package(mod)}
    assert not _circles(graph), f"package import circles: {_circles(graph)}"


def test_no_import_circles_between_files():
    assert not _circles(_file_graph()), f"file import circles: {_circles(_file_graph())}"


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_training_step_never_imports_a_strategy_or_a_stage():
    """The inversion the layout rests on: train/ receives its data-parallel strategy (train/data_parallel.py)."""
    graph = _file_graph()
    bad = sorted((m, t) for m, ts in graph.items() if _package(m) == "train" for t in ts
                 if _package(t) in ("parallel", "integrity", "stages", "system"))
    assert not bad, bad
