"""The reward audit: its hack library, that it catches issue 49's reward, and what it says of every reward."""

import json
import subprocess
import sys

import pytest

from tidal.rewards import build_reward
from tidal.rewards.audit import PROBES, _responses, format_table, question_expression, run_audit
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig
from tidal.types import Prompt

WORDED = [Prompt("a", "What is 22+13?", "35"), Prompt("b", "Add 22 and 13.", "35"),
          Prompt("c", "What is 37 times 2?", "74"), Prompt("d", "How much is 90 - 17?", "73")]
QUICKSTART = TASKS.get("addition")(TaskConfig(num_eval=6)).eval_prompts()  # "07+45=" -> "052"
PROMPTS = WORDED + QUICKSTART


def audit(fn, prompts=PROMPTS, threshold=0.0):
    return run_audit(lambda items: [fn(r, p) for r, p in items], prompts, threshold)


def issue_49_reward(response, prompt):
    """The gamed reward: 1 when math-verify's lenient parse of the response equals the gold."""
    from math_verify import parse, verify

    return float(verify(parse(prompt.answer), parse(response))), {}


def test_question_expression_written_or_found_from_the_gold():
    assert question_expression("07+45=", "052").render() == "07+45"
    assert question_expression("What is 22 \\times 13?", "286").render() == "22*13"
    assert question_expression("What is -2-3?", "-5").render() == "-2-3"
    assert question_expression("Add 22 and 13.", "35").render() == "22+13"  # found: 22+13 is the gold
    assert question_expression("Take 17 from 90.", "73") is None  # 17-90 is not: no restatement to try
    assert question_expression("What is 37 times 2?", "74").render() == "37*2"
    assert question_expression("Name a prime.", "7") is None


def test_the_library_makes_the_issue_49_strings():
    made = {name: _responses(name, WORDED[0]) for name in PROBES}
    assert "22+13 is 22+13." in made["restate_expression"] and "13+22" in made["restate_reordered"]
    assert "(22)+(13)" in made["restate_parenthesized"] and made["restate_words"] == ["22 plus 13"]
    assert "\\boxed{22+13}" in made["restate_boxed"] and "35? 22+13" in made["restate_after_value"]
    assert "35*1" in made["trivial_expression"] and "22 13" in made["copy_inputs"]
    assert "33, 34, 36, 37 or 35" in made["candidate_list"] and "\\boxed{}" in made["empty_tags"]
    assert all(len(r) > 10_000 and "35" in r for r in made["long_buried"])
    assert made["gold_worked"] == ["22 + 13 = 35"] and made["gold"] == ["35"]
    assert _responses("candidate_list", QUICKSTART[0])[0].split()[2] == QUICKSTART[0].answer  # zero-padded like it
    assert _responses("restate_boxed", Prompt("x", "Name a prime.", "7")) == []  # no expression: not applicable


def test_the_audit_catches_the_issue_49_reward():
    report = audit(issue_49_reward)
    assert not report["passed"] and report["controls_ok"]
    assert {"restate_expression", "restate_reordered", "restate_parenthesized", "restate_boxed", "restate_latex",
            "restate_answer_tag", "restate_after_value", "trivial_expression", "candidate_list"} <= set(
                report["flagged"])
    row = {r["name"]: r for r in report["probes"]}["restate_reordered"]
    assert row["max"] == 1.0 and row["example"]["reward"] == 1.0 and row["share_above"] > 0.5


def test_the_audit_catches_the_old_lenient_math():
    report = audit(build_reward("math", {"mode": "lenient", "reject_restated": False}))
    assert not report["passed"]
    assert {"restate_reordered", "restate_parenthesized", "trivial_expression"} <= set(report["flagged"])


@pytest.mark.parametrize("name, params", [("math", {"mode": "lenient"}), ("math", {}), ("last_number", {}),
                                          ("exact_match", {}), ("answer_match", {})])
def test_fixed_and_exact_rewards_pass(name, params):
    report = audit(build_reward(name, params))
    assert report["passed"], format_table(report)


@pytest.mark.parametrize("name, params, flagged", [
    ("digit_match", {}, {"trivial_expression", "candidate_list", "wrong_answer"}),  # shaped: partial credit
    ("format", {"checks": ["boxed"]}, {"restate_boxed", "wrong_answer"}),  # checks form, never correctness
    ("language", {}, {"restate_expression", "empty"}),  # checks the language, never correctness
])
def test_rewards_that_do_not_check_correctness_are_flagged(name, params, flagged):
    report = audit(build_reward(name, params))
    assert not report["passed"] and flagged <= set(report["flagged"]), report["flagged"]


def test_a_format_bonus_is_flagged_unless_the_threshold_allows_it():
    magistral_like = build_reward("compose", {"terms": [{"reward": "math", "weight": 0.9},
                                                        {"reward": "format", "weight": 0.1,
                                                         "params": {"checks": ["boxed"]}}]})
    strict = audit(magistral_like)
    assert set(strict["flagged"]) >= {"restate_boxed", "wrong_answer"}  # 0.1 for any boxed answer
    assert audit(magistral_like, threshold=0.1)["passed"]


def test_reasoning_gym_binary_passes_and_partial_credit_is_flagged():
    task = TASKS.get("reasoning_gym")(TaskConfig(name="reasoning_gym", num_eval=4,
                                                 params={"dataset": "chain_sum", "size": 20}))
    prompts = task.eval_prompts()
    assert audit(build_reward("reasoning_gym"), prompts)["passed"]
    report = audit(build_reward("reasoning_gym", {"partial_credit": True}), prompts)
    assert {"restate_expression", "candidate_list", "copy_inputs"} <= set(report["flagged"])


@pytest.mark.parametrize("fn", [lambda r, p: (0.0, {}), build_reward("length", {})])  # length: 0 or a penalty
def test_a_reward_that_never_pays_fails_on_its_controls(fn):
    report = audit(fn)
    assert report["flagged"] == [] and not report["controls_ok"] and not report["passed"]
    assert "no control scored above the threshold" in format_table(report)


def test_the_table_and_errors():
    table = format_table(audit(issue_49_reward, WORDED[:1]))
    assert "restate_reordered" in table and "<-- HACK SCORES" in table and table.splitlines()[-1].startswith("FAILED")
    with pytest.raises(ValueError, match="unknown probe"):
        run_audit(lambda items: [], WORDED, probes=["nope"])
    with pytest.raises(ValueError, match="at least one prompt"):
        run_audit(lambda items: [], [])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tidal.cli", "audit-reward", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_passes_the_fixed_math_and_fails_a_weak_reward_through_the_worker_pool(tmp_path, capsys):
    from tidal.cli import main

    out = tmp_path / "audit.json"  # in-process (the worker pool all the same); the weak reward below is a subprocess
    code = main(["audit-reward", "--reward", "math", "--set", "reward.params.mode=lenient", "--num-prompts", "3",
                 "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "on 3 prompts of task addition (recipe quickstart)" in printed.out and "PASSED" in printed.out
    report = json.loads(out.read_text())
    assert report["passed"] and report["reward"] == "math" and report["params"] == {"mode": "lenient"}
    assert {r["name"] for r in report["probes"]} == set(PROBES)

    weak = tmp_path / "weak.py"
    weak.write_text("from math_verify import parse, verify\n\n"
                    "def score(response, prompt):\n"
                    "    return float(verify(parse(prompt.answer), parse(response)))\n")
    proc = _cli("--reward", f"{weak}:score", "--num-prompts", "3", "--workers", "1")
    assert proc.returncode == 1, proc.stderr
    assert "<-- HACK SCORES" in proc.stdout and "FAILED" in proc.stdout.splitlines()[-1]


def test_cli_defaults_to_the_recipes_reward_and_bad_input_is_one_line(capsys):
    from tidal.cli import main

    assert main(["audit-reward", "--num-prompts", "2", "--workers", "0"]) == 0  # quickstart: exact_match
    assert "audit of reward exact_match" in capsys.readouterr().out
    for args, message in [(["--reward", "no_such.mod:fn"], "no module named 'no_such'"),
                          (["--recipe", "nope"], "unknown recipe 'nope'"),
                          (["--num-prompts", "0"], "--num-prompts must be >= 1"),
                          (["--set", "reward.params.mood=x", "--reward", "math"], "unknown parameter(s) ['mood']")]:
        assert main(["audit-reward", "--workers", "0", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
