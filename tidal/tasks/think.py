"""``sum_think``: sums of one-digit numbers answered after a ``<think>`` section that works them out.

The problem is ``sum_chain``'s ("7+5+9+3=", k terms, here of one digit each), but the prompt ends by
opening the thinking section, ``7+5+9+3=<think>``, as DeepSeek-R1's chat template opens it
(arXiv 2501.12948), so every response token up to ``</think>`` is thinking and a thinking budget
(``rollout/thinking.py``) counts exactly the thoughts. The warm-start demonstration rewrites the sum
one addition at a time, each line the previous one with its first two terms added::

    7+5+9+3=<think>12+9+3 21+3 24</think>24

Why this trace: each line only needs the line just before it (add two numbers of at most two digits,
copy the rest), so the 1M model never has to find the j-th operand of the prompt by position, the
copy that capped ``agentic_sums`` at ~0.65 (``recipes/agentic.py``). Its length grows with k (about
4 tokens for k = 2, 35 for k = 6), so budgets of 8, 16 and 32 tokens cut some of the traces and not
others, and a cut trace still holds a shorter sum: what is left to add after the forced ``</think>``.
The answer (after ``</think>``) is scored by ``answer_match``. Without a thought the model has to add
up to ``max_terms`` digits at once; ``tidal bench thinking`` measures accuracy against the budget.
"""

from __future__ import annotations

from tidal.tasks import TASKS
from tidal.tasks.arithmetic import SumChain
from tidal.types import Prompt

OPEN, CLOSE = "<think>", "</think>"


def rewrite_trace(operands: list[int]) -> str:
    """The thoughts for a sum: each line adds the first two terms of the one before (space-separated)."""
    assert len(operands) >= 2, f"a sum needs two terms, got {operands}"
    terms, lines = list(operands), []
    while len(terms) > 1:
        terms = [terms[0] + terms[1], *terms[2:]]
        lines.append("+".join(map(str, terms)))
    return " ".join(lines)


@TASKS.register("sum_think")
class SumThink(SumChain):
    name = "sum_think"

    def _prompt(self, item, uid: str) -> Prompt:
        return Prompt(uid=uid, text="+".join(map(str, item)) + "=" + OPEN, answer=str(sum(item)))

    def sft_example(self, prompt: Prompt) -> str:
        operands = [int(x) for x in prompt.text.removesuffix("=" + OPEN).split("+")]
        return rewrite_trace(operands) + CLOSE + prompt.answer
