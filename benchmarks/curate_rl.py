"""Does difficulty curation pay off in RL? The quickstart policy on a reasoning-gym problem set,
trained on the raw set and on the set curated by its own pass rate, compared in RL steps.

1. A problem set from reasoning-gym's ``basic_arithmetic`` at three difficulties (sums of two 1-, 2-
   or 3-digit numbers), shuffled; a separate held-out set from the same mix.
2. The quickstart's warm start (SFT on a separate pool of the same mix) gives a partial policy.
3. ``tidal curate rl-difficulty`` with that policy: 8 samples per problem, keep the problems it
   solves sometimes but not always (the problems whose GRPO groups have non-zero advantages).
4. RL from the same policy, same settings and seed, once on the raw set and once on the curated
   set, both evaluated on the same held-out set (greedy accuracy every ``eval_every`` steps).

Reported: the kept fraction (by level), each run's accuracy curve, the steps each needs to reach the
best accuracy the raw run reached, and the share of zero-advantage groups each trained on. RL steps, not seconds: the
comparison does not depend on the machine's load.

    tidal bench curate_rl [--set rl_steps=60 --set problems=1500 ...]
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

from tidal.config import apply_overrides

DESCRIPTION = "RL on a difficulty-curated reasoning-gym set vs the raw set: steps to a held-out accuracy"

LEVELS = {  # reasoning-gym basic_arithmetic configs (sums of two terms): easy, medium, hard
    "easy": dict(min_digits=1, max_digits=1),
    "medium": dict(min_digits=2, max_digits=2),
    "hard": dict(min_digits=3, max_digits=3),
}


@dataclass
class Settings:
    problems: int = 1500
    """Training problems (a third per level)."""
    eval_problems: int = 300
    samples: int = 8
    """Samples per problem for the pass rate."""
    min_pass_rate: float = 0.1
    max_pass_rate: float = 0.9
    rl_steps: int = 60
    eval_every: int = 5
    sft_pool: int = 30000
    """Problems from the same mix (another seed) the warm start trains on: the policy learns the task,
    not the RL set's answers."""
    sft_steps: int = 1000
    """Warm start to a partial policy. Measured on this mix (greedy, held out): 600 steps give 0.43 /
    0.09 / 0.02 on easy / medium / hard, 1000 give 0.35 / 0.81 / 0.10 (the prompts are longer than the
    addition quickstart's and the answers vary in width, so its 300 steps are too few)."""
    seed: int = 0
    run: list[str] = field(default_factory=list)
    """Extra run-config overrides for both RL runs."""


def make_problems(n: int, seed: int) -> list[dict]:
    import reasoning_gym

    rows = []
    for i, (level, cfg) in enumerate(LEVELS.items()):
        ds = reasoning_gym.create_dataset("basic_arithmetic", size=n // len(LEVELS), seed=seed * 10 + i, min_terms=2,
                                          max_terms=2, operators=("+",), allow_negation=False,
                                          allow_parentheses=False, **cfg)
        # lower-cased: the tiny model's character vocabulary has no capitals (the reward reads the
        # metadata, not the question)
        rows += [{"question": e["question"].lower(), "answer": str(e["answer"]), "metadata": e["metadata"],
                  "level": level} for e in ds]
    random.Random(seed).shuffle(rows)
    return rows


def _write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_config(s: Settings, train_path: Path, eval_path: Path, extra: list[str]):
    from tidal.recipes import RECIPES

    return apply_overrides(RECIPES.get("quickstart")(), [
        "task.name=jsonl", f"task.path={train_path}", f"task.eval_path={eval_path}", "task.fields.prompt=question",
        "task.fields.solution=answer", "reward.name=reasoning_gym", "rollout.max_new_tokens=8",
        f"sft.steps={s.sft_steps}", f"max_steps={s.rl_steps}", f"eval_every={s.eval_every}", "target_accuracy=null",
        "max_time_s=null", "checkpoint_every=100000", "log.progress=false", "log.tensorboard=false",
        "log.report=false", f"seed={s.seed}", *extra, *s.run])


def steps_to(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, acc in curve if acc >= target), None)


def run(overrides: list[str], out_dir: Path) -> dict:
    from tidal.data.curate import curate
    from tidal.system.run import base_model_path, train
    from tidal.tasks import TASKS

    s = apply_overrides(Settings(), overrides)
    work = out_dir / "curate_rl"
    problems = make_problems(s.problems + s.eval_problems, s.seed)
    eval_rows, train_rows = problems[: s.eval_problems], problems[s.eval_problems :]
    raw, held_out = _write(work / "raw.jsonl", train_rows), _write(work / "eval.jsonl", eval_rows)
    pool = _write(work / "sft_pool.jsonl", make_problems(s.sft_pool, s.seed + 1))

    # The policy: the quickstart's warm start on a separate pool of the mix (base_model_path caches it).
    cfg = run_config(s, pool, held_out, [])
    base = base_model_path(cfg, TASKS.get(cfg.task.name)(cfg.task), progress=False)

    curated = work / "curated.jsonl"
    report = curate("rl-difficulty", raw, curated, [
        "blocks=[difficulty]", "text_key=question", f"difficulty.model={base}", "difficulty.reward=reasoning_gym",
        f"difficulty.samples={s.samples}", "difficulty.max_new_tokens=8", f"difficulty.min_pass_rate={s.min_pass_rate}",
        f"difficulty.max_pass_rate={s.max_pass_rate}", "workers=1"], progress=False)
    block = report["blocks"][0]
    kept = [json.loads(line) for line in curated.read_text().splitlines()]
    if not kept:
        raise RuntimeError(f"the policy's pass rate put no problem in [{s.min_pass_rate}, {s.max_pass_rate}] "
                           f"({block['dropped']}): warm it up longer (sft_steps) or widen the band")

    runs = {}
    for name, path in (("raw", raw), ("curated", curated)):
        result = train(run_config(s, path, held_out, [f"model.path={base}"]), work / name)
        curve = [(h["step"], h["eval/accuracy"]) for h in result.history if "eval/accuracy" in h]
        groups = cfg.rollout.prompts_per_step
        runs[name] = {"curve": curve, "final_accuracy": result.final_accuracy, "base_accuracy": result.base_accuracy,
                      "zero_adv_frac": [h["algo/zero_adv_groups"] / groups for h in result.history
                                        if "algo/zero_adv_groups" in h]}
    target = max(acc for _, acc in runs["raw"]["curve"])  # the best the raw run reached
    table = []
    for name, r in runs.items():
        zero = r["zero_adv_frac"]
        table.append({"set": name, "problems": len(train_rows) if name == "raw" else len(kept),
                      "base_accuracy": r["base_accuracy"], "final_accuracy": r["final_accuracy"],
                      "steps_to_target": steps_to(r["curve"], target),
                      "zero_adv_frac_mean": sum(zero) / len(zero) if zero else None})
    raw_steps, cur_steps = table[0]["steps_to_target"], table[1]["steps_to_target"]
    _plot(runs, target, out_dir.parent / "curate_rl.png")
    return {
        "benchmark": "curate_rl", "description": DESCRIPTION, "table": table, "target_accuracy": target,
        "curated_steps_ratio": (raw_steps / cur_steps) if raw_steps and cur_steps else None,
        "kept_fraction": len(kept) / len(train_rows),
        "kept_by_level": dict(Counter(r["level"] for r in kept)),
        "dropped": block["dropped"], "curves": {k: v["curve"] for k, v in runs.items()},
        "settings": {f.name: getattr(s, f.name) for f in fields(s)}, "plot": str(out_dir.parent / "curate_rl.png"),
    }


def _plot(runs: dict, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in runs.items():
        steps, accs = zip(*r["curve"])
        ax.plot(steps, accs, marker="o", label=f"RL on the {name} set")
    ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:.3f}")
    ax.set(xlabel="RL step", ylabel="held-out greedy accuracy",
           title="reasoning-gym basic_arithmetic, quickstart policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
