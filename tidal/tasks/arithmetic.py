"""Synthetic verifiable tasks generated in-project (no downloads).

``addition``: "a+b=" -> "c" for operands in [0, max_operand], zero-padded to fixed widths by
default ("07+45=" -> "052"). The pair space is split once, by a seeded hash, into train and
held-out eval pairs, so eval problems are never trained on (neither in
the supervised warm start nor in RL). For a pretrained chat model the question is asked in words:
``task.template`` over the columns ``{a}`` and ``{b}`` ("What is {a} + {b}?"; answers then are never
zero-padded), and ``task.params.min_operand`` (default 0) makes both operands, say, two-digit (10).

``repeat``: "n*c=" -> c repeated n times, with n drawn from a long-tailed (Zipf-like) distribution.
Its response lengths are long-tailed by construction, which is where synchronous RL wastes time
waiting for the longest sample (the async benchmark uses it).

``sum_chain``: "12+34+56=" -> "102", k operands in [0, max_operand], k drawn geometric (1/2) in
[2, max_terms] and the draws deduplicated into ``num_problems`` distinct sums. Two terms have only
10,000 distinct sums, so deduplication flattens the geometric head: with the defaults (max_terms 5)
the problems are about 20% two-term, 40% three-term and 20% each four- and five-term, in train and
held-out alike (mean k 3.4; with max_terms 3: 20% / 80%). Too long for the tiny model to add in one
go, easy with a calculator called on two
terms at a time (the agentic quickstart): its warm-start example is that tool-use trace
(``task.params.demos=answer`` gives the bare answer instead, to measure the model without a tool;
``task.params.pad_operands=true`` zero-pads operands to ``max_operand``'s width, "07+45=", which the
calculator reads too).

``product``: "37*54=" -> "1998", a d1-digit times a d2-digit number (``task.params.digits``, default
[2, 2]: 8,100 problems). Beyond what the 1M model multiplies in its head; one calculator call solves
it: the model copies two short operands into the call and the result into its answer. Its warm-start
example (``task.params.demos``) is ``tool`` (default), the calculator episode as one text
(``<c>37*54</c>=1998 1998``, ``agentic_quickstart``), ``chat_tool``, the conversation of an agent that
calls a ``calculator`` tool through the OpenAI API (user, assistant tool call, tool result, assistant
answer; rendered by the chat template; ``harness_quickstart``), or ``answer``, the bare product (to
measure the model without a tool).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod

from tidal.envs.calculator import calculator_call_trace, calculator_trace
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig
from tidal.tasks.rows import check_template, render
from tidal.types import Prompt
from tidal.utils.seeding import stable_hash

# TaskConfig moved to tasks/config.py; importable here too
__all__ = ["Addition", "Product", "Repeat", "SumChain", "TaskConfig"]


class _SplitTask(ABC):
    """Shared logic: a finite problem space split by hash into train and eval parts."""

    name = "base"

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        space = self._space()
        rng = random.Random(cfg.seed)
        order = sorted(space, key=lambda item: stable_hash(cfg.seed, self.name, item))
        if cfg.num_eval >= len(order):
            raise ValueError(f"task {self.name}: num_eval={cfg.num_eval} leaves no training problems "
                             f"(only {len(order)} exist)")
        self._eval = order[: cfg.num_eval]
        self._train = order[cfg.num_eval :]
        rng.shuffle(self._train)
        self._cached_epoch: tuple[int, list] = (-1, [])

    @abstractmethod
    def _space(self) -> list:
        """Every problem of the task, as hashable items."""

    @abstractmethod
    def _prompt(self, item, uid: str) -> Prompt:
        """The prompt (and reference answer) for one item."""

    @property
    def num_train(self) -> int:
        return len(self._train)

    def train_prompt(self, index: int) -> Prompt:
        """The index-th training prompt: a deterministic, endless stream (epochs reshuffled)."""
        epoch, pos = divmod(index, len(self._train))
        return self._prompt(self._epoch_order(epoch)[pos], f"train-{index}")

    def _epoch_order(self, epoch: int) -> list:
        """Epoch 0 is the seeded shuffle; later epochs are reshuffled by hash (cached, one at a time)."""
        if epoch == 0:
            return self._train
        if self._cached_epoch[0] != epoch:
            order = sorted(self._train, key=lambda it: stable_hash(self.cfg.seed, epoch, it))
            self._cached_epoch = (epoch, order)
        return self._cached_epoch[1]

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(item, f"eval-{i}") for i, item in enumerate(self._eval)]

    def sft_example(self, prompt: Prompt) -> str:
        return prompt.answer


@TASKS.register("addition")
class Addition(_SplitTask):
    name = "addition"

    def _space(self) -> list:
        low = self.cfg.params.get("min_operand", 0)
        if not isinstance(low, int) or not 0 <= low <= self.cfg.max_operand:
            raise ValueError(f"task addition: params.min_operand={low!r} must be an integer in [0, max_operand]")
        check_template(self.cfg.template)
        return [(a, b) for a in range(low, self.cfg.max_operand + 1) for b in range(low, self.cfg.max_operand + 1)]

    def _prompt(self, item, uid: str) -> Prompt:
        a, b = item
        if self.cfg.template is not None:
            return Prompt(uid=uid, text=render(self.cfg.template, {"a": a, "b": b}), answer=str(a + b))
        if self.cfg.fixed_width:
            w = len(str(self.cfg.max_operand))
            return Prompt(uid=uid, text=f"{a:0{w}d}+{b:0{w}d}=", answer=f"{a + b:0{w + 1}d}")
        return Prompt(uid=uid, text=f"{a}+{b}=", answer=str(a + b))


@TASKS.register("repeat")
class Repeat(_SplitTask):
    name = "repeat"
    _letters = "abcdefghijklmnopqrstuvwxyz"

    def _space(self) -> list:
        # Zipf-like weights over lengths: each length appears in proportion to 1/n, so most
        # responses are short and a few are long (a long tail, as in reasoning RL).
        space = []
        for n in range(1, self.cfg.max_repeat + 1):
            copies = max(1, round(self.cfg.max_repeat / n))
            space += [(n, c, k) for c in self._letters for k in range(copies)]
        return space

    def _prompt(self, item, uid: str) -> Prompt:
        n, c, _ = item
        return Prompt(uid=uid, text=f"{n}*{c}=", answer=c * n)


@TASKS.register("sum_chain")
class SumChain(_SplitTask):
    name = "sum_chain"
    num_problems = 50_000
    """Distinct problems drawn (the space of all sums is too large to list)."""

    def _space(self) -> list:
        if self.cfg.max_terms < 2:
            raise ValueError(f"task sum_chain: max_terms={self.cfg.max_terms} must be at least 2")
        rng = random.Random(stable_hash(self.cfg.seed, self.name))
        seen: set[tuple[int, ...]] = set()
        for _ in range(self.num_problems * 2):
            k = 2
            while k < self.cfg.max_terms and rng.random() < 0.5:
                k += 1
            seen.add(tuple(rng.randint(0, self.cfg.max_operand) for _ in range(k)))
            if len(seen) >= self.num_problems:
                break
        return sorted(seen)

    def _prompt(self, item, uid: str) -> Prompt:
        w = len(str(self.cfg.max_operand)) if self.cfg.params.get("pad_operands", False) else 1
        return Prompt(uid=uid, text="+".join(f"{x:0{w}d}" for x in item) + "=", answer=str(sum(item)))

    def sft_example(self, prompt: Prompt) -> str:
        demos = self.cfg.params.get("demos", "tool")
        if demos not in ("tool", "answer"):
            raise ValueError(f"task.params.demos={demos!r}: use 'tool' (a calculator trace) or 'answer'")
        if demos == "answer":
            return prompt.answer
        return calculator_trace(prompt.text.rstrip("=").split("+"))


@TASKS.register("product")
class Product(_SplitTask):
    name = "product"

    def _digits(self) -> tuple[int, int]:
        digits = self.cfg.params.get("digits", [2, 2])
        if (not isinstance(digits, (list, tuple)) or len(digits) != 2
                or not all(isinstance(d, int) and 1 <= d <= 6 for d in digits)):
            raise ValueError(f"task product: params.digits={digits!r} must be two digit counts in [1, 6]")
        return digits[0], digits[1]

    def _space(self) -> list:
        (d1, d2) = self._digits()
        return [(a, b) for a in range(10 ** (d1 - 1), 10**d1) for b in range(10 ** (d2 - 1), 10**d2)]

    def _prompt(self, item, uid: str) -> Prompt:
        a, b = item
        return Prompt(uid=uid, text=f"{a}*{b}=", answer=str(a * b))

    def sft_example(self, prompt: Prompt) -> str | list[dict]:
        demos = self.cfg.params.get("demos", "tool")
        if demos == "answer":
            return prompt.answer
        if demos == "tool":
            return calculator_call_trace(prompt.text.rstrip("="))
        if demos != "chat_tool":
            raise ValueError(f"task.params.demos={demos!r}: use 'tool' (a calculator episode), 'chat_tool' (an "
                             "agent's calculator conversation) or 'answer'")
        return calculator_conversation(prompt.text, prompt.text.rstrip("="), prompt.answer)


def calculator_conversation(question: str, expression: str, answer: str) -> list[dict]:
    """A correct tool-using conversation in the OpenAI message format: the agent's user message, one
    ``calculator`` call with ``expression``, the tool's result, and the answer."""
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": answer},
            {"role": "assistant", "content": answer}]
