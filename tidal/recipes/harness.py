"""The harness CPU recipe: an agent written against the ``openai`` client, trained through tidal's endpoint."""

from __future__ import annotations

from tidal.recipes import RECIPES
from tidal.system.config import RunConfig


@RECIPES.register("harness_quickstart")
def harness_quickstart() -> RunConfig:
    """Tiny Qwen2 (1M params) + ``examples/calculator_agent.py`` (OpenAI function calling): 2-digit products.

    MEASUREMENTS PENDING
    """
    cfg = RunConfig()
    cfg.max_steps = 200
    cfg.max_time_s = 480.0
    cfg.target_accuracy = 0.9
    cfg.eval_every = 10
    cfg.checkpoint_every = 50
    cfg.num_eval = 200
    cfg.task.name = "product"
    cfg.task.max_operand = 99
    cfg.task.num_eval = 200
    cfg.model.tokenizer = "chat"
    cfg.model.max_position_embeddings = 192
    cfg.sft.accuracy_band = [0.3, 0.5]
    cfg.harness.function = "examples/calculator_agent.py:run_episode"
    cfg.rollout.max_new_tokens = 64  # per turn: the call is 59 tokens with its end-of-turn marker
    cfg.rollout.group_size = 8
    cfg.rollout.prompts_per_step = 32
    cfg.rollout.max_staleness = 1
    cfg.optim.lr = 2e-4
    cfg.system.mode = "async"
    return cfg
