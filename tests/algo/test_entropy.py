"""The entropy bonus and high-entropy token masking ("Beyond the 80/20 Rule"), by hand; the mask composes
with every policy loss."""

import pytest
import torch

from tidal.algo import POLICY_LOSSES, aggregation_weights, entropy_loss, high_entropy_mask

t = torch.tensor


def test_entropy_loss_is_minus_coef_times_the_aggregated_entropy():
    entropy = t([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], requires_grad=True)
    mask = t([[1.0, 1, 1], [1, 0, 0]])
    # token mean (1 + 2 + 3 + 4) / 4 = 2.5 -> -0.1 * 2.5; gradient -0.1 / 4 per response token, 0 when masked
    loss, m = entropy_loss(entropy, mask, entropy_coef=0.1)
    assert loss.item() == pytest.approx(-0.25) and m["algo/entropy_bonus"] == pytest.approx(0.25)
    assert torch.autograd.grad(loss, entropy)[0].flatten().tolist() == pytest.approx([-0.025] * 4 + [0.0, 0.0])
    # sequence mean of token means (2 + 4) / 2 = 3 -> -0.3; gradients -0.1 / (3 * 2) and -0.1 / 2
    loss, _ = entropy_loss(entropy, mask, entropy_coef=0.1, agg="seq_mean_token_mean")
    assert loss.item() == pytest.approx(-0.3)
    assert torch.autograd.grad(loss, entropy)[0].flatten().tolist() == pytest.approx(
        [-0.1 / 6] * 3 + [-0.05, 0.0, 0.0])
    with pytest.raises(ValueError, match="entropy_coef"):
        entropy_loss(entropy, mask, entropy_coef=-0.1)


ENTROPY = t([[0.1, 0.9, 0.5, 0.3, 99.0], [0.7, 0.2, 0.0, 0.0, 0.0]])
MASK = t([[1.0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])  # 6 response tokens; the masked 99 never counts


@pytest.mark.parametrize(("frac", "kept"), [
    (0.5, [[0, 1, 1, 0, 0], [1, 0, 0, 0, 0]]),  # k = 3: 0.9, 0.7, 0.5
    (0.2, [[0, 1, 0, 0, 0], [1, 0, 0, 0, 0]]),  # k = ceil(1.2) = 2: 0.9, 0.7
    (1.0, MASK.tolist()),  # every response token
])
def test_high_entropy_mask_keeps_the_top_fraction(frac, kept):
    keep, m = high_entropy_mask(ENTROPY, MASK, top_entropy_frac=frac)
    assert keep.tolist() == kept
    assert m["algo/entropy_kept_frac"] == pytest.approx(sum(map(sum, kept)) / 6)


def test_high_entropy_mask_threshold_ties_and_float_noise():
    # ties with the k-th largest are all kept: k = 1 of 4, three tokens share the top entropy
    keep, m = high_entropy_mask(t([[1.0, 1.0, 1.0, 0.5]]), torch.ones(1, 4), top_entropy_frac=0.25)
    assert keep.tolist() == [[1, 1, 1, 0]] and m["algo/entropy_threshold"] == 1.0
    # 0.3 * 10 is 3.0000000000000004 in floats: still the top 3, not 4
    keep, _ = high_entropy_mask(torch.arange(10.0)[None], torch.ones(1, 10), top_entropy_frac=0.3)
    assert keep.tolist() == [[0] * 7 + [1] * 3]
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="top_entropy_frac"):
            high_entropy_mask(ENTROPY, MASK, top_entropy_frac=bad)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_the_mask_composes_with_every_loss(name):
    """Weighting the aggregation by the mask (as the trainer does) removes the dropped tokens' gradient and
    leaves every kept token's gradient as it was: each token's term depends on its own log-prob only."""
    torch.manual_seed(0)
    logp = (-torch.rand(3, 5) * 3).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(3, 5)
    adv, mask = t([1.0, -0.5, 2.0]), t([[1.0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    keep, _ = high_entropy_mask(torch.rand(3, 5), mask, top_entropy_frac=0.5)
    weights = aggregation_weights(mask, agg="token_mean")
    grads = []
    for w in (weights, weights * keep):
        torch.manual_seed(1)  # the same draw for clip_cov
        loss, _ = POLICY_LOSSES[name](logp, old, adv, mask, agg_weights_bt=w)
        grads.append(torch.autograd.grad(loss, logp)[0])
    assert 0 < keep.sum() < mask.sum()
    assert torch.allclose(grads[1], grads[0] * keep, atol=1e-7)
