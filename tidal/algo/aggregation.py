"""How a per-token loss [B, T] becomes one scalar: every aggregation is a weighted token sum.

    loss = sum_{b,t} loss_bt * w_bt,   w_bt = mask_bt * c_b / D

with a per-sequence coefficient c_b and a batch constant D:

| name                      | c_b                    | D                        | source                          |
|---------------------------|------------------------|--------------------------|---------------------------------|
| ``token_mean``            | 1                      | response tokens          | DAPO, arXiv 2503.14476 sec. 3.3 |
| ``seq_mean_token_mean``   | 1 / |o_b|              | sequences                | GRPO, arXiv 2402.03300 eq. 3    |
| ``seq_mean_token_sum``    | 1                      | sequences                | (verl ``seq-mean-token-sum``)   |
| ``seq_mean_token_sum_norm``| 1 / max_gen_len       | sequences                | Dr. GRPO, arXiv 2503.20783 3.2  |
| ``group_length``          | 1 / sum_{i in g} |o_i| | groups                   | Magistral, arXiv 2506.10910 2.1 |

Magistral normalizes each group by the total length of its generations, 1 / sum_i |o_i| times the
sum of all the group's token losses, and takes the expectation over prompts, i.e. the mean over
groups. Sequences (groups) with no response token count for nothing, in D too.

Split across minibatches / gradient accumulation: compute ``aggregation_weights`` once on the full
batch's mask and pass each minibatch its rows as ``weights_bt=`` (losses: ``agg_weights_bt=``).
The minibatch losses then sum exactly to the full-batch loss, whatever the aggregation, because
D and the group lengths come from the full batch.
"""

from __future__ import annotations

import torch

from tidal.algo import LOSS_AGGREGATIONS
from tidal.algo.config import bind


def zero_outside(x: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """``x`` on response tokens (mask > 0), exactly 0 elsewhere, in value and in gradient.

    Padding may hold anything: a log-prob is legally -inf there, and -inf - -inf is NaN. A product
    ``x * mask`` keeps 0 * inf = NaN, which poisons every sum over the row and, through the chain rule,
    the gradient of the inputs; a selection does not. Every masked input of ``tidal.algo`` goes through
    this (or an equivalent ``torch.where``) before any arithmetic. Tensors that do not have the mask's
    shape (a per-sequence [B] advantage) and None pass through unchanged."""
    if x is None or x.shape != mask_bt.shape:
        return x
    return torch.where(mask_bt > 0, x, torch.zeros_like(x))


def masked_mean(x_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is non-zero, weighted by the mask (0 when the mask
    is empty); whatever ``x`` holds elsewhere, even inf or NaN, is ignored."""
    return (zero_outside(x_bt, mask_bt) * mask_bt).sum() / mask_bt.sum().clamp(min=1)


def _per_sequence(mask_bt: torch.Tensor, c_b: torch.Tensor) -> torch.Tensor:
    """w_bt = mask * c_b / (number of sequences with at least one token)."""
    has_tokens_b = mask_bt.sum(-1) > 0
    return mask_bt * (c_b / has_tokens_b.sum().clamp(min=1)).unsqueeze(-1)


@LOSS_AGGREGATIONS.register("token_mean")
def token_mean(mask_bt: torch.Tensor) -> torch.Tensor:
    """DAPO token-level loss (sec. 3.3): every response token in the batch weighs the same, so long
    responses are not down-weighted per token."""
    return mask_bt / mask_bt.sum().clamp(min=1)


@LOSS_AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(mask_bt: torch.Tensor) -> torch.Tensor:
    """GRPO's (eq. 3): mean over each sequence's tokens, then mean over sequences."""
    return _per_sequence(mask_bt, 1.0 / mask_bt.sum(-1).clamp(min=1))


@LOSS_AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(mask_bt: torch.Tensor) -> torch.Tensor:
    """Sum over each sequence's tokens, mean over sequences (long sequences weigh more)."""
    return _per_sequence(mask_bt, mask_bt.new_ones(mask_bt.shape[0]))


@LOSS_AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(mask_bt: torch.Tensor, *, max_gen_len: int | None = None) -> torch.Tensor:
    """Dr. GRPO (sec. 3.2): each sequence's token sum divided by a constant (the generation budget)
    instead of its own length, then the mean over sequences. Without ``max_gen_len`` the padded
    width T stands in, as in verl; pass the constant to keep the scale fixed across batches."""
    norm = float(max_gen_len if max_gen_len is not None else mask_bt.shape[-1])
    assert norm > 0, f"max_gen_len must be positive, got {max_gen_len}"
    return _per_sequence(mask_bt, mask_bt.new_full((mask_bt.shape[0],), 1.0 / norm))


@LOSS_AGGREGATIONS.register("group_length")
def group_length(mask_bt: torch.Tensor, *, group_ids_b: torch.Tensor | None = None) -> torch.Tensor:
    """Magistral (sec. 2.1): each group's token-loss sum divided by the total length of the group's
    generations, then the mean over groups."""
    assert group_ids_b is not None, "the group_length aggregation needs group_ids_b (which prompt each row answers)"
    _, inverse_b = torch.unique(torch.as_tensor(group_ids_b), return_inverse=True)
    inverse_b = inverse_b.to(mask_bt.device)
    num_groups = int(inverse_b.max().item()) + 1 if inverse_b.numel() else 0
    group_tokens_g = torch.zeros(num_groups, dtype=mask_bt.dtype, device=mask_bt.device)
    group_tokens_g.index_add_(0, inverse_b, mask_bt.sum(-1))
    num_nonempty = (group_tokens_g > 0).sum().clamp(min=1)
    c_b = 1.0 / (group_tokens_g[inverse_b].clamp(min=1) * num_nonempty)
    return mask_bt * c_b.unsqueeze(-1)


def aggregation_weights(
    mask_bt: torch.Tensor,
    *,
    agg: str = "token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
) -> torch.Tensor:
    """Per-token weights w_bt with ``aggregate(loss_bt, ...) == (loss_bt * w_bt).sum()``.

    Compute them on the full batch and slice rows per minibatch to split one loss exactly."""
    mask_bt = mask_bt if mask_bt.is_floating_point() else mask_bt.to(torch.get_default_dtype())
    return bind(LOSS_AGGREGATIONS[agg], group_ids_b=group_ids_b, max_gen_len=max_gen_len)(mask_bt)


def aggregate(
    loss_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    agg: str = "token_mean",
    group_ids_b: torch.Tensor | None = None,
    max_gen_len: int | None = None,
    weights_bt: torch.Tensor | None = None,
) -> torch.Tensor:
    """One scalar from a per-token loss. ``weights_bt`` (from ``aggregation_weights`` on the full
    batch, this minibatch's rows) overrides ``agg``: then minibatch losses sum to the full loss.

    Masked positions contribute exactly nothing, value or gradient, even if ``loss_bt`` is not finite
    there."""
    if weights_bt is None:
        weights_bt = aggregation_weights(mask_bt, agg=agg, group_ids_b=group_ids_b, max_gen_len=max_gen_len)
    assert weights_bt.shape == loss_bt.shape, f"weights {tuple(weights_bt.shape)} vs loss {tuple(loss_bt.shape)}"
    keep_bt = (mask_bt > 0) & (weights_bt != 0)
    return (torch.where(keep_bt, loss_bt, torch.zeros_like(loss_bt)) * weights_bt).sum()
