"""The RL trainer step: recompute log-probs, apply the policy loss, step AdamW.

One call to ``step`` consumes one TrainBatch. It is split into ``num_minibatches`` optimizer steps
(1 = one update per batch, the on-policy default); each minibatch's loss is aggregated with the
configured aggregation (``token_mean`` by default), gradients are clipped, and the policy version is
bumped once per ``step``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.algo import POLICY_LOSSES, bind
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


class Trainer:
    def __init__(self, model: torch.nn.Module, algo: AlgoConfig, optim: OptimConfig, cfg: TrainerConfig):
        self.model = model.train()
        self.algo = algo
        self.cfg = cfg
        self.optim_cfg = optim
        self.optimizer, self.scheduler = build_optimizer(model.parameters(), optim)
        self.policy_loss = POLICY_LOSSES[algo.policy_loss]
        self.version = 0

    def step(self, batch: TrainBatch) -> dict[str, float]:
        b = batch.num_sequences
        order = torch.arange(b)
        chunks = [c for c in order.chunk(self.cfg.num_minibatches) if len(c)]
        totals: dict[str, float] = {}
        for mb_index, idx in enumerate(chunks):
            mask = batch.loss_mask_bt[idx]
            logp, entropy = token_logprobs(self.model, batch.input_ids_bt[idx], batch.attention_mask_bt[idx],
                                           self.cfg.temperature, with_entropy=True)
            policy_loss = bind(self.policy_loss, self.algo, group_ids_b=batch.group_index_b[idx])
            loss, metrics = policy_loss(logp, batch.behav_logp_bt[idx], batch.adv_bt[idx], mask)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            with torch.no_grad():
                metrics["train/loss"] = loss.item()
                metrics["train/grad_norm"] = grad_norm.item()
                metrics["train/entropy"] = masked_mean(entropy, mask).item()
                if mb_index == 0:  # before any update on this batch
                    # Engine/trainer numeric gap: only tokens sampled by the weights the trainer has
                    # now (stale tokens differ because the policy moved, not because of numerics).
                    gap = (logp.detach() - batch.behav_logp_bt[idx]).abs()
                    fresh = mask * (batch.versions_bt[idx] == self.version).float()
                    if fresh.any():
                        metrics["train/logp_mismatch_mean"] = masked_mean(gap, fresh).item()
                        metrics["train/logp_mismatch_max"] = gap[fresh.bool()].max().item()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v / len(chunks)
        totals["train/lr"] = self.scheduler.get_last_lr()[0]
        totals["train/num_tokens"] = float(batch.num_response_tokens)
        self.version += 1
        return totals

    def skip_step(self) -> None:
        """A batch with no learning signal (every group's rewards equal): the weights carry over
        unchanged as the next version, so version numbers keep counting training steps."""
        self.version += 1

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """A detached copy of the weights to ship to the rollout engine."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
