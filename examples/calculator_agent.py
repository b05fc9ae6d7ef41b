"""A calculator agent written against the OpenAI API only: no tidal imports.

It is an ordinary function-calling loop: it sends the question with one tool (``calculator``, in the
OpenAI ``tools`` schema), runs every tool call the model makes, sends the results back as ``tool``
messages, and stops at the first reply without tool calls, which is the answer. It works against any
OpenAI-compatible endpoint; tidal trains it (``tidal train harness_quickstart``) by calling
``run_episode`` with a client pointed at its own endpoint, once per episode, and using the returned
number as the episode's reward. ``task`` is any object with ``text`` (the question) and ``answer``.

Run as a program (``harness.command="python examples/calculator_agent.py"``), it is one episode: the
client comes from the standard ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` variables, the task from
``TIDAL_TASK`` (JSON), and the reward is printed as the last line.
"""

from __future__ import annotations

import ast
import json
import operator

import openai

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression over integers (+, -, *, /, parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]
MAX_TURNS = 3
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The value of ``expression`` as text, or ``error``: Python's ``ast`` over a whitelist, never eval."""

    def walk(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError("not arithmetic")

    try:
        value = walk(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return "error"
    if abs(value) > 10**12:
        return "error"
    return str(int(value)) if value == int(value) else f"{value:.6g}"


def run_tool(call) -> str:
    """One tool call's result (an unknown tool or bad arguments is an error the model sees)."""
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return "error"
    if call.function.name != "calculator" or not isinstance(arguments, dict):
        return "error"
    return calculate(str(arguments.get("expression", "")))


def run_episode(client: openai.OpenAI, task) -> float:
    """Answer ``task.text`` with the calculator's help; reward 1.0 if the final answer is ``task.answer``."""
    messages = [{"role": "user", "content": task.text}]
    for _ in range(MAX_TURNS):
        try:
            response = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except openai.BadRequestError:  # the conversation outgrew the model's context: a failed episode
            return 0.0
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # sent back exactly as it came
        if not message.tool_calls:
            return 1.0 if (message.content or "").strip() == task.answer else 0.0
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    return 0.0


if __name__ == "__main__":
    import os
    import types

    task = types.SimpleNamespace(**json.loads(os.environ["TIDAL_TASK"]))
    print(run_episode(openai.OpenAI(max_retries=0), task))
