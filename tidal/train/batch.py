"""Turn scored groups into a padded TrainBatch with per-token advantages."""

from __future__ import annotations

import torch

from tidal.algo import ADVANTAGES, advantage_metrics, bind
from tidal.algo.config import AlgoConfig
from tidal.types import Group, TrainBatch


def build_train_batch(groups: list[Group], cfg: AlgoConfig, pad_id: int) -> tuple[TrainBatch | None, dict[str, float]]:
    """Compute advantages per group and lay the sequences out as [B, T] (right-padded).

    Groups need the same number of samples. With ``skip_zero_adv_groups`` (DAPO dynamic sampling's
    filter), groups whose samples all got the same reward carry no signal and are left out; if none
    remain the batch is None. Metrics report rewards before filtering.
    """
    sizes = {len(g.trajectories) for g in groups}
    assert len(sizes) == 1, f"all groups need the same number of samples, got sizes {sorted(sizes)}"
    rewards_gn = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    group_ids_b = torch.arange(len(groups)).repeat_interleave(rewards_gn.shape[1])
    adv_b = bind(ADVANTAGES[cfg.advantage], cfg)(rewards_gn.flatten(), group_ids_b)
    adv_gn, metrics = adv_b.view_as(rewards_gn), advantage_metrics(adv_b)
    informative = rewards_gn.std(dim=1) > 0 if rewards_gn.shape[1] > 1 else torch.ones(len(groups), dtype=torch.bool)
    keep = informative.nonzero().flatten().tolist() if cfg.skip_zero_adv_groups else list(range(len(groups)))
    metrics["algo/zero_adv_groups"] = float(len(groups) - int(informative.sum()))
    if not keep:
        return None, metrics

    rows = [(gi, t, adv_gn[gi, j].item()) for gi in keep for j, t in enumerate(groups[gi].trajectories)]
    width = max(len(t.prompt_ids) + len(t.token_ids) for _, t, _ in rows)
    b = len(rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width))
    behav = torch.zeros((b, width))
    adv = torch.zeros((b, width))
    versions = torch.full((b, width), -1, dtype=torch.long)
    for r, (_, t, a) in enumerate(rows):
        p, n = len(t.prompt_ids), len(t.token_ids)
        input_ids[r, : p + n] = torch.tensor(t.prompt_ids + t.token_ids)
        attn[r, : p + n] = 1
        loss_mask[r, p : p + n] = 1.0
        behav[r, p : p + n] = torch.tensor(t.logprobs)
        adv[r, p : p + n] = a
        versions[r, p : p + n] = torch.tensor(t.versions)
    batch = TrainBatch(input_ids, attn, loss_mask, behav, adv, versions, torch.tensor([gi for gi, _, _ in rows]))
    return batch, metrics
