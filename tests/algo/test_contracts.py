"""The contract every registered policy loss keeps, whatever its math."""

import pytest
import torch

from tidal.algo import LOSS_AGGREGATIONS, POLICY_LOSSES, AlgoConfig, bind

B, T = 4, 5


def _inputs(seed: int, extreme: bool = False):
    torch.manual_seed(seed)
    logp = (-torch.rand(B, T) * 3).requires_grad_(True)
    old = logp.detach() + (
        torch.tensor([20.0, -20.0]).repeat(B * T // 2) if extreme else 0.3 * torch.randn(B * T)
    ).view(B, T)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.float32)
    return logp, old, mask


def _check(loss, metrics, logp, mask, expect_grad=True):
    assert loss.dim() == 0 and torch.isfinite(loss), f"loss {loss}"
    # a float, or a 0-dim tensor without a graph that the trainer reads once per step (issue 51)
    assert metrics and all(isinstance(k, str) and (type(v) is float or isinstance(v, torch.Tensor) and v.dim() == 0
                                                   and not v.requires_grad) for k, v in metrics.items()), metrics
    assert all(v == v for v in metrics.values()), f"NaN metric in {metrics}"
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[mask == 0], torch.zeros(int((mask == 0).sum()))), "masked tokens got gradient"
    if expect_grad:  # (with extreme ratios everything may be clipped)
        assert grad[mask == 1].abs().sum() > 0, "no gradient at all"


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("adv_shape", ["b", "bt"])
def test_loss_contract(name, agg, adv_shape):
    logp, old, mask = _inputs(0)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.3])
    if adv_shape == "bt":
        adv = adv.unsqueeze(-1) + 0.1 * torch.randn(B, T)
    loss, metrics = POLICY_LOSSES[name](logp, old, adv, mask, agg=agg, group_ids_b=torch.tensor([0, 0, 1, 1]))
    _check(loss, metrics, logp, mask)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_loss_contract_with_is_weight_and_extreme_ratios(name):
    logp, old, mask = _inputs(1, extreme=True)
    is_weight = torch.rand(B, T) + 0.5
    for adv in (torch.tensor([1.0, -1.0, 2.0, -2.0]), -torch.ones(B)):
        loss, metrics = POLICY_LOSSES[name](logp, old, adv, mask, is_weight_bt=is_weight)
        _check(loss, metrics, logp, mask, expect_grad=False)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_loss_signature_is_uniform(name):
    """Positional (logp, old_logp, adv, mask); every knob keyword-only; each takes the shared keywords."""
    import inspect

    params = inspect.signature(POLICY_LOSSES[name]).parameters
    assert list(params)[:4] == ["logp_bt", "old_logp_bt", "adv", "mask_bt"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(params.values())[4:])
    assert {"is_weight_bt", "agg", "group_ids_b", "max_gen_len", "agg_weights_bt"} <= set(params)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_every_loss_runs_from_a_default_config(name):
    logp, old, mask = _inputs(2)
    cfg = AlgoConfig(policy_loss=name)
    loss, metrics = bind(POLICY_LOSSES[cfg.policy_loss], cfg, group_ids_b=torch.arange(B))(
        logp, old, torch.ones(B), mask
    )
    _check(loss, metrics, logp, mask)
