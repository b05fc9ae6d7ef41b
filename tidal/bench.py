"""``tidal bench NAME``: run ``benchmarks/NAME.py`` and print its table plus JSON.

A benchmark module defines ``DESCRIPTION`` and ``run(overrides: list[str], out_dir: Path) -> dict``
returning ``{"table": [row dicts], ...}``. Results are written to ``benchmarks/results/NAME.json``.
Benchmarks live in the repository (not the installed package), so ``tidal bench`` looks for them
in ``./benchmarks`` and next to the package's source checkout.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path


def _benchmark_dirs() -> list[Path]:
    return [Path.cwd() / "benchmarks", Path(__file__).resolve().parent.parent / "benchmarks"]


def available() -> list[str]:
    names = set()
    for d in _benchmark_dirs():
        names.update(p.stem for p in d.glob("*.py") if not p.stem.startswith("_"))
    return sorted(names)


def load(name: str):
    for d in _benchmark_dirs():
        path = d / f"{name}.py"
        if path.exists():
            spec = importlib.util.spec_from_file_location(f"tidal_benchmark_{name}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses in the benchmark look their module up here
            spec.loader.exec_module(module)
            return module
    raise FileNotFoundError(f"no benchmark {name!r}; available: {', '.join(available()) or 'none'} "
                            f"(looked in {', '.join(map(str, _benchmark_dirs()))})")


def load_sibling(path: Path):
    """A benchmark's helper file (``benchmarks/_race.py``, ``generate.py``) as a module, loaded once per process
    under ``tidal_benchmark_<stem>`` (benchmarks are not a package, so they cannot import each other)."""
    name = f"tidal_benchmark_{path.stem.lstrip('_')}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    cols = list(rows[0])
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def run_benchmark(name: str, overrides: list[str], out: str | None = None) -> int:
    module = load(name)
    out_dir = Path(out) if out else Path("benchmarks/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = module.run(overrides, out_dir / name)
    print(format_table(result["table"]))
    print(json.dumps(result, indent=2))
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0
