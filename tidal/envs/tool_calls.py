"""Parse a model turn into a tool call, a final answer, or a malformed call.

Two formats, picked by an environment's ``call_format`` parameter:

- ``tagged`` (default, for small models): ``<c>12+34</c>``, the call's argument between an open and
  a close tag; the close tag is the turn's stop string. Short, because each character is a token for
  the tiny character-level model.
- ``hermes``: ``<tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call>``,
  the JSON tool-call format of Qwen2.5 and Hermes chat templates (parsed with ``json``).

A turn with no opening tag is an answer (its stripped text). An opening tag without a parseable
call after it is malformed: environments answer it with an error observation, never a crash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    text: str


@dataclass(frozen=True)
class Malformed:
    reason: str


Parsed = ToolCall | Answer | Malformed


@dataclass(frozen=True)
class CallFormat:
    """How calls are written: ``kind`` is ``tagged`` or ``hermes``; ``tool`` names the tool a tagged
    call goes to, ``argument`` the argument its text becomes."""

    kind: str = "tagged"
    open: str = "<c>"
    close: str = "</c>"
    tool: str = "calculator"
    argument: str = "expression"

    @classmethod
    def hermes(cls, tool: str, argument: str) -> CallFormat:
        return cls("hermes", "<tool_call>", "</tool_call>", tool, argument)

    def render(self, call: ToolCall) -> str:
        """The text of a call (the synthetic warm-start traces write calls with this)."""
        if self.kind == "tagged":
            return f"{self.open}{call.arguments[self.argument]}{self.close}"
        return f"{self.open}{json.dumps({'name': call.name, 'arguments': call.arguments})}{self.close}"

    def parse(self, turn: str) -> Parsed:
        start = turn.find(self.open)
        if start < 0:
            return Answer(turn.strip())
        end = turn.find(self.close, start + len(self.open))
        if end < 0:
            return Malformed("unclosed call")
        body = turn[start + len(self.open) : end]
        if self.kind == "tagged":
            return ToolCall(self.tool, {self.argument: body})
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as e:  # deep nesting: the policy's input, not a crash
            return Malformed(f"call is not JSON ({getattr(e, 'msg', 'nested too deeply')})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return Malformed("call has no tool name")
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some templates send arguments as a JSON string
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                return Malformed("arguments are not JSON")
        if not isinstance(args, dict):
            return Malformed("arguments are not an object")
        return ToolCall(obj["name"], args)


def make_call_format(kind: str, tool: str, argument: str) -> CallFormat:
    if kind == "tagged":
        return CallFormat(tool=tool, argument=argument)
    if kind == "hermes":
        return CallFormat.hermes(tool, argument)
    raise ValueError(f"unknown call_format {kind!r}: use 'tagged' or 'hermes'")
