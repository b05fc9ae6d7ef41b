"""End to end through the real CLI: the quickstart pipeline learns (short), and the full
quickstart reaches its target (slow, ``make test-slow``)."""

import json

import pytest

from tidal.cli import main
from tidal.recipes import RECIPES


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_quickstart_pipeline_reward_rises(tmp_path):
    """A smaller model (hidden 64), warm-started into the band [0.3, 0.5], under async RL for 30 steps (~35 s in
    all): sampled reward must clearly rise and held-out greedy accuracy must improve on the base. The first 30
    steps of the recipe's 400 (decay_steps pinned): a decay over only 30 steps halves the mean lr and the
    sampled reward's rise with it (CI: 0.17 -> 0.22). Seeds 0/1/2 measured (first 8 steps -> last 8): sampled
    reward +0.059/+0.038/+0.029 (temperature 1 over 14 tokens rises slowly), greedy held-out best +0.32/+0.31/
    +0.37; the lines sit well below both."""
    out = tmp_path / "run"
    code = main(["train", "quickstart", "--out", str(out),
                 "--set", "model.hidden_size=64", "--set", "model.num_layers=2", "--set", "model.intermediate_size=256",
                 "--set", "sft.steps=1000", "--set", "sft.accuracy_band=[0.3,0.5]",
                 "--set", "sft.lr=3e-3", "--set", f"sft.cache_dir={tmp_path / 'cache'}",
                 "--set", "optim.lr=3e-4", "--set", "optim.decay_steps=400", "--set", "max_steps=30",
                 "--set", "max_time_s=null",
                 "--set", "target_accuracy=null", "--set", "eval_every=10", "--set", "num_eval=200",
                 "--set", "log.progress=false"])
    assert code == 0
    rows = _rows(out)
    train_rows = [r for r in rows if "reward/mean" in r]
    first = sum(r["reward/mean"] for r in train_rows[:8]) / 8
    last = sum(r["reward/mean"] for r in train_rows[-8:]) / 8
    assert last > first + 0.015, (first, last)
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert max(evals[1:]) > evals[0] + 0.1, evals
    assert max(r["async/staleness_max"] for r in train_rows) <= 1
    assert (out / "report.html").exists()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_full_quickstart_reaches_target(tmp_path, seed):
    """The README's first command for two seeds (a seed moves the warm-started base the way another CPU
    does): the base lands in the warm start's band and RL reaches the recipe's 0.85 target."""
    out = tmp_path / "quickstart"
    assert main(["train", "quickstart", "--out", str(out), "--set", "log.progress=false", "--set", f"seed={seed}",
                 "--set", f"model.init_seed={seed}", "--set", f"sft.seed={seed}",
                 "--set", f"sft.cache_dir={tmp_path / 'cache'}"]) == 0
    evals = [r["eval/accuracy"] for r in _rows(out) if "eval/accuracy" in r]
    base, last = evals[0], evals[-1]
    low, high = RECIPES.get("quickstart")().sft.accuracy_band
    assert low <= base <= high, base
    assert last >= 0.85, (base, evals)  # the run stops at its target


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_agentic_quickstart_reaches_target(tmp_path, seed):
    """Issue 23's goal for two seeds: from a partial base (the warm start's band), async RL takes held-out
    episode success with the calculator to the recipe's 0.8 and at least 0.3 above the base."""
    out = tmp_path / "agentic"
    assert main(["train", "agentic_quickstart", "--out", str(out), "--set", "log.progress=false",
                 "--set", f"seed={seed}", "--set", f"model.init_seed={seed}", "--set", f"sft.seed={seed}",
                 "--set", f"sft.cache_dir={tmp_path / 'cache'}"]) == 0
    rows = [r for r in _rows(out) if "eval/accuracy" in r]
    base, last = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    low, high = RECIPES.get("agentic_quickstart")().sft.accuracy_band
    assert low <= base <= high, base
    assert last >= 0.8 and last >= base + 0.3, (base, [r["eval/accuracy"] for r in rows])
    assert rows[-1]["eval/tool_calls_mean"] >= 0.9  # it solved them with the tool


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_vlm_quickstart_reaches_target(tmp_path, seed):
    """Issue 54's goal for two seeds: the tiny Qwen2-VL's warm start lands in its band, and async RL on the pictures
    takes held-out accuracy to at least 0.8 and at least 0.3 above the base (the recipe stops at 0.9)."""
    out = tmp_path / "vlm"
    assert main(["train", "vlm_quickstart", "--out", str(out), "--set", "log.progress=false",
                 "--set", f"seed={seed}", "--set", f"model.init_seed={seed}", "--set", f"sft.seed={seed}",
                 "--set", f"sft.cache_dir={tmp_path / 'cache'}"]) == 0
    evals = [r["eval/accuracy"] for r in _rows(out) if "eval/accuracy" in r]
    base, last = evals[0], evals[-1]
    low, high = RECIPES.get("vlm_quickstart")().sft.accuracy_band
    assert low <= base <= high, base
    assert last >= 0.8 and last >= base + 0.3, (base, evals)
