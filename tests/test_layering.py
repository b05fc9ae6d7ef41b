"""Lower layers never import higher ones (DESIGN.md's layer table), checked by parsing imports."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "tidal"

LAYER = {
    "types": 0, "registry": 0, "config": 0, "utils": 0, "inspector": 0,
    "api": 1,
    "algo": 2, "rewards": 2, "envs": 2, "tasks": 2, "optim": 2, "models": 2,
    "rollout": 3, "train": 3, "data": 3,  # data: its RL blocks sample with the rollout engine
    "system": 4, "sim": 4, "serve": 4, "distill": 4, "stages": 4,  # serve: the OpenAI endpoint; distill: teacher data, students
    "bench": 5, "cli": 5, "recipes": 5,
}
NO_TORCH = {"rewards", "envs"}  # reward workers must start fast and never pay for torch


def _module_of(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_every_module_has_a_layer():
    top = {_module_of(p) for p in PKG.rglob("*.py") if p.name != "__init__.py" or p.parent != PKG}
    assert top <= set(LAYER), f"add these to the layer table: {sorted(top - set(LAYER))}"


def test_lower_layers_never_import_higher_ones():
    violations = []
    for path in PKG.rglob("*.py"):
        if path.parent == PKG and path.name == "__init__.py":
            continue
        mine = _module_of(path)
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "tidal" and len(parts) > 1:
                theirs = parts[1]
                if theirs in LAYER and LAYER[theirs] > LAYER[mine]:
                    violations.append(f"{path.relative_to(PKG)} (L{LAYER[mine]}) imports {name} (L{LAYER[theirs]})")
            if parts[0] == "torch" and mine in NO_TORCH:
                violations.append(f"{path.relative_to(PKG)} imports torch")
    assert not violations, "\n".join(violations)
