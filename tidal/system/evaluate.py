"""Greedy held-out evaluation: the accuracy every learning curve is read from."""

from __future__ import annotations

from tidal.api import RolloutEngine
from tidal.rewards.pool import RewardPool
from tidal.rollout.requests import group_requests
from tidal.types import Prompt


def greedy_accuracy(
    engine: RolloutEngine, tokenizer, prompts: list[Prompt], reward_pool: RewardPool
) -> dict[str, float]:
    """Fraction of eval prompts whose greedy response gets full reward, and its mean length."""
    trajs = engine.generate(group_requests(tokenizer, prompts, 1), greedy=True)
    scores = reward_pool.score([(t.text, p) for t, p in zip(trajs, prompts)])
    correct = sum(1 for r, _ in scores if r >= 1.0)
    return {
        "eval/accuracy": correct / max(len(prompts), 1),
        "eval/response_len_mean": sum(t.num_tokens for t in trajs) / max(len(trajs), 1),
    }
