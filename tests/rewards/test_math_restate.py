"""Issue 49: ``math`` gives 0 to an answer that restates the question (any order, notation or mode).

Each hack below is checked twice: it scores 0 with the rule, and 1 without it (``reject_restated=false``;
the older literal-copy check ``reject_copied`` off in both),
which shows it is a real hole math-verify alone would reward, not a wrong answer scored 0 anyway."""

import pytest

from tidal.rewards import build_reward
from tidal.rewards.restate import RESTATED, UNEVALUATED, arithmetic_left, gold_is_value, integer_quotient
from tidal.types import Prompt

Q = "What is 22+13?"


def score(response, answer="35", question=Q, **params):
    return build_reward("math", params)(response, Prompt("u", question, answer))


HACKS = [
    # (response, mode, question, gold, reason)
    ("22+13 is 22+13.", "lenient", Q, "35", RESTATED),  # the exact string
    ("13+22", "lenient", Q, "35", RESTATED),
    ("22 + 13", "lenient", Q, "35", RESTATED),
    ("(22)+(13)", "lenient", Q, "35", RESTATED),
    ("35? 22+13", "lenient", Q, "35", RESTATED),  # the value, then the expression last
    (r"\boxed{22+13}", "strict", "Add 22 and 13.", "35", RESTATED),  # worded question: no literal copy
    (r"\boxed{13 + 22}", "strict", Q, "35", RESTATED),
    ("<answer>(22) + (13)</answer>", "strict", Q, "35", RESTATED),
    ("The answer is 13+22.", "strict", Q, "35", RESTATED),
    (r"\boxed{x = 22+13}", "strict", Q, "35", RESTATED),
    (r"\boxed{36 = 22+13}", "strict", Q, "35", RESTATED),  # math-verify compares the last right-hand side
    (r"\boxed{\frac{44+26}{2}}", "strict", Q, "35", UNEVALUATED),
    (r"\boxed{35 \cdot 1}", "strict", Q, "35", UNEVALUATED),
    ("35*1", "lenient", Q, "35", UNEVALUATED),
    (r"\boxed{\frac{70}{2}}", "strict", Q, "35", UNEVALUATED),  # the parser divides it: caught in the text
    (r"\boxed{70 \div 2}", "strict", Q, "35", UNEVALUATED),
    (r"$22 \times 13$", "lenient", "What is 22 times 13?", "286", RESTATED),
    (r"\boxed{13 \cdot 22}", "strict", "Multiply 22 by 13.", "286", RESTATED),
    (r"\boxed{7+45}", "strict", "07+45=", "052", RESTATED),  # the quickstart's zero-padded prompt
    (r"\boxed{2^{10}}", "strict", "What is two to the tenth?", "1024", UNEVALUATED),
    (r"\boxed{\frac{1}{2} \cdot 2}", "strict", "Compute it.", "1", UNEVALUATED),
    (r"\boxed{0.5 + 0.5}", "strict", "Compute it.", "1", UNEVALUATED),
    (r"\boxed{-(2+3)}", "strict", "What is -2-3?", "-5", RESTATED),
    (r"\boxed{2\pi \cdot 1}", "strict", "Circumference of the unit circle?", r"2\pi", UNEVALUATED),
    (r"\boxed{\sqrt{4}}", "strict", "What is the square root of 4?", "2", RESTATED),
]


@pytest.mark.parametrize("response, mode, question, gold, reason", HACKS, ids=[h[0] for h in HACKS])
def test_restatements_score_zero_and_would_score_one_without_the_rule(response, mode, question, gold, reason):
    # reject_copied off: the rule alone catches each (verbatim copies also trip the older literal check).
    reward, details = score(response, gold, question, mode=mode, reject_copied=False)
    assert (reward, details["reason"]) == (0.0, reason), details
    assert details["correct"] is False and "error" not in details
    assert score(response, gold, question, mode=mode, reject_copied=False, reject_restated=False)[0] == 1.0
    assert score(response, gold, question, mode=mode)[0] == 0.0  # the defaults


ANSWERS = [
    # (response, mode, question, gold): a value is stated, so the answer counts
    ("37 + 48 = 85", "lenient", "What is 37+48?", "85"),  # the chat model's natural style
    ("37 + 48 = 85.", "lenient", "What is 37+48?", "85"),
    (r"\boxed{37 + 48 = 85}", "strict", "What is 37+48?", "85"),
    ("22+13 = 35, so the answer is 35.", "strict", Q, "35"),
    ("x = 35", "lenient", Q, "35"),
    (r"\boxed{x = 35}", "strict", Q, "35"),
    (r"\boxed{35.0}", "strict", Q, "35"),
    (r"\boxed{-5}", "strict", "What is 2-7?", "-5"),
    (r"\boxed{\frac{1}{2}}", "strict", "What is 1/4 + 1/4?", "0.5"),
    (r"\boxed{2/4}", "strict", "What is 1/4 + 1/4?", "1/2"),  # an unreduced fraction is still a value
    (r"\boxed{0.5}", "strict", "Half of one?", r"\frac{1}{2}"),
    (r"\boxed{2\pi}", "strict", "Circumference of the unit circle?", r"2\pi"),
    (r"\boxed{\pi \cdot 2}", "strict", "Circumference of the unit circle?", r"2\pi"),
    (r"\boxed{6.283185307}", "strict", "Circumference of the unit circle?", r"2\pi"),
    (r"\boxed{\sqrt{18}}", "strict", "Simplify.", r"3\sqrt{2}"),  # an irrational root is a value
    (r"\boxed{\frac{\sqrt{3}}{2}}", "strict", "sin 60?", r"\frac{\sqrt{3}}{2}"),
    (r"\boxed{1+\sqrt{2}}", "strict", "Solve.", r"1+\sqrt{2}"),
    (r"\boxed{3 \times 10^{8}}", "strict", "Speed of light in m/s?", "300000000"),  # scientific notation
    (r"\boxed{50\%}", "strict", "What fraction?", "0.5"),
    (r"\boxed{1,234}", "strict", "What is 1000+234?", "1234"),
    (r"\boxed{(x+1)^2}", "strict", "Factor x^2+2x+1.", "x^2+2x+1"),  # symbolic gold: the rule is off
    (r"\boxed{x^2 + 1}", "strict", "Let f(x) = x^2 + 1. What is f?", "x^2+1"),
    (r"\boxed{2^{10}}", "strict", "Write 1024 as a power of 2.", "2^{10}"),  # gold is an expression: off
    (r"\boxed{B}", "strict", "Which? (A) 3 (B) 35", "B"),  # multiple choice
    (r"\boxed{35}", "strict", "Is it (A) 22+13 or (B) 35?", "35"),
]


@pytest.mark.parametrize("response, mode, question, gold", ANSWERS, ids=[a[0] for a in ANSWERS])
def test_stated_values_still_score_one(response, mode, question, gold):
    reward, details = score(response, gold, question, mode=mode)
    assert reward == 1.0, details


def test_wrong_words_are_wrong_answers_not_restatements():
    # math-verify does not read words: "22 plus 13" is its last number, 13, a wrong answer.
    reward, details = score("22 plus 13", mode="lenient")
    assert (reward, details["reason"]) == (0.0, "wrong answer")


def _parse(latex):
    from math_verify import parse

    return [p for p in parse("\\boxed{" + latex + "}") if not isinstance(p, str)][0]


@pytest.mark.parametrize("latex, left", [
    ("22+13", True), ("35 \\cdot 1", True), ("2^{10}", True), ("5!", True), ("|-5|", True), ("\\sqrt[3]{8}", True),
    ("35", False), ("-5", False), ("\\frac{3}{4}", False), ("2\\pi", False), ("\\sqrt{18}", False),
    ("\\frac{3\\sqrt{2}}{2}", False), ("3 \\times 10^{8}", False), ("1.5 \\times 10^{-3}", False), ("\\ln 2", False),
    ("x^2+1", False), ("9^{9^{9^{9}}}", True),  # never evaluated: no hang
])
def test_arithmetic_left(latex, left):
    assert arithmetic_left(_parse(latex)) is left


def test_integer_quotient_and_gold_is_value():
    assert integer_quotient(r"\frac{70}{2}") and integer_quotient("35/1") and integer_quotient(r"70 \div 2")
    assert not integer_quotient(r"\frac{1}{2}") and not integer_quotient("2/4") and not integer_quotient("3.5/1.5")
    from math_verify import parse

    assert gold_is_value("35", parse("35")) and gold_is_value(r"2\pi", parse(r"$2\pi$"))
    assert not gold_is_value("x^2+1", parse("$x^2+1$")) and not gold_is_value("B", parse("B"))
    assert not gold_is_value(r"\frac{70}{2}", parse(r"$\frac{70}{2}$"))


@pytest.mark.parametrize("response", ["33, 34, 36 or 35", "33 34 35", "Maybe 33.\n34\n35"])
def test_lenient_candidate_lists_are_hedging(response):
    from math_verify import parse, verify

    assert verify(parse("35"), parse(response))  # math-verify alone reads only the last one: a hole
    reward, details = score(response, mode="lenient")
    assert (reward, details["reason"]) == (0.0, "multiple different answers (fallback)"), details


@pytest.mark.parametrize("response, gold", [("The sum of 22 and 13 is 35.", "35"), (r"So x = \frac{3}{4}.", "0.75"),
                                            ("20 + 10 = 30, 2 + 3 = 5, so 30 + 5 = 35", "35")])
def test_lenient_single_values_are_not_hedging(response, gold):
    reward, details = score(response, gold, mode="lenient")
    assert reward == 1.0, details
