"""``reward.name=rm``: a trained reward model (``tidal rm``) scores RL samples, batched, in a reward worker.

The reward is ``scale * r + shift`` with r the model's scalar for the chat (one user turn with the prompt's
text, one assistant turn with the response). The pool hands a worker a chunk of samples and this reward
scores the chunk in one batched forward (``score_batch``); the model is loaded once per worker
(``warm_up``, before any scoring deadline), never pickled.

This module stays torch-free like every reward here: torch and the model code
(``tidal/models/reward_model.py``) are imported inside the worker on first use, so only a run that asks
for ``rm`` pays for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidal.config import ConfigError
from tidal.rewards import REWARDS
from tidal.types import Prompt

_SCORERS: dict[tuple, Any] = {}
"""One loaded model per (path, batch_size, max_length) per process."""


@REWARDS.register("rm")
@dataclass
class RewardModelReward:
    """Scores responses with the reward model saved at ``path``."""

    path: str = ""
    """A ``tidal rm`` run's ``model/`` directory."""
    batch_size: int = 32
    """Samples per forward pass."""
    max_length: int = 1024
    """Tokens per scored chat (longer ones are cut at the end)."""
    scale: float = 1.0
    shift: float = 0.0
    threads: int = 1
    """torch threads per worker (reward workers share the machine with the trainer)."""

    def __post_init__(self):
        if not self.path:
            raise ConfigError("reward 'rm' needs params.path: a reward model directory "
                              "(tidal rm ... --out DIR: DIR/model)")

    def _scorer(self):
        key = (self.path, self.batch_size, self.max_length)
        if key not in _SCORERS:
            from tidal.models.reward_model import RewardModelScorer

            _SCORERS[key] = RewardModelScorer(self.path, self.batch_size, self.max_length, self.threads)
        return _SCORERS[key]

    def warm_up(self) -> None:
        self._scorer()

    def score_batch(self, items: list[tuple[str, Prompt]]) -> list[tuple[float, dict[str, Any]]]:
        scores = self._scorer().score([(prompt.text, response) for response, prompt in items])
        return [(self.scale * s + self.shift, {"rm_score": s}) for s in scores]

    def __call__(self, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
        return self.score_batch([(response, prompt)])[0]
