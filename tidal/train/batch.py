"""Turn scored groups into a right-padded TrainBatch (advantages are the trainer's job)."""

from __future__ import annotations

import torch

from tidal.algo.config import AlgoConfig
from tidal.algo.filters import informative as rewards_informative
from tidal.types import Group, TrainBatch


def build_train_batch(groups: list[Group], cfg: AlgoConfig, pad_id: int) -> tuple[TrainBatch | None, dict[str, float]]:
    """Lay the groups' sequences out as [B, T], right-padded.

    With ``skip_zero_adv_groups``, groups whose samples all got the same reward (no advantage, no
    gradient; DAPO's dynamic-sampling filter) are left out; if none remain the batch is None. With
    ``overlong_filter`` (DAPO, arXiv 2503.14476, sec. 3.4), truncated samples keep their place in
    the group's baseline but contribute no loss. Groups may differ in size.
    """
    informative = [rewards_informative(g.rewards) for g in groups]
    keep = [gi for gi, ok in enumerate(informative) if ok or not cfg.skip_zero_adv_groups]
    trajs = [t for gi in keep for t in groups[gi].trajectories]
    metrics = {"algo/zero_adv_groups": float(len(groups) - sum(informative))}
    if cfg.overlong_filter:
        metrics["algo/overlong_filtered"] = float(sum(t.finish_reason == "length" for t in trajs))
    if not keep:
        return None, metrics

    width = max(len(t.prompt_ids) + len(t.token_ids) for t in trajs)
    b = len(trajs)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width))
    behav = torch.zeros((b, width))
    versions = torch.full((b, width), -1, dtype=torch.long)
    for r, t in enumerate(trajs):
        p, n = len(t.prompt_ids), len(t.token_ids)
        input_ids[r, : p + n] = torch.tensor(t.prompt_ids + t.token_ids)
        attn[r, : p + n] = 1
        if not (cfg.overlong_filter and t.finish_reason == "length"):
            # an agent episode's observation tokens (mask 0) are context, never trained on
            loss_mask[r, p : p + n] = 1.0 if t.loss_mask is None else torch.tensor(t.loss_mask, dtype=torch.float32)
        behav[r, p : p + n] = torch.tensor(t.logprobs)
        versions[r, p : p + n] = torch.tensor(t.versions)
    group_index = torch.tensor([gi for gi in keep for _ in groups[gi].trajectories])
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    return TrainBatch(input_ids, attn, loss_mask, behav, versions, group_index, rewards), metrics
