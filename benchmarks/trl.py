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
import importlib.metadata
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.algo import POLICY_LOSSES
from tidal.config import apply_overrides
from tidal.models import tiny
from tidal.optim import for_run
from tidal.recipes import RECIPES
from tidal.rewards import build_reward
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.rollout import ENGINES
from tidal.rollout.evaluate import greedy_accuracy
from tidal.system.config import RunConfig
from tidal.system.run import base_model_path, prepare
from tidal.tasks import TASKS
from tidal.utils.device import resolve_device, resolve_dtype
from tidal.utils.metrics import MultiTracker

DESCRIPTION = "tidal vs TRL GRPOTrainer: time to TRL's 300-s held-out accuracy, accuracy after equal time"
TRL_VERSION = "1.16.0"
"""Pinned: the version FACTS.md measured. It installs on top of tidal's environment (accelerate and
psutil are all it adds), so the benchmark's venv reuses tidal's torch and transformers."""
_SCRIPT = Path(__file__).with_name("trl_grpo.py")


def _load_script(path: Path = _SCRIPT):
    """A sibling file as a module (benchmarks are not a package). ``trl_grpo.py`` imports nothing heavy
    at module level: its clock and reward are shared with the TRL subprocess."""
    spec = importlib.util.spec_from_file_location(f"tidal_benchmark_{path.stem.lstrip('_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


grpo = _load_script()
_venv = _load_script(Path(__file__).with_name("_venv.py"))


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


# ---- the comparison's summary (pure: tested on synthetic curves) -------------------------------------
Curve = list[tuple[float, float]]  # (training-clock seconds, held-out accuracy), sorted by time


def accuracy_at(curve: Curve, t: float) -> float | None:
    """Accuracy at time t, linear between snapshots; None past the last snapshot."""
    for (t0, a0), (t1, a1) in zip(curve, curve[1:]):
        if t0 <= t <= t1:
            return a0 if t1 == t0 else a0 + (a1 - a0) * (t - t0) / (t1 - t0)
    return curve[-1][1] if curve and t == curve[-1][0] else None


def time_to_reach(curve: Curve, target: float) -> float | None:
    """First time the curve reaches ``target`` (linear within the segment that crosses it); None if never."""
    if curve and curve[0][1] >= target:
        return curve[0][0]
    for (t0, a0), (t1, a1) in zip(curve, curve[1:]):
        if a1 >= target:
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
    return None


def summarize(runs: dict[str, dict], report_at: list[float], max_time_s: float) -> dict:
    """Table rows (one per framework) and the headline numbers.

    ``runs[name]`` holds ``curve`` (Curve) and ``steps`` (list of per-step ``{"step", "elapsed_s"}``),
    plus ``samples_per_step``.
    """
    rows = []
    for name, r in runs.items():
        last = r["steps"][-1] if r["steps"] else {"step": 0, "elapsed_s": 0.0}
        per_s = last["step"] / last["elapsed_s"] if last["elapsed_s"] else 0.0
        row = {"framework": name, "steps": last["step"], "train_s": last["elapsed_s"], "steps_per_s": per_s,
               "samples_per_s": per_s * r["samples_per_step"], "base_accuracy": r["curve"][0][1]}
        row.update({f"acc_at_{t:g}s": accuracy_at(r["curve"], t) for t in report_at})
        row["best_accuracy"] = max((a for t, a in r["curve"] if t <= max_time_s), default=None)
        row["late_swing"] = late_swing(r["curve"])
        rows.append(row)
    out = {"table": rows}
    if "trl" in runs and "tidal" in runs:
        target = accuracy_at(runs["trl"]["curve"], max_time_s)
        tidal_at_end = accuracy_at(runs["tidal"]["curve"], max_time_s)
        reach = None if target is None else time_to_reach(runs["tidal"]["curve"], target)
        for row in rows:
            row[f"s_to_trl_{max_time_s:g}s_acc"] = None if target is None else time_to_reach(runs[row["framework"]]
                                                                                              ["curve"], target)
        speedup = max_time_s / reach if reach else None
        # One snapshot's accuracy is noisy (500 prompts: +-2 points, and runs swing more): also say
        # when tidal reaches the best accuracy TRL showed at any snapshot, a target TRL cannot miss by luck.
        best = max((a for t, a in runs["trl"]["curve"] if t <= max_time_s), default=None)
        trl_to_best = None if best is None else time_to_reach(runs["trl"]["curve"], best)
        tidal_to_best = None if best is None else time_to_reach(runs["tidal"]["curve"], best)
        for row in rows:
            row["s_to_trl_best"] = None if best is None else time_to_reach(runs[row["framework"]]["curve"], best)
        out.update({
            "trl_best_accuracy": best, "trl_time_to_best_s": trl_to_best,
            "tidal_time_to_trl_best_s": tidal_to_best,
            "speedup_to_trl_best": trl_to_best / tidal_to_best if trl_to_best and tidal_to_best else None,
            "target_accuracy": target, "tidal_time_to_target_s": reach, "speedup": speedup,
            "goal_3x_sooner": speedup is not None and speedup >= 3.0,
            "goal_higher_at_end": tidal_at_end is not None and target is not None and tidal_at_end > target,
        })
    return out


def late_swing(curve: Curve, after: float = 0.8) -> float:
    """Largest drop between consecutive snapshots from the first at or above ``after`` on (0 if none)."""
    start = next((i for i, (_, a) in enumerate(curve) if a >= after), None)
    tail = [] if start is None else [a for _, a in curve[start:]]
    return max([0.0, *(a0 - a1 for a0, a1 in zip(tail, tail[1:]))])


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


# ---- the TRL environment and run -----------------------------------------------------------------------
CURRENT = ("", "current")
"""``venv`` values meaning: no venv, TRL is already importable by this interpreter."""


def ensure_venv(path: str | Path, version: str = TRL_VERSION) -> Path:
    """A venv with tidal's packages plus TRL (``benchmarks/_venv.py``; pip adds accelerate, psutil, trl)."""
    return _venv.bench_venv(path, [f"trl=={version}"], "trl")


def trl_python(venv: str) -> tuple[str, str]:
    """The interpreter that runs the TRL side and the TRL version it has: ``sys.executable`` when ``venv`` is
    ``current`` or empty (TRL and datasets must import there already: a clear error names what is missing),
    else the benchmark's own venv at ``venv`` (created with ``TRL_VERSION`` on first use)."""
    if venv.strip() not in CURRENT:
        return str(ensure_venv(venv)), TRL_VERSION
    missing = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(f"venv=current: {', '.join(missing)} cannot be imported by {sys.executable}; install "
                           f"trl=={TRL_VERSION} there (offline: the wheels in scripts/device_wheels.txt), or set venv "
                           "to a directory for the benchmark's own environment (needs pip and a package index)")
    return sys.executable, importlib.metadata.version("trl")


def export_prompts(task, count: int, path: Path) -> None:
    """tidal's training stream (``train_prompt(0..count-1)``, epochs reshuffled as tidal does) as JSONL."""
    with open(path, "w") as f:
        for i in range(count):
            p = task.train_prompt(i)
            f.write(json.dumps({"prompt": p.text, "answer": p.answer}) + "\n")


def trl_settings(cfg: RunConfig, s: Settings, model_dir: Path, work: Path) -> dict:
    """The TRL script's settings, read from the resolved tidal config so both runs use the same values."""
    loss_defaults = inspect.signature(POLICY_LOSSES.get(cfg.algo.policy_loss)).parameters
    eps = {k: getattr(cfg.algo, k) if getattr(cfg.algo, k) is not None else loss_defaults[k].default
           for k in ("eps_low", "eps_high")}
    r, o = cfg.rollout, cfg.optim
    if o.schedule not in ("constant", "cosine"):
        raise ValueError(f"optim.schedule={o.schedule!r}: the TRL run mirrors only constant and cosine (Hugging "
                         f"Face's linear schedule decays to 0, not to optim.min_lr_ratio)")
    # Hugging Face's cosine decays over max_steps: the TRL run ends with its decay (tidal's holds at the
    # floor after it); on 2 cores TRL's 300 s end long before either.
    decay = for_run(o, cfg.max_steps * cfg.trainer.num_minibatches).decay_steps
    max_steps = cfg.max_steps if o.schedule == "constant" else o.warmup_steps + decay
    return {
        "model_dir": str(model_dir.absolute()), "prompts_path": str(work / "prompts.jsonl"),
        "snapshots_path": str(work / "snapshots.pt"), "log_path": str(work / "steps.jsonl"),
        "trl_out_dir": str(work / "trainer"), "threads": s.trl_threads or s.threads, "seed": cfg.seed,
        "prompts_per_step": r.prompts_per_step, "group_size": r.group_size, "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature, "top_p": r.top_p, "lr": o.lr, "betas": list(o.betas), "adam_eps": o.eps,
        "weight_decay": o.weight_decay, "grad_clip": o.grad_clip, **eps, "schedule": o.schedule,
        "warmup_steps": o.warmup_steps, "min_lr_ratio": o.min_lr_ratio,
        "max_time_s": cfg.max_time_s, "max_steps": min(max_steps, cfg.max_steps),
        "snapshot_every_s": s.snapshot_every_s, **device_settings(cfg),
    }


def device_settings(cfg: RunConfig) -> dict:
    """Where TRL trains and in which precision, from tidal's resolved ``system.device`` and ``trainer.precision``:
    ``device`` is ``cpu`` or ``cuda`` (TRL, through accelerate, takes the first visible GPU), ``bf16`` whether
    both sides run bf16 autocast over float32 weights."""
    device = resolve_device(cfg.system.device)
    return {"device": device.type,
            "bf16": resolve_dtype(cfg.trainer.precision, device, "trainer.precision") == torch.bfloat16}


def run_trl(cfg: RunConfig, s: Settings, task, model_dir: Path, work: Path) -> tuple[list[dict], list[dict], dict]:
    python, version = trl_python(s.venv)
    work.mkdir(parents=True, exist_ok=True)
    settings = {**trl_settings(cfg, s, model_dir, work), "trl_version": version, "python": python}
    export_prompts(task, 2 * task.num_train, Path(settings["prompts_path"]))  # TRL cycles it if it runs out
    (work / "config.json").write_text(json.dumps(settings, indent=2))
    env = {**os.environ, "OMP_NUM_THREADS": str(settings["threads"]), "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([python, str(_SCRIPT), "--config", str(work / "config.json")], check=True, env=env)
    snapshots = torch.load(settings["snapshots_path"], weights_only=True, map_location="cpu")  # scored on the CPU
    return snapshots, grpo.read_rows(settings["log_path"]), settings


# ---- the tidal run ---------------------------------------------------------------------------------------
class SnapshotTracker:
    """A metrics sink that snapshots the policy on the shared clock. The controller logs a step after
    taking its time, so the copies are off tidal's clock (``time/elapsed_s``) as they are off TRL's."""

    def __init__(self, model, clock, max_steps: int):
        self.model, self.clock, self.max_steps = model, clock, max_steps
        self.snapshots = [{"elapsed_s": 0.0, "step": 0, "state_dict": grpo.clone_state(model)}]
        self.steps: list[dict] = []

    def log(self, step: int, metrics) -> None:
        if "time/elapsed_s" not in metrics:  # the base model's evaluation, before the clock starts
            return
        elapsed = metrics["time/elapsed_s"]
        self.steps.append({"step": step, "elapsed_s": elapsed})
        if self.clock.tick(elapsed, final=step >= self.max_steps):
            self.snapshots.append({"elapsed_s": elapsed, "step": step, "state_dict": grpo.clone_state(self.model)})

    def close(self) -> None:
        pass


def run_tidal(cfg: RunConfig, s: Settings, out_dir: Path) -> tuple[list[dict], list[dict]]:
    controller = prepare(cfg, out_dir)
    snap = SnapshotTracker(controller.trainer.model, grpo.SnapshotClock(s.snapshot_every_s, cfg.max_time_s),
                           cfg.max_steps)
    controller.tracker = MultiTracker([controller.tracker, snap])
    try:
        result = controller.run()
    finally:
        controller.tracker.close()
        controller.reward_pool.close()
    print(f"tidal: {result.steps} steps, stopped: {result.stopped_because}", flush=True)
    return snap.snapshots, snap.steps


# ---- how busy the machine was with other work ---------------------------------------------------------
def cpu_clock() -> tuple[float, float, float]:
    """(CPU seconds the whole machine was busy, CPU seconds of this process and its reaped children, now).

    Linux only (``/proc/stat``); elsewhere the machine figure is NaN. The TRL subprocess is reaped when
    its run ends, and tidal's reward workers when its pool closes, so both count as ours.
    """
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except OSError:
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()


def others_cores(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """Mean number of cores other processes kept busy between two ``cpu_clock`` readings."""
    return ((end[0] - start[0]) - (end[1] - start[1])) / max(end[2] - start[2], 1e-9)


# ---- scoring and the plot --------------------------------------------------------------------------------
def score_snapshots(cfg: RunConfig, task, model_dir: Path, snapshots: list[dict]) -> Curve:
    """Greedy held-out accuracy of every snapshot, by one evaluator for both frameworks."""
    model, tokenizer = tiny.load(model_dir)
    engine = ENGINES.get(cfg.rollout.engine)(model, tokenizer, cfg.rollout, cfg.seed, 0)
    pool = RewardPool(build_reward(cfg.reward.name, cfg.reward.params),
                      RewardConfig(cfg.reward.name, cfg.reward.params, num_workers=0))
    prompts = task.eval_prompts()[: cfg.num_eval]
    curve = []
    for i, snap in enumerate(snapshots):
        engine.request_weight_update(snap["state_dict"], i + 1)
        curve.append((snap["elapsed_s"], greedy_accuracy(engine, tokenizer, prompts, pool)["eval/accuracy"]))
    return curve


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
        runs[name]["curve"] = score_snapshots(cfg, task, model_dir, snaps[name])
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
