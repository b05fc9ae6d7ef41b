"""``tidal bench mixture`` shrunk to seconds: its corpus, keys and arithmetic (the full run's numbers are in
docs/curate.md and benchmarks/results/mixture.json)."""

import json

import pytest

from tidal.bench import load


def test_corpus_held_out_shares_and_no_shared_rows(tmp_path):
    bench = load("mixture")
    s = bench.Settings(rows=20, eval_rows=20)
    domains, ev = bench.build_corpus(tmp_path, s)
    assert [p.rsplit("/", 1)[1] for p in domains] == ["words.jsonl", "arith.jsonl", "code.jsonl", "noise.jsonl"]
    train = {json.loads(line)["text"] for p in domains for line in open(p)}
    held_out = [json.loads(line)["text"] for line in open(ev)]
    assert len(held_out) == 20 and not train & set(held_out)
    # 0.5 / 0.35 / 0.15 / 0 of 20 rows: 10 of words (every sentence ends in '.'), none of noise
    assert sum("+" in t and "=" in t and "let" not in t for t in held_out) == 7


def test_the_benchmark_reports_regret_and_compute(tmp_path):
    pytest.importorskip("optuna")
    out = load("mixture").run(["rows=20", "eval_rows=12", "budget=12", "seeds=1", "grid_resolution=2",
                               "mixture=[proxy.hidden_size=16, proxy.batch_size=4, proxy.seq_len=16, "
                               "proxy.eval_windows=6, aioli.rounds=1, aioli.lp_steps=1, bayes.trials=2, "
                               "bayes.startup_trials=2, bayes.sampler=tpe]"], tmp_path / "bench")
    assert set(out["regret_by_method"]) == {"grid", "merge", "aioli", "bayes", "uniform"}
    assert set(out["compute_frac_by_method"]) == {"grid", "merge", "aioli", "bayes"}
    assert out["regret_by_method"]["grid"] == 0 and out["compute_frac_by_method"]["grid"] == 1
    # 10 grid mixtures x 12 steps; bayes 2 trials x 12 steps: 24 / 120 of the training (evaluations aside)
    grid, bayes = out["report"]["methods"]["grid"]["compute"], out["report"]["methods"]["bayes"]["compute"]
    assert grid["train_steps"] == 120 and bayes["train_steps"] == 24
    assert out["best_method"] in ("merge", "aioli", "bayes")


def test_the_benchmarks_md_commands_name_real_settings():
    """docs/benchmarks.md's ``tidal bench mixture`` lines parse against the benchmark's settings (the full run
    takes minutes; the shrunk run above is the one executed)."""
    import shlex
    from pathlib import Path

    from tidal.config import apply_overrides

    bench = load("mixture")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    lines = [shlex.split(x) for x in doc.splitlines() if x.startswith("tidal bench mixture")]
    assert len(lines) == 2
    for argv in lines:
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        apply_overrides(bench.Settings(), sets)
