"""Restating the question is not answering it: the rule ``math`` uses to tell a value from an expression.

Why (issue 49): math-verify parses ``22+13`` and evaluates it to ``35``, so a policy rewarded for
"a final answer symbolically equal to the gold" learns to answer "What is 22+13?" with ``22+13``
(a 135M chat model found it in 5 RL steps: reward 0.93, true accuracy 0.005). Comparing strings with
the question only catches verbatim copies; ``13+22``, ``(22)+(13)``, ``\\frac{44+26}{2}``,
``35 \\cdot 1`` or ``\\boxed{22+13}`` under "Add 22 and 13." are the same hole.

The rule: **when the gold answer is a value, the final answer must be a value too.** A task whose
gold is ``35`` (or ``\\frac{1}{2}``, ``2\\pi``, ``3\\sqrt{2}``, ``-5``, ``0.75``) asks for the result of
the computation, so an answer with *arithmetic left to do* is not an answer, however it evaluates.
"Arithmetic left to do" is read off math-verify's own parse (sympy, built unevaluated): an addition,
product or power with two or more plain numbers among its operands (``22+13``, ``35 \\cdot 1``,
``2\\pi \\cdot 1``, ``2^{10}``, ``0.5+0.5``), a factorial or absolute value of a number, a root that
comes out rational (``\\sqrt{4}``), or, in the text (the parser already divides them), a quotient of
integers that divides out (``\\frac{70}{2}``, ``70 \\div 2``, ``35/1``). What stays a value: numbers,
decimals, fractions in any terms (``\\frac{2}{4}``), signs, an irrational constant times or plus a
number (``2\\pi``, ``1+\\sqrt{2}``, ``\\frac{\\sqrt{3}}{2}``), irrational roots (``\\sqrt{18}``),
scientific notation (``3 \\times 10^{8}``), percentages, units and ``x = 35``.

For an equation the side math-verify compares is checked: the last right-hand side (``37 + 48 = 85``
states 85, a value; ``36 = 22+13`` ends in an expression, and math-verify would compare ``22+13``).

The rule is off, and only verbatim copies are caught (``math.copied_from_question``), when the gold
is not a value: symbolic (``x^2+1``: an expression *is* the answer), a choice letter, or itself
written with arithmetic left (``2^{10}``, ``\\frac{70}{2}``: the task accepts that form).

The reason names the hole: ``restates the question`` when the expression uses a number of the
question, else ``not a value: arithmetic left to do`` (``35 \\cdot 1`` for "What is 22+13?").

sympy is imported by the functions (math-verify has already loaded it), not by this module.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

RESTATED = "restates the question"
UNEVALUATED = "not a value: arithmetic left to do"

# A quotient of two integers written out: \frac{70}{2}, \dfrac{70}{2}, 70/2, 70 \div 2, 70 ÷ 2.
_QUOTIENTS = (
    re.compile(r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(-?\d+)\s*\}"),
    re.compile(r"(?<![\d.])(-?\d+)\s*(?:/|\\div|÷)\s*(-?\d+)(?![\d.])"),
)
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _is_literal(e: Any) -> bool:
    """A plain number as written: an integer, decimal or rational, a negated one, or a reciprocal
    ``1/b`` (how the parser writes a fraction's denominator)."""
    from sympy import Mul, Pow

    if e.is_Number:
        return bool(e.is_finite)
    if isinstance(e, Pow) and e.exp == -1:
        return _is_literal(e.base)
    if isinstance(e, Mul) and len(e.args) == 2 and -1 in e.args:
        return all(a == -1 or _is_literal(a) for a in e.args)
    return False


def _is_notation(e: Any) -> bool:
    """A product of numbers that is a way of writing one number, not a computation: scientific
    notation ``a \\times 10^{n}`` and a fraction ``p/q`` that does not divide out."""
    from sympy import Integer, Pow

    if len(e.args) != 2:
        return False
    a, b = e.args
    for x, y in ((a, b), (b, a)):
        if isinstance(y, Pow) and y.base == 10 and isinstance(y.exp, Integer) and _is_literal(x):
            return True
        if (isinstance(x, Integer) and isinstance(y, Pow) and y.exp == -1 and isinstance(y.base, Integer)
                and y.base != 0 and x % y.base != 0):
            return True
    return False


def _rational_root(e: Any) -> bool:
    """``b^(p/q)`` with a non-integer exponent that comes out rational (``\\sqrt{4}``, ``\\sqrt[3]{8}``)."""
    from sympy import Integer, Rational, integer_nthroot

    base, exp = e.base, e.exp
    if not (isinstance(base, Integer) and isinstance(exp, Rational) and base >= 0 and exp.q < 64):
        return False
    if len(str(base)) > 64:  # a hostile huge radicand: not worth a root; leave it to math-verify
        return False
    return integer_nthroot(int(base), int(exp.q))[1]


def arithmetic_left(e: Any) -> bool:
    """Whether the sympy expression ``e`` (math-verify's unevaluated parse) has arithmetic left to do
    (see the module docstring). Walks the tree; never evaluates it (``9^{9^{9}}`` costs nothing)."""
    from sympy import Abs, Add, Integer, Mul, Pow, factorial

    if isinstance(e, Mul) and _is_notation(e):
        return False  # 3 \times 10^{8}, or p/q: one number written in parts
    if isinstance(e, (Add, Mul)):
        literals = [a for a in e.args if _is_literal(a) and not (isinstance(e, Mul) and a == -1)]
        if len(literals) >= 2:
            return True
    elif isinstance(e, Pow) and _is_literal(e.base) and _is_literal(e.exp) and e.exp != -1:
        if isinstance(e.exp, Integer):
            return True  # 2^{10}: a power of numbers (scientific notation is a Mul, handled above)
        if _rational_root(e):
            return True
    elif isinstance(e, (factorial, Abs)) and e.args and _is_literal(e.args[0]):
        return True
    return any(arithmetic_left(a) for a in getattr(e, "args", ()))


def integer_quotient(text: str) -> bool:
    """Whether ``text`` writes a quotient of integers that divides out (``\\frac{70}{2}``, ``35/1``):
    the LaTeX parser divides those itself, so the tree no longer shows them."""
    for pattern in _QUOTIENTS:
        for p, q in pattern.findall(text):
            if int(q) != 0 and int(p) % int(q) == 0:
                return True
    return False


def _value_side(e: Any) -> Any:
    """The side of a relation math-verify compares with a non-relation gold: the last right-hand side
    (``x = 35`` -> 35, ``22+13 = 35`` -> 35, ``a = b = c`` -> c); anything else as is."""
    from sympy import And
    from sympy.core.relational import Relational

    while isinstance(e, And) and e.args:
        e = e._unsorted_args[-1] if hasattr(e, "_unsorted_args") else e.args[-1]
    return e.rhs if isinstance(e, Relational) else e


def gold_is_value(gold: str, gold_parsed: list) -> bool:
    """Whether the gold answer is a value the task wants computed: a number-valued sympy expression
    (``x = 5`` counts by its right side) with no free symbols and no arithmetic left, written without
    a dividing-out quotient. False for symbolic answers, choice letters, sets, relations, intervals."""
    from sympy import Expr

    exprs = [g for g in gold_parsed if not isinstance(g, str)]
    if not exprs:
        return False
    g = _value_side(exprs[0])
    return (isinstance(g, Expr) and bool(g.is_number) and not arithmetic_left(g)
            and not integer_quotient(gold.rsplit("=", 1)[-1]))


def _numbers(e: Any) -> set[Fraction]:
    """The magnitudes of the plain numbers in a sympy tree (exponents of reciprocals and signs aside)."""
    from sympy import Float, Rational

    if isinstance(e, Float):
        return {Fraction(str(abs(e))).limit_denominator(10**12)}
    if isinstance(e, Rational):
        return set() if e == -1 else {abs(Fraction(int(e.p), int(e.q)))}
    return set().union(*(_numbers(a) for a in getattr(e, "args", ())))


def question_numbers(question: str) -> set[Fraction]:
    """The numbers written in the question text ("07+45=" -> {7, 45})."""
    return {Fraction(x) for x in _NUMBER.findall(question)}


def restatement(answer: str, parsed: list, gold: str, gold_parsed: list, question: str) -> str | None:
    """Why ``answer`` (its text, and math-verify's ``parsed`` form) is not an answer to a task whose
    gold is a value, or None when it is one (or the gold is not a value): ``RESTATED`` when the
    expression uses a number of the question, else ``UNEVALUATED``."""
    if not gold_is_value(gold, gold_parsed):
        return None
    exprs = [_value_side(p) for p in parsed if not isinstance(p, str)]
    if not (any(arithmetic_left(e) for e in exprs) or integer_quotient(answer.rsplit("=", 1)[-1])):
        return None
    used = set().union(*(_numbers(e) for e in exprs), {Fraction(x) for x in _NUMBER.findall(answer)})
    return RESTATED if used & question_numbers(question) else UNEVALUATED
