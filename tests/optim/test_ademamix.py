"""AdEMAMix against Algorithm 1 of the paper (arXiv 2409.03137), written out here in plain tensor math."""

import math

import torch

from tidal.optim import AdEMAMixConfig, OptimConfig, build_optimizer


def ademamix_reference(theta, grads, *, lr, beta1, beta2, beta3, alpha, eps, wd, warmup, coupled=False):
    """Algorithm 1, one line per line of the paper; ``warmup`` is T_alpha,beta3 (None: no schedulers).

    ``coupled=True`` is the variant the paper does not use (L2: the decay added to the gradient)."""
    theta = theta.clone()
    m1, m2, nu = torch.zeros_like(theta), torch.zeros_like(theta), torch.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        if coupled:
            g, wd_step = g + wd * theta, 0.0
        else:
            wd_step = wd
        if warmup is None:
            alpha_t, beta3_t = alpha, beta3
        else:  # f_alpha: linear in t; f_beta3: 1 / log(beta) linear in t (half-life linear), beta_start = beta1
            alpha_t = min(t * alpha / warmup, alpha)
            frac = t / warmup
            beta3_t = min(math.exp(math.log(beta1) * math.log(beta3)
                                   / ((1 - frac) * math.log(beta3) + frac * math.log(beta1))), beta3)
        m1 = beta1 * m1 + (1 - beta1) * g
        m2 = beta3_t * m2 + (1 - beta3_t) * g
        nu = beta2 * nu + (1 - beta2) * g * g
        m1_hat, nu_hat = m1 / (1 - beta1**t), nu / (1 - beta2**t)
        theta = theta - lr * ((m1_hat + alpha_t * m2) / (nu_hat.sqrt() + eps) + wd_step * theta)
    return theta


def _run(cfg: OptimConfig, theta0, grads):
    p = torch.nn.Parameter(theta0.clone())
    opt, _ = build_optimizer([p], cfg)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _problem(steps=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    theta0 = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    # A drifting mean plus noise, so the slow and fast EMAs differ.
    grads = [0.3 * torch.randn(6, 5, generator=gen, dtype=torch.float64) + 0.1 * k for k in range(steps)]
    return theta0, grads


def test_matches_algorithm_1_with_weight_decay_and_schedulers_mid_way():
    theta0, grads = _problem(steps=8)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, beta3=0.99, alpha=5.0, eps=1e-8, wd=0.1)
    cfg = OptimConfig(name="ademamix", lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                      weight_decay=hp["wd"], ademamix=AdEMAMixConfig(alpha=hp["alpha"], beta3=hp["beta3"],
                                                                     warmup_steps=5))
    for steps in (3, 8):  # inside the warm-up, and past its end
        want = ademamix_reference(theta0, grads[:steps], warmup=5, **hp)
        torch.testing.assert_close(_run(cfg, theta0, grads[:steps]), want, rtol=1e-12, atol=1e-12)
    # The comparison can tell: without the schedulers, or with coupled (L2) decay, the result differs.
    want = ademamix_reference(theta0, grads, warmup=5, **hp)
    assert (ademamix_reference(theta0, grads, warmup=None, **hp) - want).abs().max() > 1e-3
    assert (ademamix_reference(theta0, grads, warmup=5, coupled=True, **hp) - want).abs().max() > 1e-4


def test_without_schedulers_matches_algorithm_1():
    theta0, grads = _problem(steps=5, seed=1)
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.95, beta3=0.999, alpha=8.0, eps=1e-15, wd=0.01)
    cfg = OptimConfig(name="ademamix", lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                      weight_decay=hp["wd"], ademamix=AdEMAMixConfig(alpha=hp["alpha"], beta3=hp["beta3"]))
    torch.testing.assert_close(_run(cfg, theta0, grads), ademamix_reference(theta0, grads, warmup=None, **hp),
                               rtol=1e-12, atol=1e-12)


def test_alpha_zero_is_adamw():
    theta0, grads = _problem(steps=10, seed=2)
    common = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    adamw = _run(OptimConfig(name="adamw", **common), theta0, grads)
    ademamix = _run(OptimConfig(name="ademamix", ademamix=AdEMAMixConfig(alpha=0.0, warmup_steps=4), **common),
                    theta0, grads)
    # Equal up to float64 rounding (the two divide by the bias correction in a different order).
    torch.testing.assert_close(ademamix, adamw, rtol=1e-13, atol=1e-14)
    assert (adamw - theta0).abs().max() > 1e-2  # and both moved
