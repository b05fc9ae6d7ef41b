"""Optimizer settings: one ``OptimConfig`` for the run, with a section per optimizer that needs extra knobs.

The shared fields (``lr``, ``betas``, ``eps``, ``weight_decay``, ...) keep their names and defaults from
before optimizers were selectable, so a config that does not set ``name`` trains exactly as it did.
AdEMAMix reads ``betas`` as its (beta1, beta2) and Muon's AdamW half (embeddings, head, norms, biases) reads
``betas``/``eps`` too, so a recipe's AdamW settings carry over when the optimizer changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

RUN_LENGTH = "max_steps"
"""``optim.decay_steps``'s value for "decay until the run's last optimizer step" (``optim.for_run``)."""


@dataclass
class AdEMAMixConfig:
    """AdEMAMix (Pagliardini, Ablin & Grangier, arXiv 2409.03137): Adam plus a slow gradient EMA.

    Defaults follow the authors' reference README (github.com/apple/ml-ademamix): betas
    (0.9, 0.999, 0.9999), alpha 8, warm-ups equal to the run's number of iterations.
    """

    alpha: float = 8.0
    """Weight of the slow EMA in the numerator ``m1_hat + alpha * m2``. 8 in the authors' README example; the
    paper's runs use values of this order (alpha = 0 is exactly AdamW)."""
    beta3: float = 0.9999
    """Decay of the slow EMA (half-life ~6,900 steps). The authors' default; beta1 and beta2 come from
    ``optim.betas``."""
    warmup_steps: int | None = None
    """T_alpha,beta3 of Algorithm 1: alpha rises linearly from 0 and beta3 from beta1 (linearly in half-life)
    over this many optimizer steps. The paper "usually sets it to T", the total number of optimizer steps:
    set it to that (``max_steps`` x ``trainer.num_minibatches`` for RL). None: no warm-up (alpha and beta3
    at their final values from step 1; the un-bias-corrected slow EMA then still starts near zero)."""


@dataclass
class MuonConfig:
    """Muon (Jordan et al. 2024) with Moonlight's scaling (Liu et al., arXiv 2502.16982) for 2-D hidden weights.

    Everything else (embeddings, the LM head, norms, biases) is trained by AdamW with ``optim.betas``,
    ``optim.eps`` and ``optim.weight_decay``, as in Moonlight's reference training script.
    """

    momentum: float = 0.95
    """SGD-momentum coefficient before orthogonalization (Muon's and Moonlight's 0.95)."""
    nesterov: bool = True
    """Nesterov-style momentum (Muon's and Moonlight's default)."""
    ns_steps: int = 5
    """Newton-Schulz iterations; 5 with the quintic (3.4445, -4.7750, 2.0315) is Muon's default."""
    adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """``match_rms_adamw``: scale each matrix's orthogonalized update by 0.2 * sqrt(max(A, B)) so its RMS
    matches a typical AdamW update (~0.2 lr; Moonlight's "consistent update RMS"), which lets Muon reuse AdamW's
    lr and weight decay.
    ``original``: Keller Jordan's sqrt(max(1, A/B)); it needs a much larger ``lr`` (~0.02)."""
    lr: float | None = None
    """Learning rate for the Muon matrices; None uses ``optim.lr`` (right with ``match_rms_adamw``)."""


@dataclass
class OptimConfig:
    """The optimizer for RL and the stages (sft, dpo, rm: docs/stages.md); the supervised warm start keeps its own
    AdamW (``stages/warm_start.py``)."""

    name: str = "adamw"
    """One of ``OPTIMIZERS``: ``adamw``, ``ademamix``, ``muon`` (see docs/optimizers.md)."""
    lr: float = 2e-4
    """Peak learning rate. LLM recipes use ~1e-6 (DAPO); the 1M-parameter tiny model learns best near
    2e-4 (see the quickstart recipe)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW's (beta1, beta2). MiniMax-M1 (arXiv 2506.13585) uses (0.9, 0.95) for RL, a shorter
    second-moment memory (the ``cispo`` recipe sets it)."""
    eps: float = 1e-8
    """Added to sqrt(v_hat) in Adam's denominator. It is not only a divide-by-zero guard: a coordinate whose
    gradient RMS is far below eps moves by ~lr * g / eps instead of ~lr, so eps is a threshold under which
    updates are damped (a trust region on the step, in gradient units). MiniMax-M1 found most of its RL
    gradients far below the usual 1e-8 and set eps = 1e-15 (with beta2 0.95) so that they still train; keep
    eps well below your gradients' scale."""
    weight_decay: float = 0.0
    """Decoupled weight decay (Loshchilov & Hutter 2019), theta <- theta * (1 - lr * wd), for every
    optimizer here; DAPO/Magistral use 0.1 on large models."""
    grad_clip: float = 1.0
    """Global grad-norm clip (DAPO/verl default 1.0)."""
    adamw_kernel: Literal["auto", "fused", "loop"] = "auto"
    """Which ``torch.optim.AdamW`` implementation runs (for ``adamw`` and Muon's AdamW half): ``auto`` the fused
    kernel on CUDA and PyTorch's per-parameter loop on CPU (CPU results as they always were); ``fused`` the
    fused kernel on CPU too (one kernel for every parameter; transformers' and so TRL's default since torch 2.8,
    ``adamw_torch_fused``; the stages take it); ``loop`` the loop everywhere. The kernels round differently."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps (scales every parameter group alike), then ``schedule``."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After warm-up: ``constant``; or decay from ``lr`` to ``min_lr_ratio * lr`` over ``decay_steps``
    optimizer steps, along a half cosine (Loshchilov & Hutter 2017, SGDR) or a straight line, then hold.
    RL recipes mostly keep the lr constant (DAPO, Magistral); a decay trades late progress for a stable
    end, which matters when a run is read by its last evaluations."""
    decay_steps: int | Literal["max_steps"] = RUN_LENGTH
    """Optimizer steps from the end of warm-up to the end of the decay; unused with ``constant``.
    ``max_steps`` (the default): the rest of the run, i.e. ``max_steps`` x ``trainer.num_minibatches`` minus
    ``warmup_steps`` for RL, worked out when the run builds its optimizer (``optim.for_run``), so
    ``--set max_steps=N`` rescales the decay and the lr reaches its floor at step N. An integer fixes it
    whatever the run's length. A step skipped for want of any learning signal takes no optimizer step and
    does not advance the schedule."""
    min_lr_ratio: float = 0.1
    """Where the decay ends, as a fraction of ``lr`` (0.1: the common cosine-to-10% of LLM training)."""
    ademamix: AdEMAMixConfig = field(default_factory=AdEMAMixConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)
