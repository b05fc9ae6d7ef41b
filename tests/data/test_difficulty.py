"""Difficulty filtering with the real local engine and a random tiny model. The reward "even length"
gives the random policy intermediate pass rates, so the band logic is exercised for real."""

import json

import pytest

from tidal.cli import main
from tidal.data.difficulty import Difficulty, DifficultyConfig, problem_uid
from tidal.data.io import read_rows, write_rows
from tidal.data.pipeline import Pipeline
from tidal.rewards import REWARDS, register_fn
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.types import Prompt

if "test_even_length" not in REWARDS.names():
    @register_fn("test_even_length")
    def _even(response, prompt):
        return (1.0 if len(response) % 2 == 0 else 0.0), {}


@pytest.fixture(scope="module")
def policy_dir(small_model_dir):
    return small_model_dir


def cfg(**kw):
    base = dict(samples=8, reward="test_even_length", max_new_tokens=5, min_pass_rate=0.25, max_pass_rate=0.75)
    return DifficultyConfig(**{**base, **kw})


PROBLEMS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]


def test_pass_rates_are_the_share_of_solved_samples_and_the_band_decides(policy_dir, small_model, tokenizer):
    block = Difficulty(cfg(), str(policy_dir), 1)
    p = Pipeline([block])
    kept = list(p.run(PROBLEMS + [{"prompt": "", "answer": "1"}]))
    rates = block.prepare_chunk(PROBLEMS)  # the same seed and requests: the same samples again
    # by hand: regenerate with a fresh engine on the same model and count even-length responses
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(temperature=1.0, max_new_tokens=5), seed=1)
    prompts = [Prompt(problem_uid(r["prompt"]), r["prompt"], r["answer"]) for r in PROBLEMS]
    trajs = engine.generate(group_requests(tokenizer, prompts, 8))
    by_hand = [sum(len(t.text) % 2 == 0 for t in trajs[i * 8 : (i + 1) * 8]) / 8 for i in range(len(PROBLEMS))]
    assert rates == by_hand
    assert kept == [r for r, x in zip(PROBLEMS, rates) if 0.25 <= x <= 0.75]
    dropped = p.report()["blocks"][0]["dropped"]
    assert dropped.get("too_easy", 0) == sum(x > 0.75 for x in rates)
    assert dropped.get("too_hard", 0) == sum(x < 0.25 for x in rates)
    assert dropped["no_prompt_or_answer"] == 1
    assert 0 < len(kept) < len(PROBLEMS), "the test needs a mix of pass rates"


def test_two_stages_and_curriculum_through_the_cli(policy_dir, tmp_path):
    write_rows(tmp_path / "problems.jsonl", PROBLEMS)
    out = tmp_path / "curated.jsonl"
    args = ["curate", "rl-difficulty", "--in", str(tmp_path / "problems.jsonl"), "--out", str(out),
            "--set", "blocks=[difficulty]", "--set", f"difficulty.model=[{policy_dir}, {policy_dir}]",
            "--set", "difficulty.reward=test_even_length", "--set", "difficulty.samples=8",
            "--set", "difficulty.max_new_tokens=5", "--set", "difficulty.min_pass_rate=0.1",
            "--set", "difficulty.max_pass_rate=0.9", "--set", "difficulty.curriculum=true", "--set", "workers=1"]
    assert main(args) == 0
    report = json.loads(out.with_name(out.name + ".report.json").read_text())
    stages = report["blocks"]
    assert [b["name"] for b in stages] == ["difficulty:1", "difficulty:2"]
    assert stages[1]["seen"] == stages[0]["kept"]
    kept = list(read_rows(out))
    assert len(kept) == report["rows_out"] and set(map(str, kept)) <= set(map(str, PROBLEMS))
    # easiest first: recompute the last stage's rates for the kept rows
    last = Difficulty(cfg(min_pass_rate=0.1, max_pass_rate=0.9), str(policy_dir), 2)
    rates = last.prepare_chunk(kept)
    assert rates == sorted(rates, reverse=True)


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    write_rows(tmp_path / "p.jsonl", PROBLEMS[:1])
    assert main(["curate", "rl-difficulty", "--in", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "difficulty.model" in capsys.readouterr().err
