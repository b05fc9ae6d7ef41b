"""Greedy held-out evaluation: the accuracy every learning curve is read from."""

from __future__ import annotations

from tidal.api import RolloutEngine
from tidal.rewards.pool import RewardPool
from tidal.rollout.episodes import episode_metrics
from tidal.rollout.requests import group_requests
from tidal.types import Prompt, Trajectory


def greedy_samples(engine: RolloutEngine, tokenizer, prompts: list[Prompt],
                   reward_pool: RewardPool) -> list[Trajectory]:
    """Each eval prompt's greedy response, scored (``reward`` and ``reward_details`` set). Agent episodes
    (``EpisodeEngine``) were rewarded by their environment: their reward is kept."""
    trajs = engine.generate(group_requests(tokenizer, prompts, 1), greedy=True)
    single = [(t, p) for t, p in zip(trajs, prompts) if t.episode is None]
    for (t, _), (reward, details) in zip(single, reward_pool.score([(t.text, p) for t, p in single])):
        t.reward, t.reward_details = reward, details
    return trajs


def accuracy_metrics(trajs: list[Trajectory], num_prompts: int) -> dict[str, float]:
    """Fraction of eval prompts whose greedy response gets full reward, and its mean length."""
    correct = sum(1 for t in trajs if t.reward >= 1.0)
    out = {
        "eval/accuracy": correct / max(num_prompts, 1),
        "eval/response_len_mean": sum(t.num_tokens for t in trajs) / max(len(trajs), 1),
    }
    agent = episode_metrics(trajs)
    for key in ("agent/turns_mean", "agent/tool_calls_mean", "agent/malformed"):
        if key in agent:
            out["eval/" + key.split("/")[1]] = agent[key]
    return out


def greedy_accuracy(
    engine: RolloutEngine, tokenizer, prompts: list[Prompt], reward_pool: RewardPool
) -> dict[str, float]:
    """``accuracy_metrics`` of ``greedy_samples``."""
    return accuracy_metrics(greedy_samples(engine, tokenizer, prompts, reward_pool), len(prompts))
