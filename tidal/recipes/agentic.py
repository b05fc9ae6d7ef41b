"""The agentic CPU recipe: a tiny model learns to add long sums by calling a calculator, multi-turn."""

from __future__ import annotations

from tidal.recipes import RECIPES
from tidal.system.config import RunConfig


@RECIPES.register("agentic_quickstart")
def agentic_quickstart() -> RunConfig:
    """Tiny Qwen2 (1M params) adds 2-5 two-digit numbers with a calculator tool, async multi-turn RL.

    An episode (docs/agentic.md): ``12+34+56=`` -> ``<c>12+34</c>`` -> ``=46 `` -> ``<c>46+56</c>`` ->
    ``=102 `` -> ``102``; the model's turns end at ``</c>`` (a call) or EOS (the answer), the
    calculator's results are observation tokens (never trained on), and the reward is 1 for the right
    final answer. A warm start on correct tool-use traces (``calculator_trace``) stops at a partial
    base; RL takes it from there.
    """
    cfg = RunConfig()
    cfg.max_steps = 200
    cfg.max_time_s = 480.0
    cfg.target_accuracy = 0.85
    cfg.eval_every = 10
    cfg.checkpoint_every = 50
    cfg.num_eval = 200
    cfg.task.name = "sum_chain"
    cfg.task.max_terms = 5
    cfg.env.name = "calculator"
    cfg.env.max_turns = 6  # 5 terms need 4 calls and an answer
    cfg.rollout.max_new_tokens = 16  # per turn: "<c>123+45</c>" is 13 tokens
    cfg.rollout.group_size = 8
    cfg.rollout.prompts_per_step = 32
    cfg.rollout.max_staleness = 1
    cfg.optim.lr = 2e-4
    cfg.system.mode = "async"
    return cfg
