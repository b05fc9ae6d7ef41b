"""Turn scored groups into a right-padded TrainBatch (advantages are the trainer's job).

A vision-language policy's batch also carries its prompts' images (``TrainBatch.images``, built by
``train/vision.py`` when ``build_train_batch`` is given the policy's processor): each distinct image once, and
per token its image feature and M-RoPE position. Without a processor nothing about images is looked at."""

from __future__ import annotations

import torch

from tidal.algo.config import AlgoConfig
from tidal.algo.filters import informative as rewards_informative
from tidal.models.moe import NO_ROUTE
from tidal.train.vision import batch_images
from tidal.types import Group, TrainBatch


def build_train_batch(groups: list[Group], cfg: AlgoConfig, pad_id: int,
                      processor=None) -> tuple[TrainBatch | None, dict[str, float]]:
    """Lay the groups' sequences out as [B, T], right-padded.

    With ``skip_zero_adv_groups``, groups whose samples all got the same reward (no advantage, no
    gradient; DAPO's dynamic-sampling filter) are left out; if none remain the batch is None. With
    ``overlong_filter`` (DAPO, arXiv 2503.14476, sec. 3.4), truncated samples keep their place in
    the group's baseline but contribute no loss. Groups may differ in size. ``processor``: a vision-language
    policy's (``models/vlm.py``); the prompts' images (``Prompt.images``) then go into ``TrainBatch.images``.
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
    # Rows are built as lists and turned into tensors once: per-row tensor writes cost more than the
    # trainer's forward on the tiny model (profiled with py-spy).
    input_ids, attn, loss_mask, behav, versions = [], [], [], [], []
    scored = [t.teacher_logprobs is not None for t in trajs]
    assert all(scored) or not any(scored), "a batch mixes samples a teacher scored with samples it did not"
    teacher = [] if all(scored) else None
    for t in trajs:
        p, n = len(t.prompt_ids), len(t.token_ids)
        pad = width - p - n
        input_ids.append([*t.prompt_ids, *t.token_ids] + [pad_id] * pad)
        attn.append([1] * (p + n) + [0] * pad)
        if cfg.overlong_filter and t.finish_reason == "length":
            trained = [0.0] * n
        else:  # an agent episode's observation tokens (mask 0) are context, never trained on
            trained = [1.0] * n if t.loss_mask is None else [float(m) for m in t.loss_mask]
        loss_mask.append([0.0] * p + trained + [0.0] * pad)
        behav.append([0.0] * p + list(t.logprobs) + [0.0] * pad)
        versions.append([-1] * p + list(t.versions) + [-1] * pad)
        if teacher is not None:
            teacher.append([0.0] * p + list(t.teacher_logprobs) + [0.0] * pad)
    input_ids, attn = torch.tensor(input_ids, dtype=torch.long), torch.tensor(attn, dtype=torch.long)
    loss_mask, behav = torch.tensor(loss_mask), torch.tensor(behav)
    versions = torch.tensor(versions, dtype=torch.long)
    group_index = torch.tensor([gi for gi in keep for _ in groups[gi].trajectories])
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    teacher_bt = torch.tensor(teacher) if teacher is not None else None
    images = None
    if processor is not None:
        rows = [(groups[gi].prompt, t) for gi in keep for t in groups[gi].trajectories]
        images = batch_images(rows, width, processor)
    return TrainBatch(input_ids, attn, loss_mask, behav, versions, group_index, rewards, teacher_bt,
                      routes_btlk=batch_routes(trajs, width), images=images), metrics


def batch_routes(trajs: list, width: int) -> torch.Tensor | None:
    """The samples' recorded expert choices (``Trajectory.routes``) as uint8 [B, width, layers, k], right-padded
    with ``NO_ROUTE``, as are samples without routes (a demonstration); None when no sample has any."""
    recorded = [t.routes for t in trajs if t.routes is not None]
    if not recorded:
        return None
    out = torch.full((len(trajs), width, *recorded[0].shape[1:]), NO_ROUTE, dtype=torch.uint8)
    for i, t in enumerate(trajs):
        if t.routes is not None:
            out[i, : len(t.routes)] = t.routes
    return out
