"""Held-out accuracy against the thinking budget, before and after RL with budgets sampled per prompt.

The task is ``sum_think`` (``tidal/tasks/think.py``): sums of 2-6 one-digit numbers, the prompt opening
``<think>``, the warm start's thoughts rewriting the sum one addition at a time
(``7+5+9+3=<think>12+9+3 21+3 24</think>24``), 1 to 34 thinking tokens by the number of terms. Per seed:

1. warm start the 1M tiny model on those traces (``sft_steps`` steps, cached under ``.tidal_cache``; one
   base, seed ``seed``, shared by the RL seeds);
2. greedy held-out accuracy at each budget in ``budgets`` and unlimited: when a response has written
   ``budget`` thinking tokens without closing the section, the engine writes ``</think>`` itself
   (budget forcing, s1 arXiv 2501.19393) and the model answers from what it has;
3. RL from that base (``rl_steps`` steps), each prompt's budget drawn from ``train_budgets``
   (``rollout.thinking.budgets``: one budget per group, forced tokens masked out of the loss), as
   Gemini 2.5 trains a controllable thinking budget;
4. the same curve for the trained policy.

Reported: ``base_accuracy_by_budget`` and ``thinking_accuracy_by_budget`` ({budget: accuracy}, the
median over seeds; ``"unlimited"`` is no budget), each seed's curves, the held-out accuracy during RL
(at the unlimited budget), and a plot (``thinking.png``). Steps, not seconds: the numbers do not
depend on the machine's load.

    tidal bench thinking [--set seeds=2 --set rl_steps=30 --set sft_steps=700 ...]
"""

from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import dataclass, field, fields
from pathlib import Path

from tidal.config import apply_overrides

DESCRIPTION = "held-out accuracy vs thinking budget (budget forcing), before and after RL with sampled budgets"


@dataclass
class Settings:
    max_terms: int = 6
    """The most one-digit terms in a sum (thoughts of up to 34 tokens: budget 32 cuts some, 16 most)."""
    eval_problems: int = 200
    budgets: list[int] = field(default_factory=lambda: [0, 8, 16, 32])
    """Evaluation budgets; the unlimited budget is always added."""
    train_budgets: list[int] = field(default_factory=lambda: [0, 8, 16, 32, 64])
    """RL: each prompt's budget is one of these (64 > the longest thought: unlimited)."""
    sft_steps: int = 700
    """Warm-start steps (batch 64, lr 1e-3), a fixed number: no accuracy band, the base is what it is."""
    rl_steps: int = 30
    eval_every: int = 10
    prompts_per_step: int = 128
    """The quickstart's batch (more samples per step made its RL smoother, ``recipes/quickstart.py``)."""
    group_size: int = 8
    lr: float = 2e-4
    max_new_tokens: int = 48
    """A full thought (34), the forced ``</think>`` (8 tokens), an answer of 2 digits and EOS fit."""
    seeds: int = 2
    seed: int = 0
    run: list[str] = field(default_factory=list)
    """Extra run-config overrides (RL and the warm start)."""


def run_config(s: Settings, seed: int, extra: list[str]):
    """The run: the quickstart's RL settings on ``sum_think``, scored by ``answer_match``."""
    from tidal.recipes import RECIPES

    return apply_overrides(RECIPES.get("quickstart_grpo")(), [
        "task.name=sum_think", "task.max_operand=9", f"task.max_terms={s.max_terms}",
        f"task.num_eval={s.eval_problems}", f"num_eval={s.eval_problems}", "reward.name=answer_match",
        f"rollout.max_new_tokens={s.max_new_tokens}", f"rollout.prompts_per_step={s.prompts_per_step}",
        f"rollout.group_size={s.group_size}", f"optim.lr={s.lr}", "trainer.pack_tokens=256",
        f"sft.steps={s.sft_steps}", "sft.accuracy_band=null", f"sft.seed={seed}", f"model.init_seed={seed}",
        f"seed={seed}", f"max_steps={s.rl_steps}", f"eval_every={s.eval_every}", "target_accuracy=null",
        "max_time_s=null", f"checkpoint_every={s.rl_steps}", "log.progress=false", "log.tensorboard=false",
        "log.report=false", *extra, *s.run])


def budget_curve(cfg, model_dir: Path, budgets: list[int | None]) -> dict[str, float]:
    """Greedy held-out accuracy of the model in ``model_dir`` at each budget (``accuracy_by_budget``)."""
    from tidal.models import tiny
    from tidal.rewards import build_reward
    from tidal.rewards.pool import RewardPool
    from tidal.rollout.evaluate import accuracy_by_budget
    from tidal.rollout.local import LocalEngine
    from tidal.rollout.thinking import close_ids
    from tidal.system.curriculum import build_task, run_reward

    model, tokenizer = tiny.load(model_dir)
    engine = LocalEngine(model, tokenizer, cfg.rollout, cfg.seed, 0)
    pool = RewardPool(build_reward(*run_reward(cfg)), cfg.reward)
    try:
        prompts = build_task(cfg).eval_prompts()[: cfg.num_eval]
        return accuracy_by_budget(engine, tokenizer, prompts, pool, budgets, close_ids(tokenizer, cfg.rollout.thinking))
    finally:
        pool.close()


def run(overrides: list[str], out_dir: Path) -> dict:
    from tidal.system.curriculum import build_task
    from tidal.system.run import base_model_path, train
    from tidal.train.checkpoint import latest_checkpoint

    s = apply_overrides(Settings(), overrides)
    budgets: list[int | None] = [*s.budgets, None]
    work = out_dir / "thinking"
    shutil.rmtree(work, ignore_errors=True)
    seeds = []
    # One warm start (seed ``s.seed``), shared by the RL seeds: on 2 shared cores it costs more than RL.
    cfg = run_config(s, s.seed, [])
    base = base_model_path(cfg, build_task(cfg), progress=False)
    before = budget_curve(cfg, base, budgets)
    for seed in range(s.seed, s.seed + s.seeds):
        rl = run_config(s, seed, [f"model.path={base}",
                                  f"rollout.thinking.budgets=[{','.join(map(str, s.train_budgets))}]"])
        result = train(rl, work / f"seed{seed}")
        after = budget_curve(rl, latest_checkpoint(work / f"seed{seed}" / "checkpoints"), budgets)
        seeds.append({"seed": seed, "base": before, "after_rl": after,
                      "rl_curve": [(h["step"], h["eval/accuracy"]) for h in result.history if "eval/accuracy" in h],
                      "think_forced_frac": statistics.fmean(h["rollout/think_forced_frac"] for h in result.history
                                                            if "rollout/think_forced_frac" in h)})
    keys = list(seeds[0]["base"])
    median = {part: {k: statistics.median(r[part][k] for r in seeds) for k in keys} for part in ("base", "after_rl")}
    table = [{"budget": k, "base_accuracy": median["base"][k], "after_rl_accuracy": median["after_rl"][k],
              "seeds": " / ".join(f"{r['base'][k]:.3f}->{r['after_rl'][k]:.3f}" for r in seeds)} for k in keys]
    plot = out_dir.parent / "thinking.png"
    _plot(median, len(seeds), plot)
    return {
        "benchmark": "thinking", "description": DESCRIPTION, "table": table,
        "thinking_accuracy_by_budget": median["after_rl"], "base_accuracy_by_budget": median["base"],
        "seed_results": seeds, "settings": {f.name: getattr(s, f.name) for f in fields(s)}, "plot": str(plot),
    }


def _plot(median: dict, num_seeds: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    keys = list(median["base"])
    for part, label in (("base", "warm start (one base)"),
                        ("after_rl", f"after RL with sampled budgets (median of {num_seeds} seeds)")):
        ax.plot(range(len(keys)), [median[part][k] for k in keys], marker="o", label=label)
    ax.set_xticks(range(len(keys)), keys)
    ax.set(xlabel="thinking budget (tokens; budget forcing)", ylabel="held-out greedy accuracy", ylim=(0, 1),
           title="sum_think: sums of 2-6 one-digit numbers, 1M model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run([], Path("benchmarks/results/thinking")), indent=2))
