"""The teacher: load a local model directory, score samples with it, or build the quickstart's own.

``TeacherScorer`` is what on-policy distillation adds to the RL loop: given the student's sampled
trajectories it computes the teacher's log-probability of every response token (one no-grad forward
over the prompt + response, in micro-batches) and stores them on the trajectory
(``Trajectory.teacher_logprobs``). The controller calls it from the scorer thread, right after the
reward, so the teacher runs beside the engine and the trainer, never on the trainer's path; the
trainer turns the stored log-probs into per-token advantages (``algo/distill.distill_advantage``).

``system/run.teacher_path`` makes the quickstart's teacher (with ``teacher_run_config``): a wider tiny
model (hidden 192, ~2.4M parameters, against the student's 1.06M) trained by tidal's own supervised warm
start until its held-out greedy accuracy reaches ``accuracy_band`` (default [0.95, 1]), cached under
``.tidal_cache/base-*`` exactly like the warm-start bases (same key scheme, same atomic publish), so a
second call is free. FACTS.md: hidden 256 (4.2M) is slow to train on 2 cores; 192 is the trade chosen
here.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.config import ConfigError
from tidal.models import tiny
from tidal.models.logprobs import token_logprobs
from tidal.models.tiny import ModelConfig
from tidal.types import Trajectory


@dataclass
class DistillConfig:
    """On-policy distillation in the RL loop (``tidal train on_policy_distill --set distill.teacher=DIR``)."""

    teacher: str | None = None
    """Local Hugging Face model directory of the teacher; it must share the student's tokenizer (same
    vocabulary). ``quickstart``: the quickstart teacher for this run's task, built and cached on first
    use (``TeacherConfig``). None: no teacher, plain RL. The advantage mixes it in per ``algo.distill_kl_coef`` and
    ``algo.distill_reward_coef``."""
    micro_batch: int = 256
    """Sequences per teacher forward pass in the scorer."""


class TeacherScorer:
    """Scores trajectories with a frozen teacher model: ``score(trajs)`` fills ``teacher_logprobs``."""

    def __init__(self, path: str | Path, student_tokenizer, micro_batch: int = 256, temperature: float = 1.0):
        path = Path(path)
        if not (path / "config.json").exists():
            raise ConfigError(f"distill.teacher={str(path)!r}: no model there (expected a Hugging Face model "
                              "directory with config.json)")
        self.model, tokenizer = tiny.load(path)
        self.model.eval().requires_grad_(False)
        if tokenizer.get_vocab() != student_tokenizer.get_vocab():
            raise ConfigError(f"distill.teacher={str(path)!r}: its tokenizer's vocabulary differs from the student's; "
                              "token-level distillation needs the same vocabulary")
        self.pad_id = student_tokenizer.pad_token_id
        self.micro_batch = micro_batch
        self.temperature = temperature
        self.seconds = 0.0
        self.num_tokens = 0
        self.rows = 0
        self.unique_rows = 0
        self._lock = threading.Lock()  # sync mode and the scorer thread never overlap, but be explicit

    @torch.no_grad()
    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """The teacher's log-prob of every response token (at ``temperature``, the sampler's: the student's
        behaviour log-probs are taken at it too). Identical (prompt, response) pairs are scored once: a
        group samples one prompt ``group_size`` times and a student that is often right writes the same
        answer again and again (``unique_rows`` / ``rows`` count how much this saves)."""
        keys = [(tuple(p), tuple(r)) for p, r in zip(prompts, responses)]
        unique = list(dict.fromkeys(keys))
        self.rows += len(keys)
        self.unique_rows += len(unique)
        scored: dict = {}
        for start in range(0, len(unique), self.micro_batch):
            chunk = unique[start : start + self.micro_batch]
            width = max(len(p) + len(r) for p, r in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for i, (p, r) in enumerate(chunk):
                ids[i, : len(p) + len(r)] = torch.tensor([*p, *r])
                attn[i, : len(p) + len(r)] = 1
            logp_bt, _ = token_logprobs(self.model, ids, attn, self.temperature)
            scored.update({key: logp_bt[i, len(key[0]) : len(key[0]) + len(key[1])].tolist()
                           for i, key in enumerate(chunk)})
        return [list(scored[key]) for key in keys]

    def score(self, trajs: list[Trajectory]) -> None:
        """Set ``teacher_logprobs`` on each trajectory (agent episodes: observation tokens get 0.0; they are
        masked out of the loss anyway)."""
        if not trajs:
            return
        start = time.perf_counter()
        with self._lock:
            scored = self.logprobs([list(t.prompt_ids) for t in trajs], [list(t.token_ids) for t in trajs])
        for t, lp in zip(trajs, scored):
            t.teacher_logprobs = lp if t.loss_mask is None else [x if m else 0.0 for x, m in zip(lp, t.loss_mask)]
        self.seconds += time.perf_counter() - start
        self.num_tokens += sum(t.num_tokens for t in trajs)


@dataclass
class TeacherConfig:
    """The quickstart teacher: a wider tiny model, warm-started (supervised) to high accuracy and cached."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(hidden_size=192, intermediate_size=768,
                                                                   num_heads=4, num_kv_heads=4, init_seed=1))
    """Hidden 192, 4 layers (~2.4M parameters, 2.3x the 1.06M student): FACTS.md's hidden 256 (4.2M)
    trains too slowly on 2 cores for a teacher built in minutes."""
    accuracy_band: list[float] = field(default_factory=lambda: [0.95, 1.0])
    """Train until held-out greedy accuracy is in this band (checked every ``check_every`` steps)."""
    steps: int = 6000
    """Most supervised steps before giving up (with a clear error naming the best accuracy seen)."""
    check_every: int = 50
    batch_size: int = 64
    lr: float = 1e-3


def teacher_run_config(student_cfg, teacher: TeacherConfig):
    """The student's run config with the teacher's model and warm start: same task, reward and eval prompts,
    so the teacher's cache key covers everything that shapes it."""
    cfg = dataclasses.replace(student_cfg, model=teacher.model)
    cfg.sft = dataclasses.replace(student_cfg.sft, accuracy_band=list(teacher.accuracy_band), steps=teacher.steps,
                                  check_every=teacher.check_every, batch_size=teacher.batch_size, lr=teacher.lr)
    return cfg


def distill_metrics(trajs: list[Trajectory], scorer: TeacherScorer) -> dict[str, float]:
    """One step's on-policy distillation metrics: the mean per-token reverse-KL estimate log pi_behav -
    log pi_teacher over the sampled tokens the teacher scored, and the teacher's cumulative cost."""
    total, count = 0.0, 0
    for t in trajs:
        if t.teacher_logprobs is None:
            continue
        mask = t.loss_mask or [1] * t.num_tokens
        for lp, tp, m in zip(t.logprobs, t.teacher_logprobs, mask):
            if m:
                total, count = total + (lp - tp), count + 1
    return {"distill/reverse_kl": total / max(count, 1), "distill/teacher_s": scorer.seconds,
            "distill/teacher_tokens": float(scorer.num_tokens),
            "distill/teacher_unique_frac": scorer.unique_rows / max(scorer.rows, 1)}
