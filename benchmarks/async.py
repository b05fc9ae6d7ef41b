"""Sync vs async RL throughput on a long-tailed response-length task, side by side in one run.

Both modes train the same warm-started tiny model on the ``repeat`` task (response lengths follow
a 1/n law up to ``task.max_repeat``), from the same seed, for the same number of steps, on the same
2 cores: sync alternates generation and training on 2 threads; async runs them concurrently with
1 intra-op thread each (FACTS.md: concurrent thread budgets must sum to the cores). Reported: trained samples
per second over the RL phase, the ratio, and held-out greedy accuracy at the end of each run.

    tidal bench async [--set max_steps=40 ...]
"""

from __future__ import annotations

import time
from pathlib import Path

from tidal.config import apply_overrides
from tidal.recipes import RECIPES
from tidal.system.run import train

DESCRIPTION = "sync vs async: trained samples/s on a long-tailed task, same cores, same steps"

BASE = [
    "task.name=repeat", "task.max_repeat=48", "task.num_eval=200", "rollout.max_new_tokens=56",
    "rollout.group_size=8", "rollout.prompts_per_step=16", "sft.steps=300", "sft.accuracy_band=null", "max_steps=40",
    "eval_every=1000",
    "max_time_s=null", "target_accuracy=null", "checkpoint_every=1000", "log.progress=false",
    "log.tensorboard=false", "log.report=false", "optim.lr=1e-4",
]
MODES = {
    "sync": ["system.mode=sync", "rollout.max_staleness=0", "system.num_threads=2"],
    "async": ["system.mode=async", "rollout.max_staleness=2", "system.async_threads=1"],
}


def run(overrides: list[str], out_dir: Path) -> dict:
    rows = []
    for mode, mode_overrides in MODES.items():
        cfg = apply_overrides(RECIPES.get("quickstart_grpo")(), [*BASE, *mode_overrides, *overrides])
        if mode == "sync":  # warm start outside the timed region (cached for the async run)
            from tidal.system.run import base_model_path
            from tidal.tasks import TASKS

            base_model_path(cfg, TASKS.get(cfg.task.name)(cfg.task), progress=False)
        start = time.perf_counter()
        result = train(cfg, out_dir / mode)
        wall = time.perf_counter() - start
        last = result.history[-1]
        rows.append({
            "mode": mode,
            "steps": result.steps,
            "trained_samples_per_s": last["perf/trained_samples_per_s"],
            "rl_seconds": last["time/elapsed_s"],
            "wall_s_with_evals": wall,
            "base_accuracy": result.base_accuracy,
            "final_accuracy": result.final_accuracy,
            "staleness_mean": sum(h.get("async/staleness_mean", 0) for h in result.history) / max(result.steps, 1),
            "response_len_mean": sum(h.get("rollout/response_len_mean", 0) for h in result.history[1:])
            / max(result.steps, 1),
        })
    ratio = rows[1]["trained_samples_per_s"] / rows[0]["trained_samples_per_s"]
    return {"benchmark": "async", "description": DESCRIPTION, "table": rows, "async_over_sync": ratio}
