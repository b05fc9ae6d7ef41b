"""Greedy held-out evaluation: the accuracy every learning curve is read from.

An episode that failed (its environment or agent crashed, its reward raised: ``Trajectory.failure``) scores 0,
and the share that failed is logged as ``eval/failed``. When every episode failed the evaluation measured
nothing, and an accuracy of 0.0 would read as a model that answers nothing right: ``check_evaluation`` raises
``AllFailed`` instead, one line naming the first failure (a run stops on it as on a failed engine).
"""

from __future__ import annotations

from tidal.api import AllFailed, RolloutEngine
from tidal.rewards.pool import RewardPool
from tidal.rollout.episodes import episode_metrics
from tidal.rollout.requests import group_requests
from tidal.rollout.thinking import with_budgets
from tidal.types import Prompt, Trajectory


def greedy_samples(engine: RolloutEngine, tokenizer, prompts: list[Prompt], reward_pool: RewardPool,
                   thinking: tuple[int, tuple[int, ...]] | None = None) -> list[Trajectory]:
    """Each eval prompt's greedy response, scored (``reward`` and ``reward_details`` set). Agent episodes
    (``EpisodeEngine``) were rewarded by their environment and harness episodes by their agent: their
    reward is kept, unless ``Trajectory.score_text`` says the final answer is scored here. ``thinking``:
    ``(budget, close ids)`` gives every request that thinking budget (``rollout/thinking.py``)."""
    requests = group_requests(tokenizer, prompts, 1)
    if thinking is not None:
        requests = with_budgets(requests, lambda p: thinking[0], thinking[1])
    trajs = engine.generate(requests, greedy=True)
    single = [(t, p) for t, p in zip(trajs, prompts) if t.score_text is not None]
    for (t, _), (reward, details) in zip(single, reward_pool.score([(t.score_text, p) for t, p in single])):
        t.reward, t.reward_details = reward, details
    return trajs


def one_line(text: str, limit: int = 300) -> str:
    """``text`` (a reason, perhaps a traceback) on one line, cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_evaluation(trajs: list[Trajectory], where: str = "the held-out evaluation") -> None:
    """``AllFailed`` when every one of ``trajs`` failed (module docstring)."""
    reasons = [t.failure for t in trajs if t.failure]
    if trajs and len(reasons) == len(trajs):
        raise AllFailed(f"{where}: every one of its {len(trajs)} episodes failed, so it has no accuracy (first: "
                        f"{one_line(reasons[0])}); fix the environment or reward")


def accuracy_metrics(trajs: list[Trajectory], num_prompts: int) -> dict[str, float]:
    """Fraction of eval prompts whose greedy response gets full reward, and its mean length; ``eval/failed``, the
    share of episodes that failed (``Trajectory.failure``), when any did."""
    correct = sum(1 for t in trajs if t.reward >= 1.0)
    out = {
        "eval/accuracy": correct / max(num_prompts, 1),
        "eval/response_len_mean": sum(t.num_tokens for t in trajs) / max(len(trajs), 1),
    }
    failed = sum(1 for t in trajs if t.failure)
    if failed:
        out["eval/failed"] = failed / max(len(trajs), 1)
    agent = episode_metrics(trajs)
    for key in ("agent/turns_mean", "agent/tool_calls_mean", "agent/malformed"):
        if key in agent:
            out["eval/" + key.split("/")[1]] = agent[key]
    return out


def per_task_accuracy(trajs: list[Trajectory], prompts: list[Prompt]) -> dict[str, float]:
    """``eval/<task>/accuracy`` for prompts tagged with ``meta["task"]`` (a task mixture); {} otherwise."""
    by_task: dict[str, list[float]] = {}
    for t, p in zip(trajs, prompts):
        if "task" in p.meta:
            by_task.setdefault(p.meta["task"], []).append(float(t.reward >= 1.0))
    return {f"eval/{name}/accuracy": sum(v) / len(v) for name, v in sorted(by_task.items())}


def greedy_accuracy(
    engine: RolloutEngine, tokenizer, prompts: list[Prompt], reward_pool: RewardPool,
    thinking: tuple[int, tuple[int, ...]] | None = None,
) -> dict[str, float]:
    """``accuracy_metrics`` (and ``per_task_accuracy``) of ``greedy_samples``; ``AllFailed`` when every episode
    failed (``check_evaluation``)."""
    trajs = greedy_samples(engine, tokenizer, prompts, reward_pool, thinking)
    check_evaluation(trajs)
    return {**accuracy_metrics(trajs, len(prompts)), **per_task_accuracy(trajs, prompts)}


def accuracy_by_budget(engine: RolloutEngine, tokenizer, prompts: list[Prompt], reward_pool: RewardPool,
                       budgets: list[int | None], close: tuple[int, ...]) -> dict[str, float]:
    """Greedy held-out accuracy at each thinking budget (budget forcing, ``rollout/thinking.py``): the
    accuracy-vs-budget curve, keyed by the budget as text (``"unlimited"`` for None, JSON-ready)."""
    return {("unlimited" if b is None else str(b)):
            greedy_accuracy(engine, tokenizer, prompts, reward_pool, None if b is None else (b, close))["eval/accuracy"]
            for b in budgets}
