"""The reward model's loss: Bradley-Terry on (chosen, rejected) scalar rewards.

P(chosen > rejected) = sigmoid(r_c - r_r) (Bradley & Terry 1952; InstructGPT, Ouyang et al. 2022,
arXiv 2203.02155, eq. 1), so the loss is -log sigmoid(r_c - r_r - margin), averaged over pairs; an optional
``margin`` per pair is Llama 2's (Touvron et al. 2023, arXiv 2307.09288, eq. 2). ``center`` adds
c * mean((r_c + r_r)^2), which keeps rewards near zero (Eisenstein et al. 2023, arXiv 2312.09244, sec. 3;
TRL's ``center_rewards_coefficient``). Both default off, as in TRL's RewardTrainer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None,
                       center: float = 0.0) -> torch.Tensor:
    """Mean over pairs of -log sigmoid(r_c - r_r - margin), plus ``center`` * mean((r_c + r_r)^2)."""
    diff = r_chosen - r_rejected if margin is None else r_chosen - r_rejected - margin
    loss = -F.logsigmoid(diff).mean()
    if center:
        loss = loss + center * torch.mean((r_chosen + r_rejected) ** 2)
    return loss
