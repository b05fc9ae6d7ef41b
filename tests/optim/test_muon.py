"""Muon against a Newton-Schulz reference written here, torch.optim.Muon, and the RMS-matching invariant."""

import math

import pytest
import torch

from tidal.optim import Muon, newton_schulz

A, B, C = 3.4445, -4.7750, 2.0315  # Keller Jordan's quintic


def orthogonalize_reference(m, steps=5):
    """Quintic Newton-Schulz in float64, written on whichever side keeps the Gram matrix small:
    X <- a X + b (X X^T) X + c (X X^T)^2 X for wide X, and the same with X (X^T X) for tall X."""
    x = m.double() / m.double().norm()
    for _ in range(steps):
        if x.shape[0] <= x.shape[1]:
            gram = x @ x.T
            x = A * x + B * gram @ x + C * gram @ gram @ x
        else:
            gram = x.T @ x
            x = A * x + B * x @ gram + C * x @ gram @ gram
    return x


def muon_reference(theta, grads, *, lr, momentum, wd, nesterov=True):
    """Moonlight's form: M <- mu M + g; Nesterov uses g + mu M;
    theta <- theta (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O."""
    theta, buf = theta.double().clone(), torch.zeros_like(theta, dtype=torch.float64)
    scale = 0.2 * math.sqrt(max(theta.shape))
    for g in grads:
        buf = momentum * buf + g
        update = g + momentum * buf if nesterov else buf
        theta = theta * (1 - lr * wd) - lr * scale * orthogonalize_reference(update)
    return theta


def _grads(shape, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(steps)]


def _run(opt_cls, theta0, grads, **kwargs):
    p = torch.nn.Parameter(theta0.clone())
    opt = opt_cls([p], **kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (24, 24)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_step_by_step_equals_the_reference(shape, nesterov):
    theta0, grads = torch.randn(*shape, generator=torch.Generator().manual_seed(7)), _grads(shape, 4, seed=1)
    kwargs = dict(lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
    for steps in (1, 4):
        got = _run(Muon, theta0, grads[:steps], **kwargs)
        want = muon_reference(theta0, grads[:steps], lr=0.02, momentum=0.95, wd=0.1, nesterov=nesterov)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)


def test_newton_schulz_on_the_short_side_equals_the_reference():
    m = torch.randn(40, 12, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(newton_schulz(m).double(), orthogonalize_reference(m), rtol=0, atol=1e-5)
    singular_values = torch.linalg.svdvals(newton_schulz(m))
    assert singular_values.min() > 0.6 and singular_values.max() < 1.25, singular_values  # ~orthogonal


def test_bfloat16_path_is_torch_optim_muon_and_float32_stays_within_bf16_noise():
    theta0, grads = torch.randn(32, 64, generator=torch.Generator().manual_seed(5)), _grads((32, 64), 3, seed=2)
    kwargs = dict(lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    torch_muon = _run(torch.optim.Muon, theta0, grads, **kwargs)
    assert torch.equal(_run(Muon, theta0, grads, ns_dtype=torch.bfloat16, **kwargs), torch_muon)
    # bfloat16 keeps ~3 significant digits: the float32 path's update differs from torch's by a few percent.
    moved = (torch_muon - theta0 * (1 - 0.01 * 0.1) ** 3).norm()
    assert (_run(Muon, theta0, grads, **kwargs) - torch_muon).norm() < 0.05 * moved


@pytest.mark.parametrize("shape", [(128, 128), (512, 128), (128, 512)])
def test_rms_matching_gives_adamw_sized_updates(shape):
    """Moonlight's scale makes the update RMS ~0.2 lr whatever the matrix shape (an orthogonal A x B matrix
    has RMS 1/sqrt(max(A, B)); Newton-Schulz's singular values are ~0.7-1.2, not exactly 1)."""
    theta0, grads = torch.zeros(*shape), _grads(shape, 1, seed=4)
    step = _run(Muon, theta0, grads, lr=1.0, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    rms = step.pow(2).mean().sqrt().item()
    assert 0.14 < rms < 0.26, rms
