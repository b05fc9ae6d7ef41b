"""``tidal bench thinking`` end to end on toy sizes: a warm start, the budget curve, RL with sampled
budgets, the curve again. The full-size numbers are in docs/benchmarks.md and docs/curriculum.md."""

import statistics

import pytest

from tidal.bench import load


@pytest.mark.slow
def test_thinking_bench_reports_the_budget_curve(tmp_path):
    out = load("thinking").run([
        "eval_problems=6", "sft_steps=3", "rl_steps=2", "eval_every=1", "seeds=2", "prompts_per_step=2",
        "group_size=2", "budgets=[0,8]", "train_budgets=[0,64]",
        f"run=[model.hidden_size=32, sft.cache_dir={tmp_path / 'cache'}]"], tmp_path / "bench")
    assert list(out["thinking_accuracy_by_budget"]) == ["0", "8", "unlimited"]
    seeds = out["seed_results"]
    assert [r["seed"] for r in seeds] == [0, 1]
    for key in ("0", "8", "unlimited"):
        assert out["thinking_accuracy_by_budget"][key] == pytest.approx(
            statistics.median(r["after_rl"][key] for r in seeds))
        assert out["base_accuracy_by_budget"][key] == pytest.approx(statistics.median(r["base"][key] for r in seeds))
    for r in seeds:
        assert [s for s, _ in r["rl_curve"]] == [0, 1, 2]
        assert 0.0 <= r["think_forced_frac"] <= 1.0
    assert (tmp_path / "thinking.png").exists()


def test_documented_commands_name_real_settings():
    """The ``tidal bench thinking`` lines of docs/benchmarks.md parse against the benchmark's settings."""
    import re
    import shlex
    from pathlib import Path

    from tidal.config import apply_overrides

    module = load("thinking")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    lines = [line for line in re.findall(r"^tidal bench thinking.*$", doc, flags=re.M)]
    assert lines, "docs/benchmarks.md has no tidal bench thinking command"
    for line in lines:
        args = shlex.split(line)[3:]
        sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
        settings = apply_overrides(module.Settings(), sets)
        for kv in sets:
            key, value = kv.split("=", 1)
            assert str(getattr(settings, key)).replace(" ", "") == value.replace(" ", ""), kv
