"""Preference losses as pure functions of sequence log-probabilities: one value per pair.

Inputs, per pair b: the policy's summed log-probabilities of the chosen and rejected completions
(``pc``, ``pr``), the reference's (``rc``, ``rr``; computed once before training, ``stages/dpo.py``), and
the completions' token counts (``nc``, ``nr``). With h = (pc - rc) - (pr - rr), the difference of the
implicit rewards' log-ratios:

- ``sigmoid`` (DPO; Rafailov et al. 2023, arXiv 2305.18290, eq. 7): -log sigmoid(beta h).
- ``hinge`` (SLiC-HF; Zhao et al. 2023, arXiv 2305.10425, eq. 1 with delta = 1/beta, as TRL writes it):
  max(0, 1 - beta h).
- ``ipo`` (IPO; Azar et al. 2023, arXiv 2310.12036, eq. 17): (h' - 1/(2 beta))^2, where h' uses the
  log-ratios averaged over each completion's tokens, the normalization TRL confirmed with the IPO
  authors (``dpo_trainer.py``): (pc - rc)/nc - (pr - rr)/nr.
- ``simpo`` (SimPO; Meng et al. 2024, arXiv 2405.14734, eq. 6): reference-free,
  -log sigmoid(beta (pc/nc - pr/nr) - gamma); the paper's beta 2.0-2.5 and gamma/beta 0.5 (sec. 4).

Every loss is ``fn(pc, pr, rc, rr, nc, nr, beta, gamma) -> [B]``; the stage averages over pairs (as TRL
does). ``tests/stages/test_dpo_losses.py`` checks each against hand-computed numbers and TRL 1.16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.registry import Registry

PREFERENCE_LOSSES: Registry = Registry("preference loss")
REFERENCE_FREE = {"simpo"}
"""Losses that never read the reference log-probs (the stage then computes none)."""


def log_ratio_margin(pc, pr, rc, rr):
    """h = (pc - rc) - (pr - rr): how much more the policy prefers chosen than the reference does."""
    return (pc - rc) - (pr - rr)


@PREFERENCE_LOSSES.register("sigmoid")
def sigmoid_loss(pc, pr, rc, rr, nc, nr, beta: float, gamma: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, eq. 7): the Bradley-Terry likelihood of the implicit rewards."""
    return -F.logsigmoid(beta * log_ratio_margin(pc, pr, rc, rr))


@PREFERENCE_LOSSES.register("hinge")
def hinge_loss(pc, pr, rc, rr, nc, nr, beta: float, gamma: float = 0.0) -> torch.Tensor:
    """SLiC-HF's calibration hinge (Zhao et al. 2023) on the log-ratio margin."""
    return torch.relu(1 - beta * log_ratio_margin(pc, pr, rc, rr))


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(pc, pr, rc, rr, nc, nr, beta: float, gamma: float = 0.0) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17): regress the per-token margin to 1/(2 beta) (beta is their tau)."""
    margin = (pc - rc) / nc.clamp(min=1) - (pr - rr) / nr.clamp(min=1)
    return (margin - 1 / (2 * beta)) ** 2


@PREFERENCE_LOSSES.register("simpo")
def simpo_loss(pc, pr, rc, rr, nc, nr, beta: float, gamma: float = 0.0) -> torch.Tensor:
    """SimPO (Meng et al. 2024, eq. 6): length-normalized log-likelihood margin against a target gamma."""
    return -F.logsigmoid(beta * (pc / nc.clamp(min=1) - pr / nr.clamp(min=1)) - gamma)


def implicit_margin(loss_type: str, pc, pr, rc, rr, nc, nr) -> torch.Tensor:
    """The quantity whose sign says which completion the model prefers (preference accuracy): h for the
    reference-based losses, the length-normalized log-likelihood margin for SimPO."""
    if loss_type in REFERENCE_FREE:
        return pc / nc.clamp(min=1) - pr / nr.clamp(min=1)
    return log_ratio_margin(pc, pr, rc, rr)
