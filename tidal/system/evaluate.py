"""Greedy held-out evaluation: the accuracy every learning curve is read from."""

from __future__ import annotations

from tidal.api import RolloutEngine
from tidal.rewards.pool import RewardPool
from tidal.rollout.episodes import episode_metrics
from tidal.rollout.requests import group_requests
from tidal.types import Prompt


def greedy_accuracy(
    engine: RolloutEngine, tokenizer, prompts: list[Prompt], reward_pool: RewardPool
) -> dict[str, float]:
    """Fraction of eval prompts whose greedy response gets full reward, and its mean length. Agent
    episodes (``EpisodeEngine``) were rewarded by their environment: success is that reward."""
    trajs = engine.generate(group_requests(tokenizer, prompts, 1), greedy=True)
    single = [(t, p) for t, p in zip(trajs, prompts) if t.episode is None]
    rewards = [r for r, _ in reward_pool.score([(t.text, p) for t, p in single])]
    rewards += [t.reward for t in trajs if t.episode is not None]
    correct = sum(1 for r in rewards if r >= 1.0)
    out = {
        "eval/accuracy": correct / max(len(prompts), 1),
        "eval/response_len_mean": sum(t.num_tokens for t in trajs) / max(len(trajs), 1),
    }
    agent = episode_metrics(trajs)
    for key in ("agent/turns_mean", "agent/tool_calls_mean", "agent/malformed"):
        if key in agent:
            out["eval/" + key.split("/")[1]] = agent[key]
    return out
