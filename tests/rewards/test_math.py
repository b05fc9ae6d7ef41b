import pickle
import subprocess
import sys
import threading

import pytest

from tidal.config import ConfigError
from tidal.rewards import build_reward
from tidal.rewards.math import boxed_contents, copied_from_question, extract_answers, strip_question
from tidal.types import Prompt

Q = "What is 2+3?"


def score(response, answer="5", question=Q, **params):
    reward, details = build_reward("math", params)(response, Prompt("u", question, answer))
    return reward, details


def test_boxed_contents_matches_nested_braces_and_skips_unclosed():
    assert boxed_contents(r"a \boxed{\frac{1}{2}} b \fbox{3} c \boxed{4") == [r"\frac{1}{2}", "3"]


def test_extract_answers_formats_and_priority():
    assert extract_answers(r"<answer>7</answer> so \boxed{8}") == ("boxed", ["8"])
    assert extract_answers("<answer> $7$ </answer>") == ("answer_tag", ["7"])
    assert extract_answers("The answer is 5 because 2+3=5.") == ("answer_is", ["5"])
    assert extract_answers(r"Final answer: $\frac{3}{4}$.") == ("answer_is", [r"\frac{3}{4}"])
    assert extract_answers("The answer might be 42.") == (None, [])  # prose after "answer": no answer
    assert extract_answers(r"\boxed{3}", ["answer_tag"]) == (None, [])


@pytest.mark.parametrize(
    "response,answer",
    [
        (r"So the sum is \boxed{5}.", "5"),
        (r"\boxed{\frac{1}{2}}", "0.5"),  # symbolic equivalence, gold plain
        (r"\boxed{0.5}", r"\frac12"),  # gold LaTeX
        (r"\boxed{\dfrac{3}{4}}", "3/4"),
        (r"\boxed{(x+1)^2}", "x^2+2x+1"),
        (r"\boxed{2\pi}", r"\boxed{2\pi}"),  # gold given boxed
        ("<answer>7</answer>", "7"),
        ("Therefore, the final answer is $\\frac{7}{2}$.", "3.5"),
        (r"\boxed{1/2} which is \boxed{0.5}", "1/2"),  # the same answer twice is not hedging
    ],
)
def test_correct_answers_score_one(response, answer):
    reward, details = score(response, answer, question="Solve it.")
    assert reward == 1.0, details
    assert details["reason"] == "correct" and details["correct"] is True


def test_wrong_answer_scores_zero_with_details():
    reward, details = score(r"\boxed{6}")
    assert reward == 0.0
    assert details["extracted"] == "6" and details["parsed"] == ["6", "6"] and details["gold_parsed"] == ["5", "5"]
    assert details["reason"] == "wrong answer" and "error" not in details


def test_hack_several_different_boxed_answers():
    reward, details = score(r"It is \boxed{4} or \boxed{5} or \boxed{6}")
    assert reward == 0.0 and details["reason"].startswith("multiple different answers")
    assert score(r"\boxed{5} \boxed{4}")[0] == 0.0  # the last one correct does not help either


def test_hack_answer_hidden_in_reasoning():
    # The correct number is in the text, but the final answer is wrong or missing.
    assert score(r"2+3 = 5, I guess. But my final answer is \boxed{6}")[0] == 0.0
    reward, details = score("2 + 3 = 5")
    assert reward == 0.0 and details["reason"].startswith("no final answer")
    # Boxed inside the thoughts does not count; the answer after </think> does.
    assert score(r"<think>\boxed{5}</think> The answer is 6.")[0] == 0.0
    assert score(r"<think>\boxed{5}</think> I am not sure.")[1]["reason"].startswith("no final answer")
    assert score(r"<think>\boxed{6}</think> \boxed{5}")[0] == 1.0
    # An unclosed think block (truncated response) has no final answer at all.
    reward, details = score(r"<think>2+3 is \boxed{5}")
    assert reward == 0.0 and details["reason"].startswith("unfinished thinking")


def test_hack_repeating_the_question():
    assert score(Q, mode="lenient")[0] == 0.0  # math-verify alone would extract "2"...
    assert score("What   is\n2+3?  ", mode="lenient")[0] == 0.0  # ...re-wrapped whitespace too
    reward, details = score(r"\boxed{2+3}")  # symbolically equal to 5, but copied from the question
    assert reward == 0.0 and details["reason"] == "answer copied from the question"
    assert score(f"{Q} Easy: \\boxed{{5}}")[0] == 1.0  # echoing the question, then answering, is fine
    # Without the copy check the restatement rule still rejects it (test_math_restate.py); both off: 1.
    assert score(r"\boxed{2+3}", reject_copied=False)[1]["reason"] == "restates the question"
    assert score(r"\boxed{2+3}", reject_copied=False, reject_restated=False)[0] == 1.0


def test_copy_check_exempts_plain_numbers_and_the_gold():
    assert not copied_from_question("5", "Is 5 prime? Answer 5 or 6.", "5")
    assert not copied_from_question("x^2+1", "Let f(x) = x^2 + 1. What is f?", "x^2+1")
    assert copied_from_question("x^2 + 1", "Let f(x) = x^2+1. Expand f.", "x^2+1+0")
    assert strip_question("Q: What is 2+3?\nA: 5", "What is\n2+3?") == "Q:  \nA: 5"
    # Only whole-word copies of a real (multi-word) question are stripped: a one-letter "question"
    # must not cut the q out of \sqrt.
    assert strip_question(r"\boxed{2\sqrt{3}}", "q") == r"\boxed{2\sqrt{3}}"
    assert strip_question("Whatever is 2+3? no", "ever is 2+3?") == "Whatever is 2+3? no"
    assert score(r"\boxed{2\sqrt{3}}", answer=r"\sqrt{12}", question="q")[0] == 1.0


def test_strict_vs_lenient():
    # No configured final-answer format: strict scores 0, lenient takes math-verify's last expression.
    assert score("2 + 3 makes 5")[0] == 0.0
    reward, details = score("2 + 3 makes 5", mode="lenient")
    assert reward == 1.0 and details["format"] == "fallback" and details["extracted"] == "5"
    # Lenient takes the *last* expression: a correct number earlier does not count.
    assert score("maybe 5, no wait, 6", mode="lenient")[0] == 0.0
    # A configured format, when present, wins in both modes (no fallback to a hidden answer).
    assert score(r"5 ... \boxed{6}", mode="lenient")[0] == 0.0
    # formats restricts what counts as final.
    assert score(r"\boxed{5}", formats=["answer_tag"])[0] == 0.0
    assert score("<answer>5</answer>", formats=["answer_tag"])[0] == 1.0


def test_bad_gold_is_an_error_and_bad_params_are_config_errors():
    reward, details = score(r"\boxed{5}", answer="  ")
    assert reward == 0.0 and "error" in details
    with pytest.raises(ConfigError, match="mode"):
        build_reward("math", {"mode": "loose"})
    with pytest.raises(ConfigError, match="formats"):
        build_reward("math", {"formats": ["boxed", "last_line"]})
    with pytest.raises(ConfigError, match="timeout_s"):
        build_reward("math", {"timeout_s": 0.5})
    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) \['strictness'\]; valid: mode, formats"):
        build_reward("math", {"strictness": 1})


def test_runs_outside_the_main_thread_and_pickles():
    fn = pickle.loads(pickle.dumps(build_reward("math", {})))
    out = []
    t = threading.Thread(target=lambda: out.append(fn(r"\boxed{\frac{10}{4}}", Prompt("u", "q", "2.5"))))
    t.start()
    t.join()
    assert out[0][0] == 1.0, out  # math-verify's signal.alarm would raise here without the guard


def test_importing_the_rewards_does_not_import_math_verify():
    # math-verify pulls in sympy (~0.7 s): only processes that score math should pay for it.
    code = "import sys, tidal.rewards; print('math_verify' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
