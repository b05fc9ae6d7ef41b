"""Thinking budgets: cap the ``<think>...</think>`` section of a response, then make the model answer.

Budget forcing (s1, Muennighoff et al. 2025, arXiv 2501.19393, sec. 3.1): when a response has spent
its thinking budget without closing the thinking section, the engine appends the closing delimiter
itself, and the model continues with its answer. Gemini 2.5 trains "thinking" with such a
controllable budget. Here a request carries ``thinking_budget`` (tokens of thinking allowed, counted
from the first response token: the thinking section is assumed open from the start, because the
prompt or the model's first tokens open it) and ``thinking_close`` (the token ids of ``</think>``).
The local engine (``local.py``, ``LocalEngine._force_think_close``) then substitutes the close
tokens for its samples once the budget is spent, unless the model closed the section itself; a close
the model had begun (``</`` of ``</think>``) is completed (``open_close_prefix``).

The forced tokens are not the policy's: they carry log-prob 0 and loss mask 0, so no behaviour
log-prob is trained on and the loss ignores them (as it ignores an agent's observation tokens); they
keep the engine's policy version, so a response forced from its first token still has an age for
the staleness bound. vLLM cannot substitute tokens mid-decode from a request; it would need the
two-phase form s1 used with it: generate with ``max_tokens = budget`` and ``stop=["</think>"]``,
then, if the stop was not hit, send prompt + thinking + close ids as a new prompt
(``prompt_token_ids``) for the answer, recording the close ids as forced. ``rollout.thinking``
therefore requires ``rollout.engine=local`` (``validate.py``).

In training a prompt's budget is drawn from ``budgets`` by a hash of (seed, prompt uid): the same
for all G samples of its group (so advantages compare like with like) and the same on resume. At
evaluation ``eval_budget`` holds for every prompt, and ``tidal eval --set
rollout.thinking.eval_budgets=[0,8,16,32]`` reports held-out accuracy at each budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.api import GenRequest
from tidal.config import ConfigError
from tidal.rollout.requests import unknown_ids
from tidal.utils.seeding import stable_hash


@dataclass
class ThinkingConfig:
    """``rollout.thinking``: per-request thinking budgets (budget forcing, s1 arXiv 2501.19393)."""

    budgets: list[int] = field(default_factory=list)
    """Training: each prompt's thinking budget is one of these (uniformly, by a hash of seed and prompt
    uid); empty: no budget in training."""
    eval_budget: int | None = None
    """The budget of every held-out evaluation request (None: unlimited)."""
    eval_budgets: list[int] = field(default_factory=list)
    """``tidal eval``: also report held-out accuracy at each of these budgets (the accuracy-vs-budget
    curve)."""
    close: str = "</think>"
    """The text that closes the thinking section; its tokens are what the engine forces. It must encode
    to at least one token, and (when a budget is set) only to tokens of the model's vocabulary."""

    @property
    def enabled(self) -> bool:
        """Whether any request gets a budget (training or evaluation): only then is ``close`` forced."""
        return bool(self.budgets or self.eval_budget is not None or self.eval_budgets)


def open_close_prefix(tokens: Sequence[int], close: tuple[int, ...]) -> int:
    """How many tokens of ``close`` the response ends with, short of all of them: the close the model
    had begun when its budget ran out, which forcing completes rather than writes again (a close of
    several tokens, such as ``</think>`` in a character vocabulary, is otherwise cut into ``</</think>``)."""
    for m in range(min(len(close) - 1, len(tokens)), 0, -1):
        if tuple(tokens[len(tokens) - m:]) == close[:m]:
            return m
    return 0


def close_ids(tokenizer, cfg: ThinkingConfig) -> tuple[int, ...]:
    """The token ids of ``cfg.close``; a ConfigError naming the key when there are none, or, with a budget
    set, when a character of it is not in the vocabulary (it encodes to the unknown token, the tiny
    tokenizer's <pad>, and forcing would write that instead of the close)."""
    ids = tuple(tokenizer(cfg.close, add_special_tokens=False).input_ids)
    if not ids:
        raise ConfigError(f"rollout.thinking.close={cfg.close!r} encodes to no tokens: give the text that closes "
                          "the thinking section, e.g. </think>")
    unknown = unknown_ids(tokenizer)
    if cfg.enabled and unknown.intersection(ids):
        bad = sorted({c for c in cfg.close if unknown.intersection(tokenizer(c, add_special_tokens=False).input_ids)})
        raise ConfigError(f"rollout.thinking.close={cfg.close!r} has characters the tokenizer cannot encode: {bad} "
                          f"(forcing would write {tokenizer.convert_ids_to_tokens(min(unknown))} instead)")
    return ids


def train_budget(cfg: ThinkingConfig, seed: int, uid: str) -> int | None:
    """The training budget of the prompt with ``uid`` (None when ``budgets`` is empty)."""
    if not cfg.budgets:
        return None
    return cfg.budgets[stable_hash(seed, "thinking", uid) % len(cfg.budgets)]


def with_budgets(requests: Sequence[GenRequest], budget, close: tuple[int, ...]) -> list[GenRequest]:
    """``requests`` with ``thinking_budget = budget(request.prompt)`` (None leaves a request unlimited)."""
    out = []
    for r in requests:
        b = budget(r.prompt)
        out.append(r if b is None else dataclasses.replace(r, thinking_budget=b, thinking_close=close))
    return out

