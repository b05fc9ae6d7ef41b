"""The RL trainer step: log-probs, advantages, the configured policy loss and corrections, AdamW.

One call to ``step`` consumes one TrainBatch and bumps the policy version once:

1. *Proximal log-probs* (the trainer's own weights before this step, no gradient) when something
   needs them: decoupled PPO's pi_prox (AReaL), an engine/trainer mismatch correction (TIS/MIS,
   which weigh pi_old / pi_behav), or VCPO's importance-weighted baseline. With one minibatch they
   are the detached log-probs of the training forward itself (same weights), so they cost nothing.
2. *Rewards to advantages*: an optional KL penalty (kl_in_reward) is subtracted from each reward,
   then the configured estimator runs over the batch, or over each minibatch (Magistral).
3. Per minibatch (``num_minibatches`` optimizer steps, PPO-style reuse): the policy loss with its
   aggregation, weighted by the correction, plus an optional KL loss term; VCPO's ESS-scaled lr;
   clipped gradients; one optimizer step.

Which ratio a loss sees: ``old_logp`` is the engine's behaviour log-prob, except under a mismatch
correction, where the loss's ratio is taken against the trainer's own proximal log-probs and the
engine gap is carried by the correction weight instead (Yao et al. 2025).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from tidal.algo import (
    ADVANTAGES,
    CORRECTIONS,
    POLICY_LOSSES,
    advantage_metrics,
    bind,
    effective_sample_size_log,
    ess_lr_scale,
    kl_loss,
    kl_reward_penalty,
    sequence_log_ratio,
)
from tidal.algo.config import AlgoConfig
from tidal.algo.losses import masked_mean
from tidal.models.logprobs import token_logprobs
from tidal.optim import OptimConfig, build_optimizer
from tidal.types import TrainBatch


@dataclass
class TrainerConfig:
    num_minibatches: int = 1
    """Optimizer steps per batch (PPO-style reuse; 1 keeps every update on fresh samples)."""
    temperature: float = 1.0
    """Must equal the sampling temperature so trainer and engine score the same distribution."""


def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def minibatches(group_index_b: torch.Tensor, num_minibatches: int) -> list[torch.Tensor]:
    """Row indices of up to ``num_minibatches`` minibatches made of whole groups (contiguous runs of
    rows with the same group id), split as evenly by rows as whole groups allow. Whole groups keep
    group-level quantities exact per minibatch: Magistral's group baseline, group-length aggregation."""
    starts = [0] + [i for i in range(1, len(group_index_b)) if group_index_b[i] != group_index_b[i - 1]]
    bounds = [*starts, len(group_index_b)]
    n = min(num_minibatches, len(starts))
    chunks, first = [], 0
    for k in range(1, n + 1):  # cut at the group start closest to the k-th even split point
        target = round(k * len(group_index_b) / n)
        cut = min(bounds[first + 1 :], key=lambda b: abs(b - target)) if k < n else len(group_index_b)
        if cut > bounds[first]:
            chunks.append(torch.arange(bounds[first], cut))
            first = bounds.index(cut)
    return chunks


class Trainer:
    def __init__(self, model: torch.nn.Module, algo: AlgoConfig, optim: OptimConfig, cfg: TrainerConfig,
                 ref_model: torch.nn.Module | None = None):
        self.model = model.train()
        self.algo = algo
        self.cfg = cfg
        self.optim_cfg = optim
        self.optimizer, self.scheduler = build_optimizer(model, optim)
        self.policy_loss = POLICY_LOSSES[algo.policy_loss]
        self.advantage = ADVANTAGES[algo.advantage]
        self.correction = CORRECTIONS[algo.correction]
        if algo.kl_coef > 0 and ref_model is None:
            raise ValueError("algo.kl_coef > 0 needs a reference model (the run's base model)")
        self.ref_model = ref_model.eval().requires_grad_(False) if ref_model is not None else None
        self._needs_prox = (_accepts(self.policy_loss, "prox_logp_bt") or algo.correction != "none"
                            or _accepts(self.advantage, "seq_is_weight_b"))
        self.version = 0

    # ---- pieces ----------------------------------------------------------------------------------
    def _logprobs(self, model: torch.nn.Module, batch: TrainBatch, idx: torch.Tensor, with_entropy: bool = False):
        return token_logprobs(model, batch.input_ids_bt[idx], batch.attention_mask_bt[idx], self.cfg.temperature,
                              with_entropy=with_entropy)

    def _advantages(self, batch: TrainBatch, idx: torch.Tensor, rewards_b: torch.Tensor,
                    prox_bt: torch.Tensor | None) -> torch.Tensor:
        mask = batch.loss_mask_bt[idx]
        data = {"lengths_b": mask.sum(-1)}
        if prox_bt is not None:  # VCPO: sequence importance ratio of the current policy to the sampler
            log_w = sequence_log_ratio(prox_bt[idx], batch.behav_logp_bt[idx], mask).clamp(-20, 20)
            data["seq_is_weight_b"] = log_w.exp()
        return bind(self.advantage, self.algo, **data)(rewards_b[idx], batch.group_index_b[idx])

    def _lr_scale(self, logp_bt: torch.Tensor, batch: TrainBatch, idx: torch.Tensor) -> tuple[float, float]:
        """VCPO: the normalized ESS of this minibatch's sequence weights pi_theta / pi_behav, and the lr
        multiplier it implies (1 unless ``ess_lr_scaling``)."""
        log_w = sequence_log_ratio(logp_bt.detach(), batch.behav_logp_bt[idx], batch.loss_mask_bt[idx])
        ess = effective_sample_size_log(log_w)
        return ess, bind(ess_lr_scale, self.algo)(ess) if self.algo.ess_lr_scaling else 1.0

    # ---- the step --------------------------------------------------------------------------------
    def step(self, batch: TrainBatch) -> dict[str, float]:
        algo = self.algo
        everything = torch.arange(batch.num_sequences)
        chunks = minibatches(batch.group_index_b, self.cfg.num_minibatches)
        metrics_sum: dict[str, float] = {}
        first_forward = None
        prox_bt = None
        if self._needs_prox:
            if len(chunks) == 1:
                first_forward = self._logprobs(self.model, batch, everything, with_entropy=True)
                prox_bt = first_forward[0].detach()
            else:
                with torch.no_grad():
                    prox_bt, _ = self._logprobs(self.model, batch, everything)
        ref_bt = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_bt, _ = self._logprobs(self.ref_model, batch, everything)

        rewards_b = batch.rewards_b
        step_metrics: dict[str, float] = {}
        if ref_bt is not None and algo.kl_in_reward:  # penalty on what the sampler did, vs the reference
            penalty_b = bind(kl_reward_penalty, algo)(batch.behav_logp_bt, ref_bt, batch.loss_mask_bt)
            rewards_b = rewards_b - penalty_b
            step_metrics["algo/kl_reward_penalty"] = penalty_b.mean().item()
        per_minibatch = getattr(self.advantage, "scope", "group") == "minibatch"
        adv_b = None if per_minibatch else self._advantages(batch, everything, rewards_b, prox_bt)

        for mb_index, idx in enumerate(chunks):
            mask = batch.loss_mask_bt[idx]
            behav = batch.behav_logp_bt[idx]
            logp, entropy = first_forward if first_forward is not None else self._logprobs(
                self.model, batch, idx, with_entropy=True)
            first_forward = None
            adv = self._advantages(batch, idx, rewards_b, prox_bt) if per_minibatch else adv_b[idx]
            data = {"group_ids_b": batch.group_index_b[idx]}
            old = behav
            if prox_bt is not None:
                data["prox_logp_bt"] = prox_bt[idx]
                if algo.correction != "none":
                    weight_bt, correction_metrics = bind(self.correction, algo)(prox_bt[idx], behav, mask)
                    data["is_weight_bt"] = weight_bt
                    old = prox_bt[idx]
            loss, metrics = bind(self.policy_loss, algo, **data)(logp, old, adv, mask)
            if prox_bt is not None and algo.correction != "none":
                metrics.update(correction_metrics)
            if ref_bt is not None and not algo.kl_in_reward:
                kl_term, kl_metrics = bind(kl_loss, algo, **data)(logp, ref_bt[idx], mask)
                loss = loss + kl_term
                metrics.update(kl_metrics)
            ess, lr_scale = self._lr_scale(logp, batch, idx)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
            if lr_scale != 1.0:  # the scheduler recomputes every group's lr from its base at its next step
                for group in self.optimizer.param_groups:
                    group["lr"] *= lr_scale
            self.optimizer.step()
            self.scheduler.step()
            with torch.no_grad():
                metrics.update(advantage_metrics(adv))
                metrics["algo/seq_ess"] = ess
                metrics["algo/lr_scale"] = lr_scale
                metrics["train/loss"] = loss.item()
                metrics["train/grad_norm"] = grad_norm.item()
                metrics["train/entropy"] = masked_mean(entropy, mask).item()
                if mb_index == 0:  # before any update on this batch
                    metrics.update(self._mismatch(logp, behav, batch.versions_bt[idx], mask))
            for k, v in metrics.items():
                metrics_sum[k] = metrics_sum.get(k, 0.0) + v / len(chunks)
        metrics_sum.update(step_metrics)
        metrics_sum["train/lr"] = self.scheduler.get_last_lr()[0]
        metrics_sum["train/num_tokens"] = float(batch.num_response_tokens)
        self.version += 1
        return metrics_sum

    def _mismatch(self, logp, behav, versions, mask) -> dict[str, float]:
        """Engine/trainer numeric gap, on tokens sampled by the weights the trainer has now (stale
        tokens differ because the policy moved, not because of numerics)."""
        fresh = mask * (versions == self.version).float()
        if not fresh.any():
            return {}
        gap = (logp.detach() - behav).abs()
        return {"train/logp_mismatch_mean": masked_mean(gap, fresh).item(),
                "train/logp_mismatch_max": gap[fresh.bool()].max().item()}

    def skip_step(self) -> None:
        """A batch with no learning signal (every group's rewards equal): the weights carry over
        unchanged as the next version, so version numbers keep counting training steps."""
        self.version += 1

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """A detached copy of the weights to ship to the rollout engine."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

