"""The RL end of the stage chain (``cli/stages_chain.py``, docs/stages.md)."""

from __future__ import annotations

from tidal.recipes import RECIPES
from tidal.recipes.quickstart import quickstart_grpo
from tidal.system.config import RunConfig


@RECIPES.register("stages_rl")
def stages_rl() -> RunConfig:
    """The quickstart's async RL on the stage chain's domain (``task.path``: its ``rl.jsonl``); set model.path.
    Plain GRPO (``quickstart_grpo``): a user's RL rows need no demonstrations."""
    cfg = quickstart_grpo()
    cfg.task.name = "jsonl"
    cfg.task.path = "runs/stages/domain/rl.jsonl"
    cfg.task.eval_path = "runs/stages/domain/eval.jsonl"
    cfg.reward.name = "exact_match"
    cfg.rollout.max_new_tokens = 4  # answers 0..98: 2 digits + EOS
    cfg.rollout.prompts_per_step = 32
    cfg.max_steps = 40
    cfg.max_time_s = 300.0
    cfg.target_accuracy = None
    cfg.num_eval = 200
    return cfg
