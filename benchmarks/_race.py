"""The race both TRL comparisons run (``tidal bench trl`` on the tiny model, ``tidal bench real`` on a pretrained
chat model): tidal and TRL's GRPOTrainer trained on one clock, snapshotted on it, scored afterwards by one
evaluator, and the summary of the curves.

- **The clock** (``trl_grpo.SnapshotClock``, shared with the TRL subprocess): training time from the first
  step to the first step ending at or after ``max_time_s``; setup, snapshot copies and evaluation are off it.
- **The TRL side** (``run_trl``): ``trl_grpo.py`` in the benchmark's own venv (``_venv.py``, TRL pinned at
  ``TRL_VERSION``), with every setting read from tidal's resolved run config (``trl_settings``), tidal's
  training stream exported in order (``export_prompts``: text, or a conversation TRL renders with the same
  chat template when tidal's prompts are chat-rendered), tidal's own reward by name, and tidal's ids of the
  first prompt, which the TRL script checks against its own tokenization.
- **The tidal side** (``run_tidal``): ``prepare`` + ``Controller.run`` with a ``SnapshotTracker`` sink.
  A LoRA policy is snapshotted as its adapters (what its engine is sent), any other as its weights.
- **Scoring** (``score_snapshots``): tidal's greedy accuracy on the same held-out prompts, one engine
  loading each snapshot in turn, prompts rendered as the run renders them.

A benchmark's settings object passes ``venv``, ``threads``, ``trl_threads`` and ``snapshot_every_s``
(``trl.Settings``, ``real.Settings``). Snapshots stay in memory, or with ``snapshot_dir`` go to one file
each (a 135M-parameter model's 0.5 GB per snapshot).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from tidal.algo import POLICY_LOSSES
from tidal.models import lora, prompts, tiny
from tidal.optim import for_run
from tidal.rewards import build_reward
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.rollout import ENGINES
from tidal.rollout.evaluate import accuracy_metrics, greedy_samples
from tidal.system.config import RunConfig
from tidal.system.run import prepare
from tidal.types import Trajectory
from tidal.utils.device import resolve_device, resolve_dtype
from tidal.utils.metrics import MultiTracker

TRL_VERSION = "1.16.0"
"""Pinned: the version FACTS.md measured. It installs on top of tidal's environment (accelerate and
psutil are all it adds), so the benchmark's venv reuses tidal's torch and transformers."""
_SCRIPT = Path(__file__).with_name("trl_grpo.py")


def load_sibling(path: Path):
    """A file next to this one as a module (benchmarks are not a package), loaded once. ``trl_grpo.py`` imports
    nothing heavy at module level: its clock is shared with the TRL subprocess."""
    name = f"tidal_benchmark_{path.stem.lstrip('_')}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


grpo = load_sibling(_SCRIPT)
_venv = load_sibling(Path(__file__).with_name("_venv.py"))


# ---- the summary (pure: tested on synthetic curves) ---------------------------------------------------
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


def export_prompts(task, count: int, path: Path, chat: prompts.PromptFormat | None = None) -> None:
    """tidal's training stream (``train_prompt(0..count-1)``, epochs reshuffled as tidal does) as JSONL rows
    ``{"prompt", "answer", "question"}``. ``chat``: the run renders prompts with the chat template, so
    ``prompt`` is the conversation (``prompts.messages``: the system message if the run sets one, then the
    user's text) and TRL renders it with the same template; else the text itself. ``question`` is the text,
    for the reward."""
    with open(path, "w") as f:
        for i in range(count):
            p = task.train_prompt(i)
            prompt = p.text if chat is None else prompts.messages(p.text, chat)
            f.write(json.dumps({"prompt": prompt, "answer": p.answer, "question": p.text}) + "\n")


def trl_settings(cfg: RunConfig, s, model_dir: Path, work: Path, snapshot_dir: Path | None = None) -> dict:
    """The TRL script's settings, read from the resolved tidal config so both runs use the same values."""
    loss_defaults = inspect.signature(POLICY_LOSSES.get(cfg.algo.policy_loss)).parameters
    eps = {k: getattr(cfg.algo, k) if getattr(cfg.algo, k) is not None else loss_defaults[k].default
           for k in ("eps_low", "eps_high")}
    r, o = cfg.rollout, cfg.optim
    if r.temperature != cfg.trainer.temperature:
        raise ValueError(f"rollout.temperature={r.temperature} but trainer.temperature={cfg.trainer.temperature}: TRL "
                         f"samples and scores log-probs at one temperature, so the TRL run cannot mirror this")
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
        "snapshot_every_s": s.snapshot_every_s, "snapshot_dir": None if snapshot_dir is None else str(snapshot_dir),
        "reward": {"name": cfg.reward.name, "params": cfg.reward.params}, **device_settings(cfg),
    }


def device_settings(cfg: RunConfig) -> dict:
    """Where TRL trains and in which precision, from tidal's resolved ``system.device`` and ``trainer.precision``:
    ``device`` is ``cpu`` or ``cuda`` (TRL, through accelerate, takes the first visible GPU), ``bf16`` whether
    both sides run bf16 autocast over float32 weights."""
    device = resolve_device(cfg.system.device)
    return {"device": device.type,
            "bf16": resolve_dtype(cfg.trainer.precision, device, "trainer.precision") == torch.bfloat16}


def run_tokenizer(cfg: RunConfig, model_dir: Path):
    """The tokenizer of ``model_dir`` rendering prompts as the run does (``model.prompt_format``)."""
    return prompts.attach(tiny.load_tokenizer(model_dir), cfg.model.prompts())


def run_trl(cfg: RunConfig, s, task, model_dir: Path, work: Path,
            snapshot_dir: Path | None = None) -> tuple[list[dict], list[dict], dict]:
    """TRL's run: (snapshot records, per-step log, the settings it ran with)."""
    python, version = trl_python(s.venv)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = run_tokenizer(cfg, model_dir)
    settings = {**trl_settings(cfg, s, model_dir, work, snapshot_dir), "trl_version": version, "python": python,
                "first_prompt_ids": prompts.prompt_ids(tokenizer, task.train_prompt(0).text),
                "chat": prompts.uses_chat(tokenizer)}
    chat = prompts.format_of(tokenizer) if settings["chat"] else None
    export_prompts(task, 2 * task.num_train, Path(settings["prompts_path"]), chat)  # TRL cycles it if it runs out
    (work / "config.json").write_text(json.dumps(settings, indent=2))
    env = {**os.environ, "OMP_NUM_THREADS": str(settings["threads"]), "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([python, str(_SCRIPT), "--config", str(work / "config.json")], check=True, env=env)
    # the records (weights, or with snapshot_dir their files), scored on the CPU
    snapshots = torch.load(settings["snapshots_path"], weights_only=True, map_location="cpu")
    return snapshots, grpo.read_rows(settings["log_path"]), settings


# ---- the tidal run ---------------------------------------------------------------------------------------
def policy_weights(model) -> dict:
    """A copy of what defines the policy: a LoRA policy's adapters (``lora.adapter_update``, what its engine is
    sent; the base is the run's), any other model's weights (a tied head once)."""
    return lora.adapter_update(model) if lora.is_peft(model) else grpo.clone_state(model)


class SnapshotTracker:
    """A metrics sink that snapshots the policy on the shared clock. The controller logs a step after
    taking its time, so the copies are off tidal's clock (``time/elapsed_s``) as they are off TRL's."""

    def __init__(self, model, clock, max_steps: int, snapshot_dir: Path | None = None):
        self.model, self.clock, self.max_steps, self.snapshot_dir = model, clock, max_steps, snapshot_dir
        self.snapshots = [grpo.snapshot(policy_weights(model), 0.0, 0, snapshot_dir)]
        self.steps: list[dict] = []

    def log(self, step: int, metrics) -> None:
        if "time/elapsed_s" not in metrics:  # the base model's evaluation, before the clock starts
            return
        elapsed = metrics["time/elapsed_s"]
        self.steps.append({"step": step, "elapsed_s": elapsed})
        if self.clock.tick(elapsed, final=step >= self.max_steps):
            self.snapshots.append(grpo.snapshot(policy_weights(self.model), elapsed, step, self.snapshot_dir))

    def close(self) -> None:
        pass


def run_tidal(cfg: RunConfig, s, out_dir: Path, snapshot_dir: Path | None = None) -> tuple[list[dict], list[dict]]:
    """tidal's run: (snapshot records, per-step ``{"step", "elapsed_s"}``)."""
    controller = prepare(cfg, out_dir)
    snap = SnapshotTracker(controller.trainer.model, grpo.SnapshotClock(s.snapshot_every_s, cfg.max_time_s),
                           cfg.max_steps, snapshot_dir)
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


# ---- scoring -----------------------------------------------------------------------------------------------
def score_snapshots(cfg: RunConfig, task, model_dir: Path, snapshots: list[dict],
                    num_eval: int | None = None) -> tuple[Curve, list[Trajectory]]:
    """Greedy held-out accuracy of every snapshot, by one evaluator for every run: (the curve, the last
    snapshot's scored greedy samples, one per prompt). ``num_eval``: the first that many held-out prompts
    (None: ``cfg.num_eval``). Snapshots of a LoRA run (``cfg.model.lora``) are adapters, merged into the base."""
    model, tokenizer = tiny.load(model_dir)
    prompts.attach(tokenizer, cfg.model.prompts())
    if cfg.model.lora.enabled:  # the engine keeps the base and merges each snapshot's adapters into it
        model = lora.wrap(model, cfg.model.lora)
    engine = ENGINES.get(cfg.rollout.engine)(model, tokenizer, cfg.rollout, cfg.seed, 0)
    pool = RewardPool(build_reward(cfg.reward.name, cfg.reward.params),
                      RewardConfig(cfg.reward.name, cfg.reward.params, num_workers=0))
    eval_prompts = task.eval_prompts()[: num_eval if num_eval is not None else cfg.num_eval]
    curve, trajs = [], []
    for i, snap in enumerate(snapshots):
        engine.request_weight_update(grpo.snapshot_weights(snap), i + 1)
        trajs = greedy_samples(engine, tokenizer, eval_prompts, pool)
        curve.append((snap["elapsed_s"], accuracy_metrics(trajs, len(eval_prompts))["eval/accuracy"]))
    return curve, trajs
