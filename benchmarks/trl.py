"""tidal vs TRL's GRPOTrainer: time to a held-out accuracy and accuracy after equal training time.

Both frameworks start from the same warm-started tiny model (tidal's quickstart base, built locally
and cached), train on the same 2-digit addition prompts in the same order, with the same reward
(exact match), prompts per step, samples per prompt, learning rate, AdamW settings, clip range,
response budget, temperature and thread count, one after the other: TRL first, in a subprocess in the
benchmark's own virtual environment (``.tidal_cache/bench-trl-venv``: TRL is pinned there and is no
dependency of tidal; CPU, no vLLM), then tidal's quickstart recipe with plain GRPO in this process
(``quickstart_grpo``: async, eta = 1; the objective TRL has, without the quickstart's pass@k and guidance).

How time and accuracy are measured, identically for both (see ``trl_grpo.py``):

- A training clock runs from the first step to the first step ending at or after ``max_time_s``.
  Setup (imports, model loading, trainer construction, the TRL install) is off the clock.
- Every ``snapshot_every_s`` of clock the policy weights are copied to memory (the copy is off the
  clock). No evaluation runs during training: afterwards every snapshot of both runs is scored by the
  same code (tidal's greedy accuracy on the same held-out prompts). So neither framework pays for
  evaluation, and tidal's generator cannot get ahead while an evaluation would pause its trainer.

Reported: base accuracy, accuracy at ``report_at`` seconds (linear between snapshots), steps/s and
samples/s, how many cores other processes kept busy meanwhile (the machine may be shared: a run
whose ``others_cpu_cores`` is well above 0 was slowed by someone else), and the headline: how much
sooner tidal reaches the accuracy TRL has at ``max_time_s`` (``max_time_s`` / tidal's time to that
accuracy; the issue's goal is >= 3x) and whether tidal's accuracy at ``max_time_s`` is higher.
Writes ``benchmarks/results/trl.png`` (accuracy vs training time).

    tidal bench trl [--set max_time_s=300] [--set snapshot_every_s=10] [--set rollout.prompts_per_step=16]

``--set`` takes this benchmark's own knobs (``Settings``) and any quickstart run-config key; the TRL
run reads its values from the same resolved config. Runs about 12 minutes (2 x 300 s of training plus
setup and scoring); the first run also installs TRL (about a minute).

On a GPU (``system.device``, a quickstart key: ``auto`` takes CUDA when present) both sides train there:
tidal's trainer and engine as the run config places them, TRL with ``use_cpu=False`` and ``bf16`` exactly
when tidal's ``trainer.precision`` resolves to bf16 (bf16 autocast over float32 weights on both sides), no
vLLM, no gradient checkpointing. The snapshots are scored on the CPU by the same evaluator as before. A
machine without network cannot build the benchmark's venv: ``--set venv=current`` runs TRL with this
interpreter, which must import ``trl`` and ``datasets`` already (``scripts/device_wheels.txt`` lists the
wheels to carry). On one H100, about 3 minutes (two 60-s runs, the warm start, TRL's import, scoring):

    tidal bench trl --set venv=current --set system.device=cuda --set max_time_s=60 --set 'seeds=[0]' \
        --set 'report_at=[30,60]'
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.bench import load_sibling
from tidal.config import apply_overrides
from tidal.recipes import RECIPES
from tidal.system.config import RunConfig
from tidal.system.run import base_model_path
from tidal.tasks import TASKS
from tidal.utils.device import resolve_device

DESCRIPTION = "tidal vs TRL GRPOTrainer: time to TRL's 300-s held-out accuracy, accuracy after equal time"


def _load_sibling(name: str):
    """A file next to this one as a module (benchmarks are not a package), loaded once."""
    return load_sibling(Path(__file__).with_name(name))


race = _load_sibling("_race.py")  # the clock, both runs, scoring and the summary, shared with ``tidal bench real``
grpo = race.grpo
TRL_VERSION = race.TRL_VERSION
Curve = race.Curve
accuracy_at, time_to_reach, late_swing = race.accuracy_at, race.time_to_reach, race.late_swing
summarize = race.summarize
cpu_clock, others_cores = race.cpu_clock, race.others_cores
SnapshotTracker, run_tidal, run_trl = race.SnapshotTracker, race.run_tidal, race.run_trl
score_snapshots, export_prompts, trl_settings = race.score_snapshots, race.export_prompts, race.trl_settings
device_settings, trl_python = race.device_settings, race.trl_python


@dataclass
class Settings:
    """This benchmark's own knobs; every other ``--set`` key goes to the quickstart run config."""

    frameworks: list[str] = field(default_factory=lambda: ["trl", "tidal"])
    snapshot_every_s: float = 10.0
    """Training-clock seconds between weight snapshots: the resolution of the accuracy-vs-time curves."""
    report_at: list[float] = field(default_factory=lambda: [60.0, 120.0, 300.0])
    threads: int = 2
    """Cores for both: torch threads of TRL's process, and tidal's ``system.num_threads`` (its async mode
    runs generation and training concurrently with 1 thread each, and lends the generator's to training)."""
    trl_threads: int | None = None
    """torch threads for TRL if not ``threads``. On a shared machine 1 is TRL's better choice: with 2,
    any other busy process stalls every multi-threaded op (measured here: 7 s per step with 2 threads
    vs 1.3 s with 1 while another job held a core; FACTS.md saw the same 21x on a training step)."""
    venv: str = ".tidal_cache/bench-trl-venv"
    """The benchmark's own environment for TRL, created on first use and reused. ``current`` (or empty): no
    venv, TRL runs with this interpreter (``sys.executable``), which must import ``trl`` and ``datasets``
    (a machine without network, where pip cannot build the venv)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """One base model per seed (``seed``, ``model.init_seed``, ``sft.seed``): each is warm-started into
    ``sft.accuracy_band`` from its own init and data order, the way another CPU's rounding moves a base
    (issue 15), and both frameworks train from it. Results are reported per base and as medians."""


RUN = [  # quickstart_grpo as is, except what makes the comparison exact
    "max_time_s=300", "target_accuracy=null", "max_steps=100000000", "eval_every=100000000",
    "checkpoint_every=100000000", "log.progress=false", "log.tensorboard=false", "log.report=false",
    # the clock ends the run, not max_steps: the recipe's cosine keeps its 400 steps (decaying over max_steps,
    # optim.decay_steps' default, it would be flat)
    "optim.decay_steps=400",
]


def resolve(overrides: list[str], seed: int | None = None) -> tuple[Settings, RunConfig]:
    """This benchmark's settings and the run config of the base ``seed`` (None: the recipe's own seeds)."""
    own = {f.name for f in dataclasses.fields(Settings)}
    mine = [o for o in overrides if o.partition("=")[0].strip() in own]
    s = apply_overrides(Settings(), mine)
    seeded = [] if seed is None else [f"seed={seed}", f"model.init_seed={seed}", f"sft.seed={seed}"]
    cfg = apply_overrides(RECIPES.get("quickstart_grpo")(), [*RUN, f"system.num_threads={s.threads}", *seeded,
                                                       *(o for o in overrides if o not in mine)])
    return s, cfg


def across_bases(per_base: list[dict], report_at: list[float]) -> dict:
    """Medians and ranges over bases of each framework's figures, and how many bases met each goal."""
    def med(values, missing=float("inf")):
        """Median where a base that never got there counts as worst: an infinite time, a zero speedup."""
        vals = sorted(missing if v is None else v for v in values)
        m = statistics.median(vals) if vals else None
        return None if m is None or m == float("inf") else m

    out: dict = {"num_bases": len(per_base)}
    keys = [*(f"acc_at_{t:g}s" for t in report_at), "best_accuracy", "late_swing", "s_to_trl_best",
            "samples_per_s", "base_accuracy"]
    for fw in ("trl", "tidal"):
        rows = [r for b in per_base for r in b["table"] if r["framework"] == fw]
        for k in keys:
            if rows:
                out[f"{fw}_median_{k}"] = med([r.get(k) for r in rows])
    if all("speedup_to_trl_best" in b for b in per_base):
        out["median_speedup_to_trl_best"] = med([b["speedup_to_trl_best"] for b in per_base], missing=0.0)
        out["bases_3x_sooner_to_trl_best"] = sum((b["speedup_to_trl_best"] or 0) >= 3.0 for b in per_base)
        out["bases_higher_at_end"] = sum(bool(b["goal_higher_at_end"]) for b in per_base)
    return out


# ---- the plot and the runs ------------------------------------------------------------------------------
def plot(per_base: list[dict], max_time_s: float, path: Path) -> None:
    """Accuracy vs training time, one panel per base."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(per_base), figsize=(5 * len(per_base), 4), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], per_base):
        for name, r in b["runs"].items():
            ax.plot(*zip(*r["curve"]), marker=".", label=f"{name} ({r['label']})")
        if b.get("trl_best_accuracy") is not None:
            ax.axhline(b["trl_best_accuracy"], color="gray", linestyle="--", linewidth=0.8, label="TRL's best")
        ax.set_title(f"base seed {b['seed']} ({b['table'][0]['base_accuracy']:.2f})")
        ax.set_xlabel("training time (s; evaluation excluded)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out greedy accuracy")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("2-digit addition, same base model and settings for both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_base(s: Settings, cfg: RunConfig, out_dir: Path) -> dict:
    """Both frameworks from one base: their runs (curves, steps) and the summary."""
    task = TASKS.get(cfg.task.name)(cfg.task)
    model_dir = base_model_path(cfg, task, progress=False)  # the warm start, off both clocks (cached)
    samples_per_step = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    snaps, runs, trl_cfg = {}, {}, None
    for name in s.frameworks:
        start, cpu_start = time.perf_counter(), cpu_clock()
        if name == "trl":
            snaps[name], steps, trl_cfg = run_trl(cfg, s, task, model_dir, out_dir / "trl")
            label = f"TRL {trl_cfg['trl_version']} GRPOTrainer, {trl_cfg['device']}, {trl_cfg['threads']} thread(s)"
        else:
            torch.set_num_threads(s.threads)
            snaps[name], steps = run_tidal(cfg, s, out_dir / "tidal")
            label = (f"quickstart, {cfg.system.mode}, eta={cfg.rollout.max_staleness}, "
                     f"{resolve_device(cfg.system.device).type}, {s.threads} threads")
        runs[name] = {"steps": steps, "samples_per_step": samples_per_step, "label": label,
                      "wall_s": time.perf_counter() - start, "others_cores": others_cores(cpu_start, cpu_clock())}
    torch.set_num_threads(s.threads)
    for name in runs:
        runs[name]["curve"] = score_snapshots(cfg, task, model_dir, snaps[name])[0]
        runs[name]["snapshot_steps"] = [snap["step"] for snap in snaps[name]]
    summary = summarize(runs, s.report_at, cfg.max_time_s)
    for row in summary["table"]:  # > 0: other jobs shared the cores during this framework's run
        row["others_cpu_cores"] = runs[row["framework"]]["others_cores"]
        row["base_seed"] = cfg.seed
    return {"seed": cfg.seed, "runs": runs, "trl_script": trl_cfg, "num_eval": len(task.eval_prompts()[: cfg.num_eval]),
            **summary}


def run(overrides: list[str], out_dir: Path) -> dict:
    s, cfg = resolve(overrides)
    assert set(s.frameworks) <= {"trl", "tidal"}, f"frameworks must be among trl, tidal: {s.frameworks}"
    assert cfg.max_time_s is not None, "max_time_s sets the comparison's time budget; it cannot be null"
    out_dir.mkdir(parents=True, exist_ok=True)
    per_base = []
    for seed in s.seeds:
        b = run_base(s, resolve(overrides, seed)[1], out_dir / f"seed{seed}")
        per_base.append(b)
        print(format_rows(b["table"]), flush=True)
    png = out_dir.parent / "trl.png"  # next to trl.json (the run directories are not kept)
    plot(per_base, cfg.max_time_s, png)
    headline_keys = ("trl_best_accuracy", "trl_time_to_best_s", "tidal_time_to_trl_best_s", "speedup_to_trl_best",
                     "target_accuracy", "tidal_time_to_target_s", "speedup", "goal_3x_sooner", "goal_higher_at_end")
    return {
        "benchmark": "trl", "description": DESCRIPTION, "table": [r for b in per_base for r in b["table"]],
        **across_bases(per_base, s.report_at), "plot": str(png),
        "trl_version": (per_base[0]["trl_script"] or {}).get("trl_version", TRL_VERSION),
        "device": resolve_device(cfg.system.device).type,
        "bases": [{"seed": b["seed"], **{k: b.get(k) for k in headline_keys}} for b in per_base],
        "settings": {"benchmark": dataclasses.asdict(s), "trl_script": per_base[0]["trl_script"],
                     "tidal_overrides": [*RUN, *overrides], "task": cfg.task.name, "num_eval": per_base[0]["num_eval"],
                     "mode": cfg.system.mode, "max_staleness": cfg.rollout.max_staleness},
        "curves": {f"seed{b['seed']}/{name}": {"elapsed_s": [t for t, _ in r["curve"]],
                                               "accuracy": [a for _, a in r["curve"]], "step": r["snapshot_steps"],
                                               "wall_s_with_setup": r["wall_s"]}
                   for b in per_base for name, r in b["runs"].items()},
        "cpus": os.cpu_count(),
    }


def format_rows(rows: list[dict]) -> str:
    from tidal.bench import format_table

    return format_table(rows)
