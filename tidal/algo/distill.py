"""Distillation losses: forward KL to a full or k-sparse teacher distribution, and per-token reverse KL.

Three ways a student learns from a teacher, as pure tensor functions (``[N, V]`` tensors are N token
positions over a V-token vocabulary; ``_n`` one value per position):

- **Full forward KL** (classic knowledge distillation, Hinton et al. 2015, arXiv 1503.02531):
  KL(p_teacher || q_student) = sum_v p_v (log p_v - log q_v) at each position, with the teacher's
  whole next-token distribution computed on the fly.

- **k-sparse forward KL** (Gemini 2.5 report, arXiv 2507.06261: smaller models learn the
  teacher's next-token distribution "approximated using a k-sparse distribution over the vocabulary",
  which cuts storage and compute). Only the teacher's top-k token ids and log-probs are kept, plus the
  *residual mass* r = sum of the other V - k probabilities (= 1 - sum_{i <= k} p_i). How the residual
  is used is the choice that matters:

  * ``tail_bucket`` (default): the residual is one extra outcome, "some other token". Teacher and
    student are both coarse-grained to k + 1 outcomes (the student's tail is its mass outside
    the teacher's top-k ids) and the loss is the exact KL between those two
    distributions. By the data-processing inequality this is <= the full KL and equals it when the
    teacher puts no mass outside the top-k; the student is never pushed to put zero mass on the tail
    (the bias of truncating a distribution that Anshumann et al., "Sparse Logit Sampling", arXiv
    2503.16870, show for top-k caching).
  * ``uniform_tail``: the residual is read as spread evenly over the V - k other tokens (the reading
    ``sparse_information_loss`` measures against), and the loss is the full KL to that distribution:
    the tail bucket's terms plus r times the KL from the uniform tail to the student's tail shape. Where
    the tail bucket leaves the shape of the student's tail untrained (whatever it was at the start),
    this pulls it toward flat; it helps when the teacher's tail is closer to flat than the student's
    (a teacher's leakage over thousands of unrelated tokens), and costs nothing in storage.
  * ``renormalize``: the top-k probabilities are rescaled to sum to 1 and the residual is dropped:
    cross-entropy of the student's (full-softmax) log-probs on the top-k ids against p_i / (1 - r),
    minus that distribution's entropy (so it is 0 when the student matches it on those ids and has
    no tail). It pushes the student's tail mass to zero: the truncation bias named above.

- **Per-token reverse KL** for on-policy distillation (GKD, Agarwal et al., arXiv 2306.13649; Thinking
  Machines' "On-Policy Distillation" post, Lu et al. 2025): the student samples, the teacher scores
  each sampled token, and log q_student(x_t) - log p_teacher(x_t) is a one-sample estimate of the
  per-token reverse KL(q || p) (the k1 estimator). Its negative is a dense per-token reward: used as
  the advantage of a policy-gradient step with no discounting (the post's discount 0), the expected
  update is the gradient of the reverse KL, and the RL loss's behaviour log-probs and importance
  ratios correct samples from an older student version exactly as they correct RL samples.
"""

from __future__ import annotations

import math

import torch

RESIDUAL_MODES = ("tail_bucket", "uniform_tail", "renormalize")


def topk_sparsify(teacher_logp_nv: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's k-sparse distribution at each position: ``(ids_nk, logp_nk, residual_n)``, the top-k
    token ids and log-probs in descending order and the residual mass: the summed probability of the
    other V - k tokens (summed directly in float64, not as 1 - the top-k sum: that difference cancels to
    rounding error when the residual is small, ~1e-6 at k = 32 here, and is 0 exactly at k = V)."""
    assert 1 <= k <= teacher_logp_nv.shape[-1], f"top-k needs 1 <= k <= vocab ({teacher_logp_nv.shape[-1]}), got {k}"
    sorted_nv, order_nv = teacher_logp_nv.sort(dim=-1, descending=True)
    residual_n = sorted_nv[..., k:].double().exp().sum(-1).to(teacher_logp_nv.dtype)
    return order_nv[..., :k], sorted_nv[..., :k], residual_n


def full_forward_kl(student_logp_nv: torch.Tensor, teacher_logp_nv: torch.Tensor) -> torch.Tensor:
    """KL(p_teacher || q_student) per position, ``[N]``, over the whole vocabulary (Hinton et al., arXiv
    1503.02531). Both arguments are log-probs (log-softmax outputs); tokens the teacher gives zero
    probability contribute 0. Differentiable in the student; the teacher is treated as a constant."""
    p_nv = teacher_logp_nv.detach().exp()
    return (p_nv * (teacher_logp_nv.detach() - student_logp_nv)).sum(-1)


def sparse_forward_kl(student_logp_nv: torch.Tensor, ids_nk: torch.Tensor, teacher_logp_nk: torch.Tensor,
                      residual_n: torch.Tensor, *, residual: str = "tail_bucket",
                      eps: float = 1e-12) -> torch.Tensor:
    """Forward KL from a k-sparse teacher (Gemini 2.5, arXiv 2507.06261) to the student, per position ``[N]``.

    ``tail_bucket``: KL over k + 1 outcomes (the k ids, then "any other token"):
        sum_i p_i (log p_i - log q_i) + r (log r - log q_tail),   q_tail = sum_{v not in top-k} q_v;
    a term with p_i = 0 (or r = 0) is 0. ``renormalize``: p'_i = p_i / (1 - r),
        sum_i p'_i (log p'_i - log q_i),
    with q_i the student's full-softmax probabilities (the residual is dropped). ``uniform_tail``: the
    teacher read as top-k plus u = r / (V - k) on every other token,
        sum_i p_i (log p_i - log q_i) + sum_{v not in top-k} u (log u - log q_v)
    (0 tail terms at k = V). q_tail is the student's mass outside the k ids, summed directly
    (``student_tail_logmass``); ``eps`` floors it and r inside the logs."""
    if residual not in RESIDUAL_MODES:
        raise ValueError(f"residual={residual!r}: use one of {RESIDUAL_MODES}")
    q_logp_nk = student_logp_nv.gather(-1, ids_nk.long())
    p_logp_nk = teacher_logp_nk.detach().to(q_logp_nk.dtype)
    r_n = residual_n.detach().to(q_logp_nk.dtype)
    if residual == "renormalize":
        p_logp_nk = p_logp_nk - torch.log1p(-r_n.clamp(max=1.0 - eps)).unsqueeze(-1)
        return (p_logp_nk.exp() * (p_logp_nk - q_logp_nk)).sum(-1)
    top_n = (p_logp_nk.exp() * (p_logp_nk - q_logp_nk)).sum(-1)
    if residual == "uniform_tail":
        num_tail = student_logp_nv.shape[-1] - ids_nk.shape[-1]
        if num_tail == 0:
            return top_n
        u_n = r_n / num_tail
        sum_log_q_tail_n = student_logp_nv.sum(-1) - q_logp_nk.sum(-1)
        tail_n = r_n * u_n.clamp(min=eps).log() - u_n * sum_log_q_tail_n
        return top_n + torch.where(r_n > 0, tail_n, torch.zeros_like(r_n))
    log_q_tail_n = student_tail_logmass(student_logp_nv, ids_nk).clamp(min=math.log(eps))
    tail_n = torch.where(r_n > 0, r_n * (r_n.clamp(min=eps).log() - log_q_tail_n), torch.zeros_like(r_n))
    return top_n + tail_n


def student_tail_logmass(student_logp_nv: torch.Tensor, ids_nk: torch.Tensor) -> torch.Tensor:
    """log of the student's probability on the tokens outside ``ids_nk``, per position ``[N]``: a logsumexp
    over those tokens' log-probs. Computed this way rather than as log(1 - sum of the top-k probabilities),
    which cancels when the tail is small (a student close to a teacher with a ~1e-5 tail loses most of
    the tail's digits in float32). With no token outside (k = V) it is about -1e30 instead of -inf, so
    its gradient stays finite where the caller masks the term out."""
    outside_nv = student_logp_nv.scatter(-1, ids_nk.long(), -1e30)
    return outside_nv.logsumexp(-1)


def sparse_information_loss(teacher_logp_nv: torch.Tensor, k: int) -> torch.Tensor:
    """What keeping only the top-k loses, per position ``[N]``: KL(p || p~), where p~ is the k-sparse
    teacher read back as a full distribution (top-k kept, the residual spread evenly over the V - k
    other tokens: the most uniform reading of "r of the mass went elsewhere"). 0 when the tail is
    uniform or empty; at k = V it is 0."""
    num_vocab = teacher_logp_nv.shape[-1]
    ids_nk, _, residual_n = topk_sparsify(teacher_logp_nv, k)
    if k == num_vocab:
        return torch.zeros_like(residual_n)
    p_nv = teacher_logp_nv.exp()
    tail_nv = torch.ones_like(p_nv, dtype=torch.bool).scatter(-1, ids_nk, False)
    spread_n = residual_n.clamp(min=1e-30) / (num_vocab - k)
    terms_nv = p_nv * (teacher_logp_nv - spread_n.log().unsqueeze(-1))
    return torch.where(tail_nv & (p_nv > 0), terms_nv, torch.zeros_like(terms_nv)).sum(-1)


def reverse_kl_per_token(student_logp_n: torch.Tensor, teacher_logp_n: torch.Tensor) -> torch.Tensor:
    """log q_student(x_t) - log p_teacher(x_t) at each sampled token: the one-sample (k1) estimate of the
    reverse KL(q || p) (GKD, arXiv 2306.13649; Thinking Machines' on-policy distillation, 2025).
    Positive where the student is more sure of its token than the teacher; its mean over tokens
    the student sampled is an unbiased estimate of the summed per-position reverse KL."""
    return student_logp_n - teacher_logp_n


def distill_advantage(adv: torch.Tensor, teacher_logp_bt: torch.Tensor, behav_logp_bt: torch.Tensor,
                      mask_bt: torch.Tensor, *, distill_kl_coef: float = 1.0,
                      distill_reward_coef: float = 0.0) -> torch.Tensor:
    """On-policy distillation's per-token advantage ``[B, T]``:

        A_t = -distill_kl_coef * (log q_behav(x_t) - log p_teacher(x_t)) + distill_reward_coef * A_reward,

    the negative per-token reverse KL of each sampled token (no discounting: Thinking Machines' post uses
    discount 0, each token's advantage is its own reverse-KL estimate) plus, optionally, the configured
    estimator's reward advantage ``adv`` (``[B]`` or ``[B, T]``) to mix in the verifier's signal (GKD,
    arXiv 2306.13649, sec. 3.2, combines distillation with RL fine-tuning this way). The student's
    log-prob is the behaviour log-prob the engine sampled with, so the reward is a constant for the
    policy loss (as a verifier's is); staleness and engine mismatch are then corrected by the loss's
    own ratio against those same behaviour log-probs. Masked tokens get 0.
    Defaults: kl coefficient 1 and no reward, the post's pure distillation setup."""
    mask = mask_bt.to(teacher_logp_bt.dtype)
    reward_bt = adv.unsqueeze(-1).expand_as(mask) if adv.dim() == 1 else adv
    kl_bt = reverse_kl_per_token(behav_logp_bt, teacher_logp_bt)
    # a selection, not a product with the mask: padded log-probs may be -inf, and 0 * inf is NaN
    return torch.where(mask > 0, -distill_kl_coef * kl_bt + distill_reward_coef * reward_bt, 0.0)


def bytes_per_position(k: int, num_vocab: int, id_bytes: int | None = None, logp_bytes: int = 2,
                       residual_bytes: int = 4) -> int:
    """Storage of one position's k-sparse teacher: k ids (2 bytes when the vocabulary fits uint16, else
    4), k log-probs (``logp_bytes``: fp16 by default) and one residual (fp32)."""
    if id_bytes is None:
        id_bytes = 2 if num_vocab <= 2**16 else 4
    return k * (id_bytes + logp_bytes) + residual_bytes


def full_bytes_per_position(num_vocab: int, logp_bytes: int = 4) -> int:
    """Storage of one position's full teacher distribution (fp32 log-probs by default)."""
    return num_vocab * logp_bytes


__all__ = [
    "RESIDUAL_MODES",
    "topk_sparsify",
    "full_forward_kl",
    "sparse_forward_kl",
    "student_tail_logmass",
    "sparse_information_loss",
    "reverse_kl_per_token",
    "distill_advantage",
    "bytes_per_position",
    "full_bytes_per_position",
]
