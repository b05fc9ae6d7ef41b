"""The vision-language recipe: a tiny Qwen2-VL learns to count squares in a picture with async RL, on a CPU."""

from __future__ import annotations

from tidal.recipes import RECIPES
from tidal.system.config import RunConfig


@RECIPES.register("vlm_quickstart")
def vlm_quickstart() -> RunConfig:
    """Tiny Qwen2-VL (~0.8M parameters, ``model.vision``), ``count_squares`` (how many squares in a 56x56
    picture, 4 image tokens): warm start into a partial base, then async RL on the pictures (docs/vlm.md)."""
    cfg = RunConfig()
    cfg.model.vision = True
    cfg.model.num_layers = 2
    cfg.model.max_position_embeddings = 64  # a prompt is 31 tokens, an answer 2
    cfg.task.name = "count_squares"
    cfg.task.num_eval = 200
    cfg.reward.name = "exact_match"
    cfg.max_steps = 200
    cfg.max_time_s = 600.0
    cfg.target_accuracy = 0.9
    cfg.eval_every = 10
    cfg.checkpoint_every = 50
    cfg.rollout.max_new_tokens = 2  # one digit + EOS
    cfg.rollout.group_size = 8
    cfg.rollout.prompts_per_step = 64
    cfg.rollout.max_staleness = 1
    cfg.optim.lr = 1e-4
    cfg.system.mode = "async"
    cfg.trainer.share_prefixes = True
    # The picture's features collapse to a constant at lr >= 1e-3 (docs/vlm.md's supervised sweep); 1e-4 learns.
    cfg.sft.lr = 1e-4
    cfg.sft.accuracy_band = [0.40, 0.50]
    cfg.sft.steps = 1500
    return cfg
