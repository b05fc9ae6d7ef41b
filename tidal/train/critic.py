"""The critic of PPO with a learned value model (``algo.advantage=gae``), trained in the policy's step.

Per trainer step, with the batch's micro-batches (the same split the policy uses):

1. ``targets``: the critic, before any update this step, predicts V(s_t) for every response token
   (no gradient); GAE (``algo/value.py``) turns the rewards and these values into per-token
   advantages for the policy loss and returns (the lambda-returns) for the critic.
2. ``minibatch_step``: after the policy's optimizer step on a minibatch, the critic takes one
   optimizer step on the same rows: the clipped value loss against the returns, clipped around the
   values of step 1, accumulated over the same micro-batches with the same aggregation weights.

The critic is a ``ValueModel`` (``models/value_head.py``: a copy of the policy's decoder with a scalar
head, the reason is there) with its own optimizer and schedule (``critic.optim``), as verl's critic has
its own optim config. ``state_dict`` / ``load_state_dict`` carry weights, optimizer and scheduler, so a
checkpoint (``critic.pt``, ``train/checkpoint.py``) resumes it exactly.

Every layout of the policy's forward works alike (padded, ``trainer.packing``, ``trainer.share_prefixes``,
with or without ``trainer.micro_batch_tokens``); data parallel (torchrun) does not yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidal.algo import aggregation_weights, bind, explained_variance, value_loss
from tidal.algo.aggregation import masked_mean
from tidal.algo.config import AlgoConfig
from tidal.config import ConfigError
from tidal.models.checkpointing import enable_activation_checkpointing
from tidal.models.value_head import ValueModel
from tidal.optim import OptimConfig, build_optimizer
from tidal.train.packing import pack, packed_attention_mask, unpack
from tidal.train.prefix_tree import pack_prefix_trees, unpack_trees
from tidal.types import TrainBatch
from tidal.utils.device import resolve_dtype


@dataclass
class CriticConfig:
    """The value model of ``algo.advantage=gae`` (unused otherwise)."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """The critic's own optimizer, schedule and grad clip (every ``optim.*`` key, under ``critic.optim.*``).
    Defaults: the policy's defaults (AdamW, lr 2e-4 for the tiny model). verl's critic for LLMs uses
    lr 1e-5, ten times its actor's 1e-6, with weight decay 0.01."""


@dataclass
class CriticTargets:
    """What step 1 hands to the policy loss (``adv_bt``) and to every ``minibatch_step``."""

    adv_bt: torch.Tensor
    returns_bt: torch.Tensor
    old_values_bt: torch.Tensor
    metrics: dict[str, float]


def check_supported(trainer_cfg, data_parallel: bool) -> None:
    """A ConfigError naming the keys when the critic cannot run with this ``TrainerConfig`` yet."""
    if data_parallel:
        raise ConfigError("algo.advantage=gae does not support data parallel training under torchrun "
                          f"(trainer.data_parallel={trainer_cfg.data_parallel}) yet: the critic is neither sharded "
                          "nor synced across ranks; run it in one process")


class Critic:
    def __init__(self, policy: torch.nn.Module, cfg: CriticConfig, layout, num_steps: int | None = None):
        """``layout``: the trainer's ``TrainerConfig`` (packing, prefix sharing, activation checkpointing).
        ``num_steps``: the run's optimizer steps, which ``critic.optim.decay_steps=max_steps`` spans (the
        critic steps with every policy minibatch)."""
        self.model = ValueModel.from_policy(policy).train()
        self.model.autocast_dtype = resolve_dtype(layout.precision, next(policy.parameters()).device,
                                                  "trainer.precision")
        if layout.activation_checkpointing:
            enable_activation_checkpointing(self.model.decoder)
        self.cfg = cfg
        self.layout = layout
        self.routes = None
        """The trainer's ``TrainerRouting`` (set by the trainer): an MoE critic replays the policy's routes."""
        # a LoRA policy's critic copies its frozen base and adapters: the optimizer gets what trains (adapters, head)
        frozen = any(not p.requires_grad for p in self.model.parameters())
        self.optimizer, self.scheduler = build_optimizer(
            [p for p in self.model.parameters() if p.requires_grad] if frozen else self.model, cfg.optim, num_steps)

    def values(self, batch: TrainBatch, rows: torch.Tensor) -> torch.Tensor:
        """V(s_t) of ``rows`` in the batch's [len(rows), T] layout, computed in the trainer's layout: padded
        to the longest row, packed (``trainer.packing``) or as prefix tries (``trainer.share_prefixes``),
        with the policy's choice of packed attention (``trainer.packed_attention``)."""
        width = batch.input_ids_bt.shape[1]
        lengths = batch.attention_mask_bt[rows].sum(-1).tolist()
        if self.layout.share_prefixes:
            trees = pack_prefix_trees(batch.input_ids_bt[rows], lengths, batch.group_index_b[rows].tolist(),
                                      self.layout.pack_tokens)
            mask = packed_attention_mask(trees, self.model.decoder, self.layout.packed_attention)
            self._plan(rows, trees, tuple(trees.input_ids_rl.shape), None)
            v = self.model(trees.input_ids_rl, mask, position_ids=trees.position_ids_rl, parents_bt=trees.parents_rl)
            return unpack_trees(v, trees, width)
        if self.layout.packing:
            packed = pack(batch.input_ids_bt[rows], lengths, self.layout.pack_tokens)
            mask = packed_attention_mask(packed, self.model.decoder, self.layout.packed_attention)
            self._plan(rows, packed, tuple(packed.input_ids_rl.shape), None)
            v = self.model(packed.input_ids_rl, mask, position_ids=packed.position_ids_rl)
            return unpack(v, packed, width)
        used = max(lengths)
        self._plan(rows, None, (len(rows), used), batch.attention_mask_bt[rows, :used])
        v = self.model(batch.input_ids_bt[rows, :used], batch.attention_mask_bt[rows, :used])
        return torch.nn.functional.pad(v, (0, width - used))

    def _plan(self, rows, layout, width_rl, attention_bt) -> None:
        if self.routes is not None:
            self.routes.before_forward(self.model.decoder, rows, layout, width_rl, attention_bt)

    def _end_pass(self) -> None:
        if self.routes is not None:
            self.routes.end_pass()

    @torch.no_grad()
    def targets(self, estimator, algo: AlgoConfig, batch: TrainBatch, rewards_b: torch.Tensor,
                micro_batches: list[torch.Tensor]) -> CriticTargets:
        """Step 1: V before this step's updates, then ``estimator`` (a ``VALUE_ADVANTAGES`` entry)."""
        old_values_bt = torch.zeros_like(batch.loss_mask_bt)
        for micro in micro_batches:
            old_values_bt[micro] = self.values(batch, micro)
            self._end_pass()
        mask = batch.loss_mask_bt
        adv_bt, returns_bt = bind(estimator, algo)(rewards_b, old_values_bt, mask)
        metrics = {"critic/explained_var": explained_variance(old_values_bt, returns_bt, mask),
                   "critic/returns_mean": masked_mean(returns_bt, mask).item()}
        return CriticTargets(adv_bt, returns_bt, old_values_bt, metrics)

    def minibatch_step(self, algo: AlgoConfig, batch: TrainBatch, idx: torch.Tensor,
                       micro_batches: list[torch.Tensor], targets: CriticTargets) -> dict[str, float]:
        """Step 2: one optimizer step of the critic on the minibatch ``idx`` (``micro_batches`` are
        positions into ``idx``), gradients accumulated so the result equals one pass over ``idx``."""
        mask_mb = batch.loss_mask_bt[idx]
        # the policy's aggregation (verl's critic takes the actor's loss_agg_mode), token mean by default
        weights_mb = aggregation_weights(mask_mb, agg=algo.loss_agg or "token_mean",
                                         group_ids_b=batch.group_index_b[idx], max_gen_len=algo.max_gen_len)
        num_tokens = max(float(mask_mb.sum()), 1.0)
        totals: dict[str, float] = {"critic/value_loss": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for micro in micro_batches:
            rows = idx[micro]
            mask = batch.loss_mask_bt[rows]
            loss, metrics = bind(value_loss, algo, agg_weights_bt=weights_mb[micro])(
                self.values(batch, rows), targets.old_values_bt[rows], targets.returns_bt[rows], mask)
            loss.backward()
            self._end_pass()
            totals["critic/value_loss"] += metrics.pop("critic/value_loss")  # parts of one weighted sum
            share = float(mask.sum()) / num_tokens  # per-token metrics: a token-weighted mean
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        totals["critic/grad_norm"] = grad_norm.item()
        totals["critic/lr"] = self.scheduler.get_last_lr()[0]
        return totals

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
