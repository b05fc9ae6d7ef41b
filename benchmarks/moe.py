"""Does routing replay keep RL on a mixture-of-experts model close to what the engine sampled? (issue 52)

The quickstart (warm start, then RL on 2-digit addition) on a tiny Qwen3-MoE (32 experts, top-4, each 128 wide: as
many active MLP weights as the dense tiny model) with a bf16 engine and an fp32 trainer, as real RL runs it (vLLM
serves bf16, trainers keep fp32 masters): the engine's routers see bf16 hidden states and flip some of the
trainer's top-k choices. With 8 experts top-2 about 0.5% of token-layer choices flipped; 32 top-4 flips about
1.4%, 128 top-8 2.7% at 4x the cost (one seed, 10 steps each). Real models flip more (R3 measured ~10% of router
choices on Qwen3-30B-A3B, 48 layers). Arms:

- ``off``: each forward routes itself; ``r2``: the trainer replays its own pre-update routes (GSPO's Routing
  Replay); ``r3``: the trainer replays the engine's routes (Rollout Routing Replay, arXiv 2510.11370);
- ``fp32_engine``: an fp32 engine, routing off: the reference without the precision gap.

Every arm runs synchronously (``rollout.max_staleness=0``), so each step's samples come from the weights the
trainer holds and each step measures the engine/trainer gap (``train/logp_mismatch_mean``, fresh tokens) and
the routing agreement (``moe/routing_agreement``); and with two minibatches per step, so r2 replays something
(with one, every forward of a step runs before its update and r2 is ``off``). Seeds set the model's init, the
warm start and RL's sampling, as ``tidal bench quickstart`` does; a seed's warm start is shared by its arms.

The mismatch is measured as R3 measures it (arXiv 2510.11370, sec. 2): the engine/trainer KL by the k3 estimator
over the sampled tokens (``train/logp_mismatch_kl``), which weighs the few tokens that differ a lot (a flipped
expert) above the many that differ by rounding; the mean absolute log-prob gap, which the rounding dominates, is
reported beside it.

Headline keys: ``routing_agreement_off`` (median over seeds of the off arm's mean agreement; the bench is only
informative when it is measurably below 1), ``mismatch_off_over_r3`` (median over seeds of the off arm's mean KL
over the r3 arm's; goal >= 2), ``abs_mismatch_off_over_r3`` and ``extreme_off_over_r3`` (the same ratio of the
mean absolute gap and of the share of tokens whose probability ratio exceeds 2), ``steps_to_0.85_by_arm`` (per
seed, None: not reached),
``collapsed_runs_by_arm`` (a run collapsed when its final held-out accuracy fell below its base or 0.3 below
its best, or a loss was not finite).

    tidal bench moe [--set seeds=[0,1,2]] [--set steps=60] [--set arms=[off,r3]] [--set <quickstart key>=...]

A run already in ``runs.jsonl`` beside the results (same arm, seed, steps and overrides) is read, not run
again, so a stopped benchmark resumes. About 1 minute per warm start and 1-2 per run on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tidal.bench import load_sibling
from tidal.config import apply_overrides

DESCRIPTION = "quickstart on a tiny MoE, bf16 engine / fp32 trainer: routing replay off, r2, r3 vs an fp32 engine"
TARGET = 0.85
ARMS = {
    "off": ["rollout.dtype=bf16", "trainer.moe.routing_replay=off"],
    "r2": ["rollout.dtype=bf16", "trainer.moe.routing_replay=r2"],
    "r3": ["rollout.dtype=bf16", "trainer.moe.routing_replay=r3"],
    "fp32_engine": ["rollout.dtype=fp32", "trainer.moe.routing_replay=off"],
}
MOE = ["model.num_experts=32", "model.experts_per_token=4", "model.expert_intermediate_size=128",
       "rollout.max_staleness=0", "trainer.num_minibatches=2"]


@dataclass
class Settings:
    """This benchmark's own knobs; every other ``--set`` key goes to the quickstart run config."""

    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    steps: int = 60
    """RL steps per run (evaluated every 10)."""
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    reuse: bool = True
    """Read runs already in ``runs.jsonl`` instead of running them again."""


def _mean(history: list[dict], key: str) -> float | None:
    values = [h[key] for h in history if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]
    return statistics.fmean(values) if values else None


def collapsed(curve: list[tuple[int, float]], losses: list[float]) -> bool:
    """Final accuracy below the base or 0.3 below the run's best, or a loss that was not finite."""
    accs = [a for _, a in curve]
    return (not all(math.isfinite(x) for x in losses)) or accs[-1] < accs[0] or accs[-1] < max(accs) - 0.3


def summarize_run(history: list[dict]) -> dict:
    """One run's row from its metrics history (pure: tested on a synthetic history)."""
    curve = [(h["step"], h["eval/accuracy"]) for h in history if "eval/accuracy" in h]
    losses = [h["train/loss"] for h in history if "train/loss" in h]
    reached = next((s for s, a in curve if a >= TARGET), None)
    return {"base": curve[0][1], "final": curve[-1][1], "best": max(a for _, a in curve),
            f"steps_to_{TARGET}": reached, "collapsed": collapsed(curve, losses),
            "agreement": _mean(history, "moe/routing_agreement"),
            "mismatch": _mean(history, "train/logp_mismatch_kl"),
            "abs_mismatch": _mean(history, "train/logp_mismatch_mean"),
            "extreme": _mean(history, "train/extreme_token_frac"),
            "mismatch_max": _mean(history, "train/logp_mismatch_max"),
            "load_max": _mean(history, "moe/expert_load_max"),
            "rl_s": next((h["time/elapsed_s"] for h in reversed(history) if "time/elapsed_s" in h), None),
            "curve": [[s, a] for s, a in curve]}


def headline(rows: list[dict], arms: list[str], seeds: list[int]) -> dict:
    by = {(r["arm"], r["seed"]): r for r in rows}
    out: dict = {}
    off = [by[("off", s)]["agreement"] for s in seeds if ("off", s) in by and by[("off", s)]["agreement"] is not None]
    out["routing_agreement_off"] = statistics.median(off) if off else None
    for key in ("mismatch", "abs_mismatch", "extreme"):
        ratios = [by[("off", s)][key] / by[("r3", s)][key] for s in seeds
                  if ("off", s) in by and ("r3", s) in by and by[("off", s)][key] and by[("r3", s)][key]]
        out[f"{key}_off_over_r3"] = statistics.median(ratios) if ratios else None
        out[f"{key}_off_over_r3_by_seed"] = ratios
    out[f"steps_to_{TARGET}_by_arm"] = {a: [by[(a, s)][f"steps_to_{TARGET}"] for s in seeds if (a, s) in by]
                                        for a in arms}
    out["collapsed_runs_by_arm"] = {a: sum(by[(a, s)]["collapsed"] for s in seeds if (a, s) in by) for a in arms}
    for key in ("mismatch", "abs_mismatch", "extreme", "agreement", "final"):
        out[f"{key}_by_arm"] = {a: [by[(a, s)][key] for s in seeds if (a, s) in by] for a in arms}
    return out


def _settings(overrides: list[str]) -> tuple[Settings, list[str]]:
    own = {f.name for f in dataclasses.fields(Settings)}
    mine = [o for o in overrides if o.partition("=")[0].strip() in own]
    s = apply_overrides(Settings(), mine)
    unknown = [a for a in s.arms if a not in ARMS]
    if unknown:
        raise ValueError(f"arms: unknown {unknown}; known: {', '.join(ARMS)}")
    return s, [o for o in overrides if o not in mine]


def run(overrides: list[str], out_dir: Path) -> dict:
    from tidal.system.run import train

    qs = load_sibling(Path(__file__).with_name("quickstart.py"))
    s, rest = _settings(overrides)
    log = out_dir / "runs.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    done = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    rows = []
    for seed in s.seeds:
        for arm in s.arms:
            key = {"arm": arm, "seed": seed, "steps": s.steps, "overrides": rest}
            found = next((r for r in reversed(done) if all(r.get(k) == v for k, v in key.items())), None)
            if s.reuse and found is not None:
                print(f"reused {json.dumps(key)}", flush=True)
                rows.append(found)
                continue
            _, cfg = qs.resolve([f"steps={s.steps}", *MOE, *ARMS[arm], *rest], seed)
            result = train(cfg, out_dir / f"{arm}_seed{seed}")
            row = {**key, **summarize_run(result.history)}
            print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
            with open(log, "a") as f:  # kept run by run: a stopped benchmark keeps what it measured
                f.write(json.dumps(row) + "\n")
            rows.append(row)
    table = [{k: v for k, v in r.items() if k not in ("curve", "overrides")} for r in rows]
    return {"benchmark": "moe", "description": DESCRIPTION, "table": table, **headline(rows, s.arms, s.seeds),
            "seeds": s.seeds, "steps": s.steps, "arms": s.arms, "overrides": overrides,
            "curves": {f"{r['arm']}/{r['seed']}": r["curve"] for r in rows}}
