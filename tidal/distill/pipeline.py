"""The ``tidal distill`` commands end to end: teacher data, then a student trained on it, then a summary.

``distill_traces``: teacher traces (``traces.py``), then supervised training of the student on them.
``distill_logits``: the teacher's k-sparse store (``logits.py``), then the student trained with forward KL
to it; with ``compare_full`` a second student from the same start is trained with the full-vocabulary KL
computed on the fly, and both are measured by the same yardstick: the full forward KL to the teacher on
its responses to the held-out prompts (``eval_kl``), so ``rel_loss_gap`` = eval_kl(k-sparse) /
eval_kl(full) - 1 says what the sparsity cost.

The student starts from ``student``, a model directory: by default (``tidal distill`` without ``--student``) the
recipe's warm-started base (``system/run.base_model_path``, cached), the model an RL run of the same recipe would
start from.
``--set`` keys go to ``traces.*`` / ``logits.*`` / ``student.*`` / ``teacher.*`` (the quickstart teacher)
here and to the run config otherwise
(task, reward, rollout, sft ...).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from tidal.algo.distill import full_forward_kl
from tidal.config import apply_overrides
from tidal.distill.common import check_same_vocab, evaluator, load_model, load_task, reward_pool
from tidal.distill.logits import LogitsConfig, teacher_samples, write_store
from tidal.distill.shards import LogitShards
from tidal.distill.student import (
    StudentConfig,
    full_kl_loss_with,
    response_logprobs,
    sft_loss,
    sparse_kl_loss,
    train_student,
)
from tidal.distill.teacher import TeacherConfig
from tidal.distill.traces import TracesConfig, generate_traces, read_traces
from tidal.models import tiny
from tidal.utils.outputs import Layout, RunDir, config_inputs

SECTIONS = {"traces": TracesConfig, "logits": LogitsConfig, "student": StudentConfig, "teacher": TeacherConfig}
_Sections = dataclasses.make_dataclass("_Sections", [(name, cls, dataclasses.field(default_factory=cls))
                                                      for name, cls in SECTIONS.items()])
"""The sections as one config, so an override's errors name its whole key (``traces.temperature``)."""


def resolve(base_cfg, overrides: list[str]) -> tuple[object, dict]:
    """(run config, {section: config}) from a recipe's run config and ``--set`` overrides."""
    holder = _Sections()
    rest = []
    for item in overrides:
        head, dot, _ = item.partition(".")
        if dot and head in SECTIONS:
            apply_overrides(holder, [item])
        else:
            rest.append(item)
    sections = {name: getattr(holder, name) for name in SECTIONS}
    for obj in sections.values():
        if hasattr(obj, "__post_init__"):
            obj.__post_init__()  # overrides bypass __init__: validate, naming the key
    cfg = apply_overrides(base_cfg, rest)
    return cfg, sections


def student_start(cfg, student: str | None, progress: bool) -> Path:
    """The student's model directory. The caller resolves the default (the recipe's base, ``tidal distill``
    does it with ``system/run.base_model_path``): this package sits below the run wiring."""
    if not student:
        raise ValueError("distill: no student model directory (pass student=, e.g. the run's base_model_path)")
    return Path(student)


OUTPUTS = ("traces.jsonl", "logits", "student", "student_full", "summary.json")
"""What ``tidal distill`` writes into ``--out``: a previous run's are refused unless ``overwrite`` (which deletes
what that run wrote, nothing else: ``utils/outputs.py``)."""


def open_out(out: Path, mode: str, overwrite: bool, cfg, inputs: dict) -> RunDir:
    """``out`` checked (no previous results without ``overwrite``, no input among the files it would delete)
    and locked; ``begin`` it once the teacher, student and task are loaded."""
    return RunDir.open(out, Layout(f"distill {mode}", OUTPUTS, OUTPUTS), overwrite=overwrite,
                       inputs={**config_inputs(cfg), **inputs}, begin=False)


def distill_traces(teacher_dir: str, out_dir: str | Path, base_cfg, overrides: list[str] = (),
                   student: str | None = None, progress: bool = True, train: bool = True,
                   overwrite: bool = False) -> dict:
    cfg, sec = resolve(base_cfg, list(overrides))
    out = Path(out_dir)
    with open_out(out, "traces", overwrite, cfg, {"--teacher": teacher_dir, "--student": student}) as run_dir:
        task = load_task(cfg)
        teacher, tokenizer = load_model(teacher_dir, "teacher")
        run_dir.begin()
        pool = reward_pool(cfg)
        try:
            evaluate = evaluator(cfg, tokenizer, pool, task)
            summary: dict = {"teacher": str(teacher_dir), "teacher_accuracy": evaluate(teacher.eval())}
            start = time.perf_counter()
            counts = generate_traces(teacher, tokenizer, task, cfg, sec["traces"], pool, out / "traces.jsonl",
                                     progress)
            summary.update(traces=counts, traces_seconds=time.perf_counter() - start,
                           traces_config=dataclasses.asdict(sec["traces"]))
            if train:
                summary.update(train_from(cfg, sec["student"], student, read_traces(out / "traces.jsonl"), sft_loss,
                                          evaluate, out / "student", progress, "student (SFT on traces)"))
        finally:
            pool.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def distill_logits(teacher_dir: str, out_dir: str | Path, base_cfg, top_k: int | None = None,
                   overrides: list[str] = (), student: str | None = None, traces: str | None = None,
                   compare_full: bool = False, progress: bool = True, train: bool = True,
                   overwrite: bool = False) -> dict:
    cfg, sec = resolve(base_cfg, list(overrides))
    lcfg: LogitsConfig = sec["logits"]
    if top_k is not None:
        lcfg = dataclasses.replace(lcfg, top_k=top_k)
    out = Path(out_dir)
    inputs = {"--teacher": teacher_dir, "--student": student, "--traces": traces}
    with open_out(out, "logits", overwrite, cfg, inputs) as run_dir:
        task = load_task(cfg)
        teacher, tokenizer = load_model(teacher_dir, "teacher")
        start_dir = student_start(cfg, student, progress) if train else None
        if start_dir is not None:
            check_same_vocab(tokenizer, tiny.load_tokenizer(start_dir), teacher_dir)
        run_dir.begin()
        pool = reward_pool(cfg)
        try:
            evaluate = evaluator(cfg, tokenizer, pool, task)
            summary: dict = {"teacher": str(teacher_dir), "teacher_accuracy": evaluate(teacher.eval())}
            seqs = read_traces(Path(traces)) if traces else teacher_samples(teacher, tokenizer, task, cfg, lcfg)
            t0 = time.perf_counter()
            meta = write_store(teacher, tokenizer, seqs, lcfg, out / "logits", progress,
                               extra_meta={"teacher": str(teacher_dir), "source": traces or "teacher samples"})
            summary.update(store={k: v for k, v in meta.items() if k != "shards"},
                           store_seconds=time.perf_counter() - t0)
            if train:
                held_out = held_out_samples(teacher, tokenizer, cfg, lcfg, task)
                data = list(LogitShards(out / "logits"))
                sparse = train_from(cfg, sec["student"], str(start_dir), data, sparse_kl_loss, evaluate,
                                    out / "student", progress, f"student (top-{lcfg.top_k} KL)", teacher, held_out)
                summary["sparse"] = sparse
                if compare_full:
                    pairs = [(s.prompt_ids, s.response_ids) for s in data]
                    full = train_from(cfg, sec["student"], str(start_dir), pairs, full_kl_loss_with(teacher),
                                      evaluate, out / "student_full", progress, "student (full KL)", teacher,
                                      held_out)
                    summary["full"] = full
                    summary["rel_loss_gap"] = sparse["eval_kl"] / full["eval_kl"] - 1.0
        finally:
            pool.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def held_out_samples(teacher, tokenizer, cfg, lcfg: LogitsConfig, task) -> list:
    """The teacher's responses to the held-out prompts: where every student's KL to the teacher is read."""
    from tidal.rollout.local import LocalEngine
    from tidal.rollout.requests import group_requests

    engine = LocalEngine(teacher, tokenizer, dataclasses.replace(cfg.rollout, temperature=lcfg.temperature),
                         cfg.seed + 1, 0)
    prompts = task.eval_prompts()[: cfg.num_eval]
    return [(list(t.prompt_ids), list(t.token_ids)) for t in engine.generate(group_requests(tokenizer, prompts, 1))
            if t.token_ids]


@torch.no_grad()
def eval_kl(student, teacher, seqs: list, pad_id: int, batch: int = 256) -> float:
    """Mean full forward KL(teacher || student) per response position of ``seqs``."""
    total, count = 0.0, 0
    for i in range(0, len(seqs), batch):
        chunk = seqs[i : i + batch]
        kl = full_forward_kl(response_logprobs(student, chunk, pad_id), response_logprobs(teacher, chunk, pad_id))
        total, count = total + float(kl.sum()), count + len(kl)
    return total / max(count, 1)


def train_from(cfg, scfg: StudentConfig, student: str | None, data: list, loss_fn, evaluate, out: Path, progress: bool,
           desc: str, teacher=None, held_out: list | None = None) -> dict:
    start_dir = student_start(cfg, student, progress)
    model, tokenizer = tiny.load(start_dir)
    result = train_student(model, data, loss_fn, scfg, tokenizer.pad_token_id, lambda m: evaluate(m), progress, desc)
    tiny.save(model, tokenizer, out / "model")
    summary = {"student_start": str(start_dir), "student_out": str(out / "model"), "steps": result.steps,
               "seconds": result.seconds, "curve": result.curve, "num_sequences": len(data),
               "start_accuracy": result.curve[0]["accuracy"], "final_accuracy": result.curve[-1]["accuracy"],
               "best_accuracy": max(c["accuracy"] for c in result.curve), "student_config": dataclasses.asdict(scfg)}
    if teacher is not None and held_out:
        summary["eval_kl"] = eval_kl(model, teacher, held_out, tokenizer.pad_token_id)
    return summary
