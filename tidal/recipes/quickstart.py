"""The CPU recipes: a tiny model learns 2-digit addition with async RL in minutes."""

from __future__ import annotations

from tidal.recipes import RECIPES
from tidal.system.config import RunConfig


@RECIPES.register("quickstart")
def quickstart() -> RunConfig:
    """Tiny Qwen2 (1M params), 2-digit addition: warm start to a partial base, then async RL (eta=1)."""
    cfg = RunConfig()
    cfg.max_steps = 600
    cfg.max_time_s = 420.0
    cfg.target_accuracy = 0.85
    cfg.eval_every = 10
    cfg.checkpoint_every = 50
    cfg.rollout.max_new_tokens = 6  # answers are at most 3 digits + EOS
    cfg.rollout.group_size = 8
    cfg.rollout.prompts_per_step = 16
    cfg.rollout.max_staleness = 1
    cfg.system.mode = "async"
    return cfg


@RECIPES.register("quickstart_sync")
def quickstart_sync() -> RunConfig:
    """The quickstart with synchronous RL (generate, then train), for comparison."""
    cfg = quickstart()
    cfg.system.mode = "sync"
    cfg.rollout.max_staleness = 0
    return cfg
