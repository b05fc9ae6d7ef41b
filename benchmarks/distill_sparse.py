"""k-sparse vs full-vocabulary logit distillation, students trained, at a 4,096-token vocabulary with a
peaked teacher: does a top-32 store (0.8% of the full distribution's bytes) train as good a student?

``tidal bench distill`` trains students on k = 32 and full KL, but its vocabulary has 54 tokens (k = 32 is
61% of the bytes); ``tidal bench distill_vocab`` has 8,192 tokens, but its CPU-trained language model of
Python source is far flatter than a real LLM (48% of its mass outside its top 32), and no student is
trained there. This benchmark builds a teacher that is both: a large vocabulary and most of the mass on a
few tokens, as a strong LLM's next-token distributions are on its own samples.

The task (reversal): a prompt of ``prompt_len`` distinct random tokens out of ``vocab_size - 1`` (the
last id separates prompt and response), and a response that reverses it; with ``noise`` > 0 each response
position is instead, with that probability, a token drawn uniformly from the prompt. A small Qwen2 model
trained ``teacher_steps`` supervised steps on the response tokens (cosine decay) is the teacher: short of
perfect, it is right most of the time at top-1 and puts most of the rest on the other prompt tokens (the
plausible alternatives), the way an LLM hesitates between a few continuations; its leakage over the
~4,080 tokens that are not in the prompt is the tail a top-k store drops. Its entropy, top-1 accuracy and
residual mass per k are reported.

The comparison, per seed in ``seeds`` (the ``distill`` benchmark's ``k32_vs_full`` protocol): students
start from the teacher's own checkpoint at ``student_step`` (same architecture, less trained), see the same
sequences in the same order (prompts drawn with the seed, responses sampled from the teacher at
temperature 1, as ``tidal distill logits`` stores them), take exactly ``student_steps`` steps with the same
cosine decay to 0, and are read once at the end by their full forward KL to the teacher on the response
positions of held-out teacher samples (``eval_kl``). The k-sparse targets are what the store keeps: top-k
ids, fp16 log-probs, the residual read as ``residual`` says (default a tail bucket;
``algo/distill.sparse_forward_kl``). Per seed, a k arm's gap = eval_kl(k) / eval_kl(full) - 1;
``k32_rel_loss_gap`` is the median over seeds, beside the full-KL students' own spread across seeds
(the noise a gap has to clear). Also reported per k: bytes per position against the full fp32
distribution, the teacher's residual mass and information lost, and the same-weights objective gap
(sparse loss over full KL on the full-KL student's weights: what the target alone changes, free of
training noise).

    tidal bench distill_sparse [--set seeds=[0,1,2]] [--set ks=[1,8,32]] [--set noise=0.1] [--set student_steps=300]
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from tidal.algo.distill import (
    RESIDUAL_MODES,
    bytes_per_position,
    full_bytes_per_position,
    full_forward_kl,
    sparse_forward_kl,
    sparse_information_loss,
    topk_sparsify,
)
from tidal.bench import load
from tidal.config import apply_overrides
from tidal.rollout.slots import cache_kwargs

_lm = load("_lm")  # benchmarks/_lm.py
cosine, train_lm = _lm.cosine, _lm.train_lm

DESCRIPTION = "k-sparse vs full KL students at a 4,096-token vocabulary with a peaked teacher (reversal task)"


@dataclass
class Settings:
    """This benchmark's knobs (``--set KEY=VALUE``)."""

    vocab_size: int = 4096
    """Tokens: ``vocab_size - 1`` content tokens and one separator."""
    prompt_len: int = 8
    """Distinct random tokens per prompt; the response has as many."""
    noise: float = 0.0
    """Probability that a response position is a uniformly drawn prompt token instead of the reversed one
    (0: the teacher's own uncertainty is the only spread)."""
    hidden_size: int = 128
    """Width of teacher and student (4 heads, MLP 4x, tied embeddings)."""
    num_layers: int = 2
    """Depth of teacher and student."""
    tie_embeddings: bool = True
    """Share the input embedding and the output head."""
    batch_size: int = 64
    """Sequences per step, for the teacher and the students."""
    teacher_seed: int = 0
    """Initialisation and training data of the teacher."""
    teacher_steps: int = 1000
    """Teacher training steps (AdamW, cosine decay to 0) on the task's own sequences."""
    teacher_lr: float = 1e-2
    """Peak learning rate of the teacher."""
    teacher_warmup: int = 50
    """Linear warm-up steps of the teacher's learning rate."""
    student_step: int = 200
    """The students start from the teacher's checkpoint after this many steps."""
    student_steps: int = 300
    """Steps every student takes (cosine decay to 0, read once at the end)."""
    student_lr: float = 1e-3
    """Peak learning rate of the students."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Student seeds: each draws its own prompts and teacher samples, shared by its arms."""
    ks: list[int] = field(default_factory=lambda: [1, 8, 32])
    """Sparse arms; a full-KL arm always runs."""
    residual: str = "tail_bucket"
    """How the sparse arms read the residual mass (``algo/distill.RESIDUAL_MODES``)."""
    eval_sequences: int = 256
    """Held-out teacher samples the students are read on."""


def prompts(s: Settings, n: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, prompt_len]`` distinct random content tokens per row."""
    return torch.rand(n, s.vocab_size - 1, generator=gen).argsort(-1)[:, : s.prompt_len]


def task_sequences(s: Settings, n: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, 2 * prompt_len + 1]`` sequences of the true process: prompt, separator, noisy reversal."""
    p = prompts(s, n, gen)
    response = p.flip(-1)
    noisy = torch.rand(n, s.prompt_len, generator=gen) < s.noise
    drawn = p.gather(-1, torch.randint(s.prompt_len, (n, s.prompt_len), generator=gen))
    sep = torch.full((n, 1), s.vocab_size - 1)
    return torch.cat([p, sep, torch.where(noisy, drawn, response)], -1)


def build_model(s: Settings) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
                         num_attention_heads=4, num_key_value_heads=4, intermediate_size=4 * s.hidden_size,
                         tie_word_embeddings=s.tie_embeddings, max_position_embeddings=2 * s.prompt_len + 1)
    return Qwen2ForCausalLM(config)


def response_logp(model, seqs: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probs ``[n * prompt_len, V]`` at the positions that predict the response tokens."""
    logits = model(input_ids=seqs, logits_to_keep=prompt_len + 1).logits[:, :-1]  # the lm head on those only
    return logits.float().log_softmax(-1).flatten(0, 1)


def train_teacher(s: Settings) -> tuple[Qwen2ForCausalLM, dict, list[dict]]:
    """(teacher, the state after ``student_step`` steps, curve): supervised on response tokens."""
    torch.manual_seed(s.teacher_seed)
    model, gen = build_model(s), torch.Generator().manual_seed(s.teacher_seed)

    def step_loss(_: int) -> torch.Tensor:
        seqs = task_sequences(s, s.batch_size, gen)
        logp = response_logp(model, seqs, s.prompt_len)  # supervised on the response tokens only
        return -logp.gather(-1, seqs[:, s.prompt_len + 1 :].reshape(-1, 1)).mean()

    start, curve = train_lm(model, s.teacher_steps, s.teacher_lr, step_loss, s.student_step, s.teacher_warmup)
    return model.eval(), start, curve


@torch.no_grad()
def teacher_samples(teacher, s: Settings, n: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, 2 * prompt_len + 1]``: prompts drawn with ``gen``, responses sampled from the teacher at
    temperature 1 (multinomial with the same generator, so a seed fixes them)."""
    seqs = torch.cat([prompts(s, n, gen), torch.full((n, 1), s.vocab_size - 1)], -1)
    cache = DynamicCache()  # filled in place by each forward
    logits = teacher(input_ids=seqs, use_cache=True, **cache_kwargs(teacher, cache)).logits[:, -1]
    for _ in range(s.prompt_len):
        token = torch.multinomial(logits.float().softmax(-1), 1, generator=gen)
        seqs = torch.cat([seqs, token], -1)
        logits = teacher(input_ids=token, use_cache=True, **cache_kwargs(teacher, cache)).logits[:, -1]
    return seqs


def sparse_target(teacher_logp: torch.Tensor, k: int):
    """What the store keeps: top-k ids, fp16 log-probs, fp32 residual."""
    ids, top, residual = topk_sparsify(teacher_logp, k)
    return ids, top.half().float(), residual


def train_student(teacher, start: dict, data: list[torch.Tensor], k: int | None, s: Settings):
    """A student from ``start`` trained on ``data`` (one batch per step) against the full teacher (k None)
    or its k-sparse reading."""
    student = build_model(s)
    student.load_state_dict(start)
    opt = torch.optim.AdamW(student.parameters(), lr=s.student_lr, betas=(0.9, 0.95), weight_decay=0.0)
    for step, seqs in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = cosine(step, len(data), s.student_lr)
        with torch.no_grad():
            t_logp = response_logp(teacher, seqs, s.prompt_len)
        q_logp = response_logp(student, seqs, s.prompt_len)
        if k is None:
            loss = full_forward_kl(q_logp, t_logp).mean()
        else:
            loss = sparse_forward_kl(q_logp, *sparse_target(t_logp, k), residual=s.residual).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
    return student.eval()


def run(overrides: list[str], out_dir: Path) -> dict:
    s = apply_overrides(Settings(), overrides)
    if not 0.0 <= s.noise <= 1.0:
        raise ValueError(f"noise={s.noise}: must be in [0, 1]")
    if s.residual not in RESIDUAL_MODES:
        raise ValueError(f"residual={s.residual!r}: use one of {RESIDUAL_MODES}")
    if s.prompt_len >= s.vocab_size - 1:
        raise ValueError(f"prompt_len={s.prompt_len} needs vocab_size > prompt_len + 1, got {s.vocab_size}")
    ks = sorted(k for k in s.ks if k <= s.vocab_size)
    t0 = time.perf_counter()
    teacher, start, curve = train_teacher(s)
    teacher_s = time.perf_counter() - t0
    held = teacher_samples(teacher, s, s.eval_sequences, torch.Generator().manual_seed(10_000 + s.teacher_seed))
    with torch.no_grad():
        held_t = response_logp(teacher, held, s.prompt_len)
        truth = held[:, : s.prompt_len].flip(-1).flatten()
        entropy = float(-(held_t.exp() * held_t).sum(-1).mean())
        teacher_acc = float((held_t.argmax(-1) == truth).float().mean())
        table = []
        for k in ks:
            _, _, residual = topk_sparsify(held_t, k)
            table.append({"k": k, "bytes_per_pos": bytes_per_position(k, s.vocab_size),
                          "bytes_fraction": bytes_per_position(k, s.vocab_size) / full_bytes_per_position(s.vocab_size),
                          "residual": float(residual.mean()),
                          "info_loss": float(sparse_information_loss(held_t.double(), k).mean())})
    per_seed = []
    for seed in s.seeds:
        gen = torch.Generator().manual_seed(seed)
        data = [teacher_samples(teacher, s, s.batch_size, gen) for _ in range(s.student_steps)]
        row = {"seed": seed}
        t1 = time.perf_counter()
        full_student = None
        for k in [None, *ks]:
            torch.manual_seed(seed)
            student = train_student(teacher, start, data, k, s)
            with torch.no_grad():
                q = response_logp(student, held, s.prompt_len)
                name = "full" if k is None else f"k{k}"
                row[f"{name}_eval_kl"] = float(full_forward_kl(q, held_t).mean())
                row[f"{name}_token_acc"] = float((q.argmax(-1) == truth).float().mean())
                if k is None:
                    full_student = q
                else:
                    row[f"{name}_objective_gap"] = float(
                        sparse_forward_kl(full_student, *sparse_target(held_t, k), residual=s.residual).mean()
                        / full_forward_kl(full_student, held_t).mean()) - 1.0
        row["seconds"] = round(time.perf_counter() - t1, 1)
        for k in ks:
            row[f"k{k}_gap"] = row[f"k{k}_eval_kl"] / row["full_eval_kl"] - 1.0
        print({"seed": seed, **{key: round(v, 5) if isinstance(v, float) else v for key, v in row.items()}},
              flush=True)
        per_seed.append(row)
    with torch.no_grad():
        base = build_model(s)
        base.load_state_dict(start)
        base_kl = float(full_forward_kl(response_logp(base, held, s.prompt_len), held_t).mean())
    for r in table:
        k = r["k"]
        r["student_gap_median"] = statistics.median([p[f"k{k}_gap"] for p in per_seed])
        r["student_gap_min"] = min(p[f"k{k}_gap"] for p in per_seed)
        r["student_gap_max"] = max(p[f"k{k}_gap"] for p in per_seed)
        r["objective_gap_median"] = statistics.median([p[f"k{k}_objective_gap"] for p in per_seed])
    full_kls = [p["full_eval_kl"] for p in per_seed]
    k32 = next((r for r in table if r["k"] == 32), None)
    return {
        "benchmark": "distill_sparse", "description": DESCRIPTION, "table": table,
        "k32_rel_loss_gap": k32["student_gap_median"] if k32 else None,
        "k32_bytes_fraction": k32["bytes_fraction"] if k32 else None,
        "k32_rel_objective_gap": k32["objective_gap_median"] if k32 else None,
        "full_eval_kl_median": statistics.median(full_kls),
        "full_eval_kl_spread": (max(full_kls) - min(full_kls)) / statistics.median(full_kls),
        "start_eval_kl": base_kl, "per_seed": per_seed,
        "num_vocab": s.vocab_size, "full_bytes_per_position": full_bytes_per_position(s.vocab_size),
        "teacher_entropy": entropy, "teacher_token_accuracy": teacher_acc,
        "true_entropy": true_entropy(s), "teacher_curve": curve, "teacher_s": round(teacher_s, 1),
        "num_params": sum(p.numel() for p in teacher.parameters()),
        "settings": dataclasses.asdict(s), "overrides": overrides,
    }


def true_entropy(s: Settings) -> float:
    """Entropy of the task's own next-token distribution at a response position (nats): 1 - noise + noise/n
    on the reversed token, noise/n on each of the n - 1 others."""
    n, e = s.prompt_len, s.noise
    top, other = 1 - e + e / n, e / n
    return -(top * math.log(top) if top > 0 else 0.0) - ((n - 1) * other * math.log(other) if other > 0 else 0.0)
