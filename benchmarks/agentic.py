"""Sync vs async agent RL when tools are slow: trained episodes per second, side by side in one run.

Both modes run ``agentic_sums`` (a tiny model adds 2-5 numbers with a calculator tool, one call
per pair, so episodes take 1-5 turns with a long tail) from the same warm-started base and seed, for
the same number of steps, on the same 2 cores. Every tool call waits a simulated latency drawn from a
lognormal (``env.latency_median_s``, sigma 1.3: median 100 ms -> p99 ~2 s, like sandboxes and search
APIs), keyed by (seed, episode, turn) so both modes wait exactly the same. Sync generates a whole
batch, waiting for its slowest episode's chain of tool calls, then trains; async keeps other episodes
decoding while some wait (eta = 1), and trains concurrently.

Reported per latency scale and mode: trained episodes per second over the RL phase (and the ratio),
the engine's idle fraction (1 - time spent decoding / RL time), the share of episodes whose tokens
span several policy versions, held-out success at the end, and the mean number of terms k of the
episodes trained on against the data's (tidal trains groups in stream order, so a slow episode is
waited for, never skipped: the two must match). Headline keys: ``async_over_sync`` (at
``realistic_latency_s``), ``final_success_sync`` and ``final_success_async`` (there).

    tidal bench agentic [--set latencies=[0.0,0.1]] [--set steps=30] [--set async_staleness=4]
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tidal.config import apply_overrides
from tidal.recipes import RECIPES
from tidal.system.run import base_model_path, close, prepare
from tidal.tasks import TASKS

DESCRIPTION = "sync vs async agent RL with slow tools: trained episodes/s, engine idle, success"

def modes(async_staleness: int) -> dict[str, list[str]]:
    return {"sync": ["system.mode=sync", "rollout.max_staleness=0", "system.num_threads=2"],
            "async": ["system.mode=async", f"rollout.max_staleness={async_staleness}", "system.async_threads=1"]}


@dataclass
class Settings:
    """This benchmark's own knobs; every other ``--set`` key goes to the run config."""

    latencies: list[float] = field(default_factory=lambda: [0.0, 0.1])
    """Median simulated tool latencies (seconds) to measure; 0 is no latency."""
    realistic_latency_s: float = 0.1
    """The scale the headline ratio is read at."""
    steps: int = 30
    async_staleness: int = 1
    """eta of the async arm (the recipe's 1; a larger eta lets generation run further ahead of a step
    that waits for its slowest episode)."""


def num_terms(prompt) -> int:
    return prompt.text.count("+") + 1


def run_mode(overrides: list[str], out: Path) -> dict:
    cfg = apply_overrides(RECIPES.get("agentic_sums")(), overrides)
    controller = prepare(cfg, out)
    trained_k: list[int] = []
    real = controller._train_step

    def record(step, groups):
        trained_k.extend(num_terms(g.prompt) for g in groups for _ in g.trajectories)
        return real(step, groups)

    controller._train_step = record
    try:
        result = controller.run()
    finally:
        close(controller)
    last = result.history[-1]
    rows = [h for h in result.history if "agent/multi_version_frac" in h]
    drawn = controller.state.next_group
    data_k = [num_terms(controller.task.train_prompt(i)) for i in range(drawn)]
    return {
        "steps": result.steps,
        "trained_episodes_per_s": last["perf/trained_samples_per_s"],
        "rl_seconds": last["time/elapsed_s"],
        "engine_idle_frac": 1 - last.get("rollout/engine_busy_s", 0.0) / max(last["time/elapsed_s"], 1e-9),
        "multi_version_frac": statistics.mean(h["agent/multi_version_frac"] for h in rows) if rows else 0.0,
        "turns_mean": statistics.mean(h["agent/turns_mean"] for h in rows) if rows else 0.0,
        "base_success": result.base_accuracy,
        "final_success": result.final_accuracy,
        "trained_k_mean": statistics.mean(trained_k) if trained_k else None,
        "data_k_mean": statistics.mean(data_k) if data_k else None,
    }


def run(overrides: list[str], out_dir: Path) -> dict:
    own = {f.name for f in dataclasses.fields(Settings)}
    mine = [o for o in overrides if o.partition("=")[0].strip() in own]
    s = apply_overrides(Settings(), mine)
    common = [f"max_steps={s.steps}", "eval_every=100000", "max_time_s=null", "target_accuracy=null",
              "checkpoint_every=100000", "log.progress=false", "log.tensorboard=false", "log.report=false",
              *(o for o in overrides if o not in mine)]
    cfg = apply_overrides(RECIPES.get("agentic_sums")(), common)
    base_model_path(cfg, TASKS.get(cfg.task.name)(cfg.task), progress=False)  # warm start outside the timing
    table = []
    for latency in s.latencies:
        for mode, mode_overrides in modes(s.async_staleness).items():
            row = {"latency_median_s": latency, "mode": mode,
                   **run_mode([*common, *mode_overrides, f"env.latency_median_s={latency}"],
                              out_dir / f"lat{latency}-{mode}")}
            table.append(row)
            print(json.dumps(row), flush=True)
    ratios = {}
    for latency in s.latencies:
        by = {r["mode"]: r for r in table if r["latency_median_s"] == latency}
        ratios[str(latency)] = by["async"]["trained_episodes_per_s"] / by["sync"]["trained_episodes_per_s"]
    real = {r["mode"]: r for r in table if r["latency_median_s"] == s.realistic_latency_s}
    return {"benchmark": "agentic", "description": DESCRIPTION, "table": table,
            "async_over_sync_by_latency": ratios,
            "async_over_sync": ratios.get(str(s.realistic_latency_s)),
            "final_success_sync": real.get("sync", {}).get("final_success"),
            "final_success_async": real.get("async", {}).get("final_success"),
            "realistic_latency_s": s.realistic_latency_s, "async_staleness": s.async_staleness, "steps": s.steps,
            "overrides": overrides}
