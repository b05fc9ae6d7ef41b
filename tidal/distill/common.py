"""What the offline distillation pipelines share: the task, an evaluator, and a teacher's engine.

Students and teachers are evaluated exactly as an RL run evaluates its policy (greedy held-out accuracy
through the local engine and the run's reward), so a distilled student's number and an RL student's
number are the same measurement.
"""

from __future__ import annotations

from pathlib import Path

from tidal.config import ConfigError
from tidal.models import tiny
from tidal.rewards import build_reward
from tidal.rewards.pool import RewardPool
from tidal.rollout.evaluate import greedy_accuracy
from tidal.rollout.local import LocalEngine
from tidal.tasks import TASKS


def load_task(cfg):
    return TASKS.get(cfg.task.name)(cfg.task)


def reward_pool(cfg) -> RewardPool:
    return RewardPool(build_reward(cfg.reward.name, cfg.reward.params), cfg.reward)


def load_model(path: str | Path, what: str):
    """``tiny.load`` with a one-line error naming the flag when the directory holds no model."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ConfigError(f"--{what} {str(path)!r}: no Hugging Face model there (expected config.json)")
    return tiny.load(path)


def check_same_vocab(teacher_tok, student_tok, teacher_path) -> None:
    if teacher_tok.get_vocab() != student_tok.get_vocab():
        raise ConfigError(f"--teacher {str(teacher_path)!r}: its tokenizer's vocabulary differs from the student's; "
                          "logit distillation needs the same vocabulary (trace distillation does not)")


def evaluator(cfg, tokenizer, pool: RewardPool, task=None):
    """``evaluate(model) -> held-out greedy accuracy`` on the run's first ``num_eval`` eval prompts."""
    prompts = (task or load_task(cfg)).eval_prompts()[: cfg.num_eval]

    def evaluate(model) -> float:
        engine = LocalEngine(model, tokenizer, cfg.rollout, cfg.seed, 0)
        return greedy_accuracy(engine, tokenizer, prompts, pool)["eval/accuracy"]

    return evaluate
