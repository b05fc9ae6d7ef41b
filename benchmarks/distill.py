"""Distillation vs RL alone: which student gets closest to the teacher, per student step and per second?

One task (the quickstart's 2-digit addition), one student start (the quickstart's warm-started 1M base),
one teacher (``distill.teacher``, default the cached 2.4M quickstart teacher) and one student budget
(``budget_s`` seconds of student training, at most ``rl_steps`` RL steps or ``student_steps``
supervised steps). Methods:

- ``rl``: the quickstart's async RL from the base (the student alone).
- ``traces``: SFT on the teacher's verified traces (rejection sampling, ``keep=all``).
- ``logits_k{K}`` for K in ``ks``, and ``logits_full``: forward KL to the stored k-sparse teacher, and
  to the full distribution computed on the fly, all on the same teacher responses and from the same
  start; their ``eval_kl`` (full KL to the teacher on its responses to held-out prompts) is the loss
  they are compared by.
- ``on_policy``: the ``on_policy_distill`` recipe (the teacher scores every sampled token).
- ``traces_rl``: Magistral Small's recipe: ``traces_rl_sft_steps`` SFT steps on traces, then RL for the rest
  of the budget.

Reported per method: held-out greedy accuracy at each evaluation against student steps and seconds, the
accuracy reached within the budget, the teacher-data seconds (generation and storage, paid once and
reported apart) and, for logits, bytes per position and the information lost. Top-level keys:
``gap_closed`` = (best distilled accuracy - RL alone's) / (teacher's - RL alone's), each the accuracy
when the same budget ran out; ``k32_rel_loss_gap`` = eval_kl(k = 32) / eval_kl(full) - 1, averaged over
the last 4 evaluation steps both students reached (the full-KL student runs its teacher on the fly and
takes fewer steps per second: comparing at equal seconds would mix that cost into the loss). Seconds are
wall time measured on a shared 2-core machine: noisy; steps are the reproducible axis.

    tidal bench distill [--set budget_s=60] [--set methods=[rl,traces]] [--set ks=[1,8,32]] [--set seed=1]
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from tidal.config import apply_overrides
from tidal.distill.common import evaluator, load_task, reward_pool
from tidal.distill.logits import LogitsConfig, teacher_samples, write_store
from tidal.distill.pipeline import eval_kl, held_out_samples
from tidal.distill.shards import LogitShards
from tidal.distill.student import StudentConfig, full_kl_loss_with, sft_loss, sparse_kl_loss, train_student
from tidal.distill.traces import TracesConfig, generate_traces, read_traces
from tidal.models import tiny
from tidal.recipes import RECIPES
from tidal.system.run import base_model_path, teacher_path, train
from tidal.train.checkpoint import latest_checkpoint

DESCRIPTION = "distillation vs RL alone on the quickstart: traces, k-sparse logits vs full KL, on-policy, traces+RL"
METHODS = ["rl", "traces", "logits", "on_policy", "traces_rl"]


@dataclass
class Settings:
    """This benchmark's knobs; other ``--set`` keys go to every run config (the quickstart's)."""

    seed: int = 0
    budget_s: float = 60.0
    """Student training seconds per method (RL: RL seconds; offline: optimizer-step seconds)."""
    rl_steps: int = 150
    """Most RL steps (RL alone, on-policy, the RL part of traces + RL)."""
    student_steps: int = 600
    """Most supervised steps of an offline student (SFT on traces, logit KL)."""
    eval_every_rl: int = 10
    eval_every_student: int = 25
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    ks: list[int] = field(default_factory=lambda: [1, 8, 32])
    num_prompts: int = 2000
    """Training prompts the teacher answers (traces and logits)."""
    samples_per_prompt: int = 4
    min_reward: float = 1.0
    """A trace is kept when its reward is at least this (``traces.min_reward``)."""
    traces_rl_sft_steps: int = 100
    teacher: str | None = None
    """A teacher model directory; None: the quickstart teacher (built once and cached)."""


def resolve(overrides: list[str]) -> tuple[Settings, object]:
    own = {f.name for f in dataclasses.fields(Settings)}
    mine = [o for o in overrides if o.partition("=")[0].strip() in own]
    s = apply_overrides(Settings(), mine)
    unknown = set(s.methods) - set(METHODS)
    if unknown:
        raise ValueError(f"methods: unknown {sorted(unknown)}; choose from {METHODS}")
    cfg = apply_overrides(RECIPES.get("quickstart")(), [
        f"seed={s.seed}", f"max_steps={s.rl_steps}", f"max_time_s={s.budget_s}", "target_accuracy=null",
        f"eval_every={s.eval_every_rl}", "checkpoint_every=100000", "log.progress=false", "log.tensorboard=false",
        "log.report=false", *(o for o in overrides if o not in mine)])
    return s, cfg


def within(curve: list[dict], budget_s: float) -> float:
    """Accuracy at the last evaluation within ``budget_s`` seconds (the start's if none)."""
    inside = [c for c in curve if c["seconds"] <= budget_s + 1e-9] or curve[:1]
    return inside[-1]["accuracy"]


def matched_rel_gap(sparse: list[dict], full: list[dict], key: str = "eval_kl",
                    last: int = 4) -> tuple[float, int] | None:
    """Mean ``key`` of the sparse curve over the full one's, minus 1, over the ``last`` evaluation steps
    both reached (the full-KL student takes fewer steps in the same time: its teacher runs on the fly),
    and the last of those steps. A mean over several evaluations, because one evaluation of a student
    trained ~20 epochs on 2,000 sequences moves by 10-20% between neighbouring evaluations."""
    common = sorted({c["step"] for c in sparse if key in c} & {c["step"] for c in full if key in c} - {0})
    if not common:
        return None
    steps = common[-last:]
    mean = lambda curve: sum(c[key] for c in curve if c["step"] in steps) / len(steps)  # noqa: E731
    return mean(sparse) / mean(full) - 1.0, steps[-1]


def gap_closed(best: float, alone: float, teacher: float) -> float:
    """Fraction of the student-alone-to-teacher accuracy gap the best distilled student closed."""
    return (best - alone) / (teacher - alone) if teacher != alone else float("nan")


def _rl(cfg, out: Path, evaluate) -> dict:
    """An RL run's evaluations; a run the budget stopped between evaluations is evaluated once more at its
    last step (its final checkpoint), so every method's curve ends where its training ended."""
    start = time.perf_counter()
    result = train(cfg, out)
    curve = [{"step": h["step"], "seconds": h.get("time/elapsed_s", 0.0), "accuracy": h["eval/accuracy"]}
             for h in result.history if "eval/accuracy" in h]
    if curve[-1]["step"] != result.steps:
        last = latest_checkpoint(out / "checkpoints")
        curve.append({"step": result.steps, "seconds": result.history[-1].get("time/elapsed_s", 0.0),
                      "accuracy": evaluate(tiny.load(last)[0].eval())})
    teacher_s = result.history[-1].get("distill/teacher_s")
    return {"curve": curve, "steps": result.steps, "wall_s": time.perf_counter() - start,
            **({"teacher_s": teacher_s} if teacher_s is not None else {})}


def run(overrides: list[str], out_dir: Path) -> dict:
    s, cfg = resolve(overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = load_task(cfg)
    base = base_model_path(cfg, task, progress=False)
    t0 = time.perf_counter()
    tdir = Path(s.teacher) if s.teacher else teacher_path(cfg, progress=False)
    teacher_build_s = time.perf_counter() - t0
    teacher, tok = tiny.load(tdir)
    pool = reward_pool(cfg)
    evaluate = evaluator(cfg, tok, pool, task)
    scfg = StudentConfig(steps=s.student_steps, eval_every=s.eval_every_student, max_time_s=s.budget_s,
                         seed=s.seed)
    results: dict[str, dict] = {}

    def offline(name: str, data, loss_fn, held_out=None, steps_cfg=scfg) -> dict:
        model, _ = tiny.load(base)

        def measure(m):  # logit students: also their full KL to the teacher on held-out teacher responses
            acc = evaluate(m)
            return acc if held_out is None else {"accuracy": acc,
                                                 "eval_kl": eval_kl(m, teacher, held_out, tok.pad_token_id)}

        r = train_student(model, data, loss_fn, steps_cfg, tok.pad_token_id, measure, progress=False, desc=name)
        out = {"curve": r.curve, "steps": r.steps, "seconds": r.seconds, "model": model}
        if held_out is not None:
            out["eval_kl"] = r.curve[-1]["eval_kl"]
        print(json.dumps({"method": name, "acc": r.curve[-1]["accuracy"], "steps": r.steps}), flush=True)
        return out

    try:
        teacher_acc = evaluate(teacher.eval())
        base_acc = evaluate(tiny.load(base)[0].eval())
        if "rl" in s.methods:
            results["rl"] = _rl(cfg, out_dir / "rl", evaluate)
        need_traces = {"traces", "traces_rl"} & set(s.methods)
        traces_s = None
        if need_traces:
            t0 = time.perf_counter()
            tcfg = TracesConfig(num_prompts=s.num_prompts, samples_per_prompt=s.samples_per_prompt,
                                min_reward=s.min_reward)
            counts = generate_traces(teacher, tok, task, cfg, tcfg, pool, out_dir / "traces.jsonl", False)
            traces_s = time.perf_counter() - t0
            traces = read_traces(out_dir / "traces.jsonl")
            if "traces" in s.methods:
                results["traces"] = {**offline("traces", traces, sft_loss), "traces": counts, "data_s": traces_s}
            if "traces_rl" in s.methods:
                sft_cfg = dataclasses.replace(scfg, steps=s.traces_rl_sft_steps, max_time_s=None)
                sft = offline("traces_rl/sft", traces, sft_loss, steps_cfg=sft_cfg)
                tiny.save(sft.pop("model"), tok, out_dir / "traces_rl_sft")
                left_s = max(s.budget_s - sft["seconds"], 1.0)
                rl_cfg = apply_overrides(copy.deepcopy(cfg), [f"model.path={out_dir / 'traces_rl_sft'}",
                                                              f"max_time_s={left_s}"])
                rl = _rl(rl_cfg, out_dir / "traces_rl", evaluate)
                shifted = [{**c, "step": c["step"] + sft["steps"], "seconds": c["seconds"] + sft["seconds"]}
                           for c in rl["curve"][1:]]
                results["traces_rl"] = {"curve": sft["curve"] + shifted, "steps": sft["steps"] + rl["steps"],
                                        "sft_steps": sft["steps"], "data_s": traces_s}
        if "logits" in s.methods:
            lcfg = LogitsConfig(num_prompts=s.num_prompts, report_k=sorted(s.ks))
            t0 = time.perf_counter()
            seqs = teacher_samples(teacher, tok, task, cfg, lcfg)
            held_out = held_out_samples(teacher, tok, cfg, lcfg, task)
            sample_s = time.perf_counter() - t0
            for k in sorted(s.ks):
                t0 = time.perf_counter()
                meta = write_store(teacher, tok, seqs, dataclasses.replace(lcfg, top_k=k), out_dir / f"logits_k{k}",
                                   progress=False)
                store_s = time.perf_counter() - t0  # measured before the student trains
                data = list(LogitShards(out_dir / f"logits_k{k}"))
                results[f"logits_k{k}"] = {
                    **offline(f"logits_k{k}", data, sparse_kl_loss, held_out),
                    "bytes_per_position": meta["bytes_per_position"],
                    "file_bytes_per_position": meta["file_bytes_per_position"],
                    "info_loss_kl": meta["info_loss_kl"][str(k)], "data_s": sample_s + store_s}
            pairs = [(d.prompt_ids, d.response_ids) for d in data]  # the stores' sequences, in the same order
            results["logits_full"] = {**offline("logits_full", pairs, full_kl_loss_with(teacher), held_out),
                                      "bytes_per_position": 4 * len(tok), "data_s": sample_s}
        if "on_policy" in s.methods:
            op = apply_overrides(copy.deepcopy(cfg), [f"distill.teacher={tdir}", "algo.skip_zero_adv_groups=false"])
            results["on_policy"] = _rl(op, out_dir / "on_policy", evaluate)
    finally:
        pool.close()

    table = []
    for name, r in results.items():
        r.pop("model", None)
        curve = r["curve"]
        table.append({"method": name, "steps": r["steps"], "final_acc": curve[-1]["accuracy"],
                      "acc_half_budget": within(curve, s.budget_s / 2),
                      "best_acc": max(c["accuracy"] for c in curve), "final_s": round(curve[-1]["seconds"], 1),
                      "eval_kl": r.get("eval_kl"), "bytes_per_pos": r.get("bytes_per_position"),
                      "info_loss": r.get("info_loss_kl"), "data_s": round(r["data_s"], 1) if r.get("data_s") else None})
    acc = {row["method"]: row["final_acc"] for row in table}  # every method stopped by the same budget
    distilled = {m: a for m, a in acc.items() if m != "rl"}
    best = max(distilled, key=distilled.get) if distilled else None
    matched = None
    if "logits_k32" in results and "logits_full" in results:
        matched = matched_rel_gap(results["logits_k32"]["curve"], results["logits_full"]["curve"])
    return {
        "benchmark": "distill", "description": DESCRIPTION, "table": table,
        "gap_closed": gap_closed(distilled[best], acc["rl"], teacher_acc) if best and "rl" in acc else None,
        "k32_rel_loss_gap": matched[0] if matched else None,
        "k32_rel_loss_gap_at_step": matched[1] if matched else None,
        "best_distilled": best, "teacher_accuracy": teacher_acc, "base_accuracy": base_acc,
        "teacher": str(tdir), "teacher_build_s": teacher_build_s, "budget_s": s.budget_s,
        "settings": dataclasses.asdict(s), "overrides": overrides,
        "curves": {name: r["curve"] for name, r in results.items()},
        "details": {name: {k: v for k, v in r.items() if k != "curve"} for name, r in results.items()},
    }
