"""Online difficulty weighting vs uniform sampling vs an offline curated set, in RL steps.

The pool is ``curate_rl``'s (reasoning-gym sums of two 1- to 5-digit numbers, a fifth per width, and
the same held-out mix), the policy its warm start (1- to 3-digit sums only), so most 4- and 5-digit
problems are hopeless and many 1-digit ones always solved: the groups they give have zero advantage.
Three arms from the same policy, same steps and seeds, evaluated on the same held-out set:

- ``uniform``: the raw pool in stream order (every problem once per epoch);
- ``online``: the raw pool drawn by online pass-rate weights (``curriculum.difficulty.enabled``),
  learned from the groups the run scores anyway;
- ``offline``: the pool curated first by ``tidal curate rl-difficulty`` (``samples`` answers per
  problem from the policy, keep pass rates in [min, max]), then trained in stream order. Its extra
  generation pass is the cost the online arm avoids: reported as samples generated (and seconds,
  measured on a shared machine: noise).

Reported: each arm's held-out accuracy curve (mean over seeds) and final accuracy, and the share of
zero-advantage groups in its batches. Top-level keys: ``uniform_final_accuracy``,
``online_final_accuracy``, ``offline_final_accuracy`` (seed means), ``offline_pass``.

    tidal bench curriculum [--set rl_steps=40 --set seeds=2 --set problems=600 ...]
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from tidal.bench import load
from tidal.config import apply_overrides

DESCRIPTION = "online difficulty weighting vs uniform vs an offline curated set: held-out accuracy vs RL steps"


@dataclass
class Settings:
    problems: int = 600
    """Raw training problems (equal shares per width); fewer than ``curate_rl``'s 1,500 so a run sees
    the pool several times and the online weights, learned on the first visit, matter."""
    digits: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    sft_digits: list[int] = field(default_factory=lambda: [1, 2, 3])
    eval_problems: int = 300
    samples: int = 8
    """Offline arm: answers per problem in the curation pass."""
    min_pass_rate: float = 0.1
    max_pass_rate: float = 0.9
    rl_steps: int = 40
    eval_every: int = 5
    sft_pool: int = 30000
    sft_steps: int = 1500
    """The warm start of ``curate_rl`` (the same cached base when its settings match)."""
    seeds: int = 2
    seed: int = 0
    run: list[str] = field(default_factory=list)
    """Extra run-config overrides for every arm."""


def run(overrides: list[str], out_dir: Path) -> dict:
    from tidal.data.curate import curate
    from tidal.system.run import base_model_path
    from tidal.tasks import TASKS

    curate_rl = load("curate_rl")
    s = apply_overrides(Settings(), overrides)
    work = out_dir / "curriculum"
    # curate_rl's own files (same paths and rows), so its cached warm start is this policy too; the raw
    # pool is the first ``problems`` of its training problems.
    shared = out_dir.parent / "curate_rl" / "curate_rl"
    cr = curate_rl.Settings(digits=s.digits, sft_digits=s.sft_digits, eval_problems=s.eval_problems,
                            sft_pool=s.sft_pool, sft_steps=s.sft_steps, seed=s.seed)
    problems = curate_rl.make_problems(cr.problems + cr.eval_problems, s.seed, s.digits)
    eval_rows, train_rows = problems[: s.eval_problems], problems[s.eval_problems :][: s.problems]
    held_out = curate_rl._write(shared / "eval.jsonl", eval_rows)
    pool = curate_rl._write(shared / "sft_pool.jsonl", curate_rl.make_problems(s.sft_pool, s.seed + 1, s.sft_digits))
    raw = curate_rl._write(work / "raw.jsonl", train_rows)
    cfg = curate_rl.run_config(s, pool, held_out, [])
    base = base_model_path(cfg, TASKS.get(cfg.task.name)(cfg.task), progress=False)

    curated = work / "curated.jsonl"
    start = time.perf_counter()
    report = curate("rl-difficulty", raw, curated, [
        "blocks=[difficulty]", "text_key=question", f"difficulty.model={base}", "difficulty.reward=reasoning_gym",
        f"difficulty.samples={s.samples}", "difficulty.max_new_tokens=8", f"difficulty.min_pass_rate={s.min_pass_rate}",
        f"difficulty.max_pass_rate={s.max_pass_rate}", "workers=1"], progress=False)
    offline_s = time.perf_counter() - start
    kept = len(curated.read_text().splitlines())
    if not kept:
        raise RuntimeError(f"curation kept no problem ({report['blocks'][0]['dropped']}): widen the band")

    arms = {"uniform": (raw, []), "online": (raw, ["curriculum.difficulty.enabled=true"]), "offline": (curated, [])}
    runs = {name: _arm(curate_rl, s, path, held_out, base, extra, work / name) for name, (path, extra) in arms.items()}
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    table = [{"arm": name, "problems": len(train_rows) if name != "offline" else kept,
              "base_accuracy": r["curve"][0][1], "final_accuracy": r["curve"][-1][1],
              "best_accuracy": max(a for _, a in r["curve"]), "zero_adv_frac_mean": r["zero_adv_frac"]}
             for name, r in runs.items()]
    return {
        "benchmark": "curriculum", "description": DESCRIPTION, "table": table,
        **{f"{name}_final_accuracy": r["curve"][-1][1] for name, r in runs.items()},
        "offline_pass": {"problems_scored": len(train_rows), "samples_generated": len(train_rows) * s.samples,
                         "rl_steps_of_samples": len(train_rows) * s.samples / per_step,
                         "seconds_under_contention": offline_s, "kept": kept,
                         "dropped": report["blocks"][0]["dropped"]},
        "curves": {k: v["curve"] for k, v in runs.items()},
        "seed_curves": {k: v["seed_curves"] for k, v in runs.items()},
        "settings": {f.name: getattr(s, f.name) for f in fields(s)},
    }


def _arm(curate_rl, s: Settings, train_path: Path, held_out: Path, base: Path, extra: list[str], out: Path) -> dict:
    """RL from ``base`` once per seed: the seed curves, their mean, and the mean zero-advantage share."""
    from tidal.system.run import train

    seed_curves, zero = [], []
    shutil.rmtree(out, ignore_errors=True)
    for k in range(s.seeds):
        cfg = curate_rl.run_config(s, train_path, held_out, [f"model.path={base}", f"seed={s.seed + k}", *extra])
        result = train(cfg, out / f"seed{s.seed + k}")
        seed_curves.append([(h["step"], h["eval/accuracy"]) for h in result.history if "eval/accuracy" in h])
        zero += [h["algo/zero_adv_groups"] / cfg.rollout.prompts_per_step for h in result.history
                 if "algo/zero_adv_groups" in h]
    steps = [step for step, _ in seed_curves[0]]
    mean = [(step, sum(c[i][1] for c in seed_curves) / len(seed_curves)) for i, step in enumerate(steps)]
    return {"curve": mean, "seed_curves": seed_curves, "zero_adv_frac": sum(zero) / len(zero) if zero else None}


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run([], Path("benchmarks/results/curriculum")), indent=2))
