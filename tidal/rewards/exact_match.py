"""Exact-match verifier: reward 1 when the response, stripped, equals the reference answer."""

from __future__ import annotations

from typing import Any

from tidal.rewards import register_fn
from tidal.types import Prompt


@register_fn("exact_match")
def exact_match(response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
    correct = response.strip() == prompt.answer.strip()
    return float(correct), {"correct": correct}


@register_fn("digit_match")
def digit_match(response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
    """Partial credit: the fraction of answer characters matched position by position, divided by
    the longer of the two lengths (so padding or truncating is penalized). 1.0 iff exact match.
    A shaped reward for tiny models and tests; gives a random model a non-degenerate signal."""
    got, want = response.strip(), prompt.answer.strip()
    if not want:
        return float(not got), {"correct": not got}
    hits = sum(a == b for a, b in zip(got, want))
    return hits / max(len(got), len(want)), {"correct": got == want}


@register_fn("answer_match")
def answer_match(response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
    """Exact match of the answer section: the text after the last ``</think>``, stripped. A response
    that never closes its thinking has no answer (reward 0), as in ``math``'s ``after_think``."""
    if "</think>" not in response:
        return 0.0, {"correct": False, "reason": "unfinished thinking: no </think>, so no answer"}
    correct = response.rsplit("</think>", 1)[1].strip() == prompt.answer.strip()
    return float(correct), {"correct": correct}
