"""``calculator``: a tool the policy calls to evaluate arithmetic, then answers.

An episode: the prompt is a problem (``12+34+56=``); each model turn is either a call
(``<c>12+34</c>``, see ``tool_calls.py``) answered with its result (``=46 ``), or the final answer,
which ends the episode with reward 1 if it equals the task's answer as a number, else 0.

Expressions are evaluated by walking Python's ``ast`` over a whitelist (integers, + - * / // %,
unary minus, parentheses), never with ``eval``; operands and results are bounded so a call cannot
burn the worker (``2**10**10`` is not even expressible: no powers). A bad expression is a tool error
the policy sees (``=error ``) and is counted; it never stops the run.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

from tidal.api import EnvStep
from tidal.envs import ENVS
from tidal.envs.tool_calls import Answer, Malformed, ToolCall, make_call_format
from tidal.types import Prompt

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
MAX_ABS = 10**15
_LEADING_ZEROS = re.compile(r"(?<![\d.])0+(\d)")
MAX_CHARS = 200


class CalcError(ValueError):
    """The expression is not safe arithmetic, or its value is out of bounds."""


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (see module docstring for what is allowed)."""
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    expression = _LEADING_ZEROS.sub(r"\1", expression)  # "07+45": zero-padded operands, as prompts write them
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalcError(f"not an expression: {e.msg}") from None

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            value = Fraction(node.value)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
                raise CalcError("division by zero")
            value = Fraction(_BINARY[type(node.op)](left, right))
        else:
            raise CalcError(f"{type(node).__name__} is not allowed")
        if abs(value) > MAX_ABS:
            raise CalcError("value out of range")
        return value

    return walk(tree.body)


def format_value(value: Fraction) -> str:
    """Integers as integers; other values with 6 significant digits (``1e+06`` for 1000000.5)."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


_PLAIN_NUMBER = re.compile(r"[+-]?(\d{1,40}(\.\d{1,40})?|\d{1,40}/\d{1,40})")  # 52, 0.5, 1/2


def same_number(text: str, answer: str) -> bool:
    """Whether an answer's text is the reference number (``052`` == ``52``), else equal strings.

    Only plain decimals are compared as numbers: ``Fraction("1e999999999")`` would build a
    billion-digit integer while holding the GIL, freezing every thread of the run (a collapsed policy
    wrote such an answer and hung a run until SIGKILL)."""
    got, want = text.strip(), answer.strip()
    if _PLAIN_NUMBER.fullmatch(got) and _PLAIN_NUMBER.fullmatch(want):
        try:
            return Fraction(got) == Fraction(want)
        except ZeroDivisionError:  # "1/0"
            pass
    return got == want


@ENVS.register("calculator")
class Calculator:
    """See the module docstring. ``call_format``: ``tagged`` (``<c>..</c>``) or ``hermes`` (JSON);
    ``result_open``/``result_close`` wrap a result in the observation."""

    def __init__(self, call_format: str = "tagged", result_open: str = "=", result_close: str = " "):
        self.format = make_call_format(call_format, "calculator", "expression")
        self.result_open, self.result_close = result_open, result_close
        self.stop = [self.format.close]
        self.answer = ""

    def reset(self, prompt: Prompt) -> str | None:
        self.answer = prompt.answer
        return None

    def observe(self, text: str) -> str:
        return f"{self.result_open}{text}{self.result_close}"

    def timeout_observation(self) -> str:
        return self.observe("timeout")

    def step(self, turn_text: str) -> EnvStep:
        parsed = self.format.parse(turn_text)
        if isinstance(parsed, Answer):
            correct = same_number(parsed.text, self.answer)
            return EnvStep(None, float(correct), done=True, info={"correct": correct})
        if isinstance(parsed, Malformed) or (isinstance(parsed, ToolCall) and parsed.name != "calculator"):
            return EnvStep(self.observe("error"), info={"malformed": True})
        try:
            value = evaluate(str(parsed.arguments.get("expression", "")))
        except CalcError:
            return EnvStep(self.observe("error"), info={"tool_call": True, "tool_error": True})
        return EnvStep(self.observe(format_value(value)), info={"tool_call": True})


def calculator_trace(operands: list, env: Calculator | None = None) -> str:
    """A correct episode for a sum, calling the tool on two terms at a time, as one text (the
    warm start's demonstration): ``<c>12+34</c>=46 <c>46+56</c>=102 102``. Operands given as strings
    are copied as written (``07``): the first call copies the first two from the prompt."""
    env = env or Calculator()
    first, parts = operands[0], []
    total = int(first)
    for i, x in enumerate(operands[1:]):
        expression = f"{first if i == 0 else total}+{x}"
        total += int(x)
        parts.append(env.format.render(ToolCall("calculator", {"expression": expression})) + env.observe(str(total)))
    return "".join(parts) + str(total)


def calculator_call_trace(expression: str, env: Calculator | None = None) -> str:
    """A correct one-call episode, as one text: ``<c>347*86</c>=29842 29842``."""
    env = env or Calculator()
    value = format_value(evaluate(expression))
    return env.format.render(ToolCall("calculator", {"expression": expression})) + env.observe(value) + value
