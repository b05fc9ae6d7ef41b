"""Distillation losses against hand-computed references (tidal/algo/distill.py).

The running example: a 3-token vocabulary, teacher p = [0.5, 0.3, 0.2], student q = [0.25, 0.25, 0.5].
"""

import math

import pytest
import torch

from tidal.algo.distill import (
    bytes_per_position,
    distill_advantage,
    full_bytes_per_position,
    full_forward_kl,
    reverse_kl_per_token,
    sparse_forward_kl,
    sparse_information_loss,
    student_tail_logmass,
    topk_sparsify,
)

P = torch.tensor([[0.5, 0.3, 0.2]]).log()
Q = torch.tensor([[0.25, 0.25, 0.5]]).log()
FULL = 0.5 * math.log(2) + 0.3 * math.log(0.3 / 0.25) + 0.2 * math.log(0.2 / 0.5)  # 0.218013


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                          atol=tol), (a, b)


def test_full_forward_kl_hand_computed():
    close(full_forward_kl(Q, P), [FULL])
    close(FULL, 0.218013, 1e-6)
    close(full_forward_kl(P, P), [0.0])


def test_topk_sparsify_keeps_the_largest_and_the_residual():
    ids, logp, r = topk_sparsify(P, 2)
    assert ids.tolist() == [[0, 1]]
    close(logp.exp(), [[0.5, 0.3]])
    close(r, [0.2])
    with pytest.raises(AssertionError, match="k <= vocab"):
        topk_sparsify(P, 4)


def test_sparse_tail_bucket_hand_computed():
    # k = 1: outcomes {token 0, other}: p = (0.5, 0.5), q = (0.25, 0.75)
    close(sparse_forward_kl(Q, *topk_sparsify(P, 1)), [0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75)])
    close(sparse_forward_kl(Q, *topk_sparsify(P, 1)), [0.143841])
    # k = V - 1: the tail is one token, so the bucket is exact
    close(sparse_forward_kl(Q, *topk_sparsify(P, 2)), [FULL])
    close(sparse_forward_kl(Q, *topk_sparsify(P, 3)), [FULL])


def test_sparse_renormalize_hand_computed():
    close(sparse_forward_kl(Q, *topk_sparsify(P, 1), residual="renormalize"), [-math.log(0.25)])
    expect = 0.625 * math.log(0.625 / 0.25) + 0.375 * math.log(0.375 / 0.25)  # p' = (0.625, 0.375)
    close(sparse_forward_kl(Q, *topk_sparsify(P, 2), residual="renormalize"), [expect])
    close(expect, 0.724732, 1e-6)
    with pytest.raises(ValueError, match="tail_bucket"):
        sparse_forward_kl(Q, *topk_sparsify(P, 2), residual="drop")


def test_sparse_uniform_tail_hand_computed():
    # k = 1: the teacher read as (0.5, 0.25, 0.25); student (0.25, 0.25, 0.5)
    expect = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.25) + 0.25 * math.log(0.25 / 0.5)
    close(sparse_forward_kl(Q, *topk_sparsify(P, 1), residual="uniform_tail"), [expect])
    close(expect, 0.173287, 1e-6)
    # k = V - 1 (one tail token: uniform is exact) and k = V: the full KL
    close(sparse_forward_kl(Q, *topk_sparsify(P, 2), residual="uniform_tail"), [FULL])
    close(sparse_forward_kl(Q, *topk_sparsify(P, 3), residual="uniform_tail"), [FULL])
    # a teacher whose tail is flat: the uniform reading is the teacher, so the loss is the full KL at any k
    flat = torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.1]]).log()
    student = torch.tensor([[0.3, 0.4, 0.1, 0.1, 0.1]]).log()
    close(sparse_forward_kl(student, *topk_sparsify(flat, 1), residual="uniform_tail"),
          full_forward_kl(student, flat))


def test_uniform_tail_gradient_pulls_the_student_tail_flat():
    teacher = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).log()
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], requires_grad=True)  # a skewed tail
    sparse_forward_kl(logits.log_softmax(-1), *topk_sparsify(teacher, 1), residual="uniform_tail").sum().backward()
    grad = logits.grad[0, 1:]
    assert grad[0] > 0 > grad[2]  # down where the tail is above flat, up where below
    logits.grad = None
    sparse_forward_kl(logits.log_softmax(-1), *topk_sparsify(teacher, 1)).sum().backward()  # tail bucket
    g = logits.grad[0, 1:]
    assert torch.allclose(g / g.sum(), logits.detach()[0, 1:].softmax(-1), atol=1e-6)  # shape-preserving


def test_tail_bucket_is_a_lower_bound_of_full_kl_and_tightens_with_k():
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(64, 51, generator=gen).mul(3).log_softmax(-1)
    student = torch.randn(64, 51, generator=gen).mul(3).log_softmax(-1)
    full = full_forward_kl(student, teacher)
    prev = torch.zeros_like(full)
    for k in (1, 8, 32, 51):
        sparse = sparse_forward_kl(student, *topk_sparsify(teacher, k))
        assert (sparse <= full + 1e-5).all(), k  # data-processing inequality: coarse-graining loses KL
        assert (sparse >= prev - 1e-5).all(), k  # refining the partition never lowers it
        prev = sparse
    close(prev, full, 1e-4)


def test_sparse_gradient_vanishes_at_the_teacher_and_matches_full_kl_when_k_is_v():
    teacher = torch.randn(4, 7, generator=torch.Generator().manual_seed(1)).log_softmax(-1)
    logits = teacher.clone().requires_grad_(True)
    sparse_forward_kl(logits.log_softmax(-1), *topk_sparsify(teacher, 3)).sum().backward()
    close(logits.grad, torch.zeros_like(teacher), 1e-6)
    student = torch.randn(4, 7, generator=torch.Generator().manual_seed(2), requires_grad=True)
    g_sparse, = torch.autograd.grad(sparse_forward_kl(student.log_softmax(-1), *topk_sparsify(teacher, 7)).sum(),
                                    student)
    g_full, = torch.autograd.grad(full_forward_kl(student.log_softmax(-1), teacher).sum(), student)
    close(g_sparse, g_full, 1e-5)
    close(g_full, student.softmax(-1) - teacher.exp(), 1e-5)  # d KL / d logits = q - p


def test_information_loss_hand_computed():
    # k = 1: p~ = (0.5, 0.25, 0.25); KL(p || p~) = 0.3 ln(0.3/0.25) + 0.2 ln(0.2/0.25)
    close(sparse_information_loss(P, 1), [0.3 * math.log(0.3 / 0.25) + 0.2 * math.log(0.2 / 0.25)])
    close(sparse_information_loss(P, 2), [0.0])  # one tail token: spreading its mass is exact
    close(sparse_information_loss(P, 3), [0.0])


def test_reverse_kl_and_distill_advantage_hand_computed():
    behav = torch.tensor([[-1.0, -2.0, 0.0]])
    teacher = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    close(reverse_kl_per_token(behav, teacher), [[0.5, -1.0, 9.0]])
    close(distill_advantage(torch.tensor([2.0]), teacher, behav, mask), [[-0.5, 1.0, 0.0]])
    close(distill_advantage(torch.tensor([2.0]), teacher, behav, mask, distill_reward_coef=0.5), [[0.5, 2.0, 0.0]])
    adv_bt = torch.tensor([[1.0, 3.0, 5.0]])
    close(distill_advantage(adv_bt, teacher, behav, mask, distill_kl_coef=2.0, distill_reward_coef=1.0),
          [[0.0, 5.0, 0.0]])


def test_reverse_kl_mean_over_samples_estimates_the_exact_reverse_kl():
    q = torch.tensor([0.7, 0.2, 0.1])
    p = torch.tensor([0.4, 0.4, 0.2])
    exact = (q * (q.log() - p.log())).sum()
    x = torch.multinomial(q, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    estimate = reverse_kl_per_token(q.log()[x], p.log()[x]).mean()
    close(estimate, exact, 5e-3)


def test_bytes_per_position():
    assert bytes_per_position(32, 51) == 32 * 4 + 4  # uint16 ids + fp16 log-probs + fp32 residual
    assert bytes_per_position(32, 151_936) == 32 * 6 + 4  # ids no longer fit uint16
    assert full_bytes_per_position(51) == 204


def test_residual_is_the_tail_sum_even_when_tiny():
    # tail of 3 tokens at 1e-9 each: 1 - (top-k sum) in float32 cancels to rounding error, the direct sum does not
    logp = torch.log(torch.tensor([[0.6, 0.4 - 3e-9, 1e-9, 1e-9, 1e-9]], dtype=torch.float64)).float()
    _, _, residual = topk_sparsify(logp, 2)
    assert residual.item() == pytest.approx(3e-9, rel=1e-5)
    assert topk_sparsify(logp, 5)[2].item() == 0.0  # k = V: nothing left over, exactly


def test_student_tail_mass_is_exact_where_one_minus_the_sum_cancels():
    probs = torch.tensor([[0.5, 0.5 - 2e-8, 1e-8, 1e-8]], dtype=torch.float64)
    logq = probs.log().float()
    ids = torch.tensor([[0, 1]])
    got = student_tail_logmass(logq, ids)
    assert got.item() == pytest.approx(math.log(2e-8), abs=1e-5)
    cancelled = 1.0 - logq.gather(-1, ids).exp().sum(-1)  # float32: 0 or a multiple of 6e-8, not 2e-8
    assert abs(cancelled.item() - 2e-8) > 1e-8
    assert student_tail_logmass(logq, torch.tensor([[0, 1, 2, 3]])).item() < -1e29  # nothing outside
