"""Recipes on real pretrained chat models from PyPI wheels (``models/catalog.py``): RL on a laptop CPU with the
model a user would bring, not the tiny character model."""

from __future__ import annotations

from tidal.recipes import RECIPES
from tidal.system.config import RunConfig


@RECIPES.register("smollm2_quickstart")
def smollm2_quickstart() -> RunConfig:
    """SmolLM2-135M-Instruct (imported from its PyPI wheel on first use), 2-digit addition asked in words in its
    chat template, async RL scored by ``last_number``.

    The base answers in sentences ("37 + 48 = 85"), so the reward reads the last number of the answer and
    refuses restatements of the question and lists of candidates (``rewards/last_number.py``): the
    ``math`` reward in lenient mode was gamed by this model in 5 steps ("22+13 is 22+13." scored 1.0).
    """
    cfg = RunConfig()
    cfg.model.path = "smollm2-135m-instruct"
    cfg.task.name = "addition"
    cfg.task.template = "What is {a} + {b}?"
    cfg.task.params = {"min_operand": 10}  # both operands two-digit: 8,100 problems
    cfg.task.num_eval = 200
    cfg.reward.name = "last_number"
    cfg.max_steps = 40
    cfg.max_time_s = 840.0  # 14 minutes of RL: the model's import and load fit in the 15-minute goal
    cfg.eval_every = 5
    cfg.checkpoint_every = 10
    cfg.rollout.max_new_tokens = 32
    cfg.rollout.temperature = 0.7
    cfg.trainer.temperature = 0.7
    cfg.rollout.group_size = 8
    cfg.rollout.prompts_per_step = 8
    cfg.rollout.max_staleness = 1
    cfg.optim.lr = 1e-5
    cfg.system.mode = "async"
    # A group's 8 samples share a ~40-token chat prompt (the template's system prompt included): computed
    # once per group in the trainer.
    cfg.trainer.share_prefixes = True
    return cfg
