"""The RL trainer step: log-probs, advantages, the configured policy loss and corrections, AdamW.

One call to ``step`` consumes one TrainBatch and bumps the policy version once:

1. *Proximal log-probs* (the trainer's own weights before this step, no gradient) when something
   needs them: decoupled PPO's pi_prox (AReaL), an engine/trainer mismatch correction (TIS/MIS,
   which weigh pi_old / pi_behav), or VCPO's importance-weighted baseline. With one minibatch they
   are the detached log-probs of the training forward itself (same weights), so they cost nothing.
2. *Rewards to advantages*: an optional KL penalty (kl_in_reward) is subtracted from each reward (or
   handed per token to a token-level estimator, REINFORCE++), then the configured estimator runs over
   the batch, or over each minibatch (Magistral).
3. Per minibatch (``num_minibatches`` optimizer steps, PPO-style reuse): the policy loss with its
   aggregation, weighted by the correction (and, with ``algo.top_entropy_frac`` < 1, over the
   high-entropy tokens only), plus optional KL and entropy-bonus terms; VCPO's ESS-scaled lr;
   clipped gradients; one optimizer step.

PPO with a learned critic (``algo.advantage=gae``, a ``VALUE_ADVANTAGES`` estimator): in step 2 the
critic (``train/critic.py``) predicts V for every response token and GAE gives [B, T] advantages and
the critic's returns; in step 3, after each minibatch's policy update, the critic takes one step of its
own optimizer on the same rows and micro-batches.

Which ratio a loss sees: ``old_logp`` is the engine's behaviour log-prob, except under a mismatch
correction, where the loss's ratio is taken against the trainer's own proximal log-probs and the
engine gap is carried by the correction weight instead (Yao et al. 2025).

Data parallel (``dp``, ``parallel/fsdp.py``): every rank runs ``step`` on the same batch; weights
and advantages come from the whole (mini)batch, each rank runs forward/backward on its own groups,
and per-token results are summed across ranks, so the step equals the 1-process step.

LoRA (``model.lora``, ``models/lora.py``): the model is a PEFT model; the optimizer holds its adapters
only, the reference policy (KL) is the same model with its adapters disabled (no second copy of the
base), and ``state_dict_for_engine`` sends the adapters only.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tidal.algo import (
    ADVANTAGES,
    CORRECTIONS,
    POLICY_LOSSES,
    VALUE_ADVANTAGES,
    advantage_metrics,
    aggregation_weights,
    bind,
    distill_advantage,
    effective_sample_size_log,
    entropy_loss,
    ess_lr_scale,
    high_entropy_mask,
    kl_loss,
    kl_reward_penalty,
    kl_reward_penalty_tokens,
    mismatch_metrics,
    sequence_log_ratio,
)
from tidal.algo.config import AlgoConfig
from tidal.algo.losses import masked_mean
from tidal.config import ConfigError
from tidal.models import lora
from tidal.models.architecture import check_architecture
from tidal.models.checkpointing import enable_activation_checkpointing
from tidal.models.logprobs import token_logprobs
from tidal.models.quant import linear_weight_names, quantize_state_dict
from tidal.models.tied import tied_names, untie
from tidal.optim import OptimConfig, build_optimizer, for_run
from tidal.train.async_checkpoint import AsyncCheckpointer
from tidal.train.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from tidal.train.config import TrainerConfig, validate
from tidal.train.critic import Critic, CriticConfig, CriticTargets, check_supported
from tidal.train.data_parallel import (
    LOCAL,
    DataParallel,
    local_value,
    root_of,
    state_dict_bytes,
)
from tidal.train.guidance import demonstration_rows
from tidal.train.host_batch import HostBatch, read_metrics
from tidal.train.microbatch import greedy_collation, pack_sequences
from tidal.train.packing import pack, packed_attention_mask, unpack
from tidal.train.precision import autocast_dtype, compute_weights
from tidal.train.prefix_tree import group_micro_batches, pack_prefix_trees, unpack_trees
from tidal.train.routing import TrainerRouting
from tidal.train.vision import with_images
from tidal.types import TrainBatch
from tidal.utils.device import model_device, resolve_device, tensors_to
from tidal.utils.memory import PeakMemory, optimizer_state_bytes
from tidal.utils.phases import PhaseTimer, phase


def _packed_score_mask(layout, score_bt: torch.Tensor) -> torch.Tensor:
    """The loss mask ``score_bt`` [B, T] (host, bool) in a packed or trie layout [R, L]: a slot is scored
    when any sequence through it has a loss token there (a trie node shared by several samples)."""
    mask_rl = torch.zeros(layout.input_ids_rl.shape, dtype=torch.bool)
    keep = score_bt[layout.dest_b, layout.dest_t]
    mask_rl[layout.source_rows[keep], layout.source_cols[keep]] = True
    return mask_rl


def _flash_attention(model: torch.nn.Module) -> bool:
    """Whether the model runs varlen flash attention (which takes no explicit mask)."""
    return str(getattr(model.config, "_attn_implementation", "")).startswith("flash")


def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def minibatches(group_index_b: torch.Tensor, num_minibatches: int) -> list[torch.Tensor]:
    """Row indices of up to ``num_minibatches`` minibatches made of whole groups (contiguous runs of
    rows with the same group id), split as evenly by rows as whole groups allow. Whole groups keep
    group-level quantities exact per minibatch: Magistral's group baseline, group-length aggregation."""
    ids = group_index_b.tolist()  # one transfer, not one per row when the batch is on a GPU
    starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]]
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
                 ref_model: torch.nn.Module | None = None, dp: DataParallel = LOCAL,
                 critic: CriticConfig | None = None, device: str | torch.device | None = None,
                 max_steps: int | None = None):
        """``device`` (``system.device``): where the policy, reference, critic and optimizer state live;
        None keeps the model where it is. Batches are moved there at the start of each step. ``max_steps``: the
        run's length in RL steps, which a decay with ``optim.decay_steps=max_steps`` spans (x
        ``num_minibatches`` optimizer steps; the critic's too); None: the schedules need no length."""
        validate(cfg)
        check_architecture(model)  # one line naming a feature the packed layouts' masks would get wrong
        self.device = model_device(model) if device is None else resolve_device(device)
        model.to(self.device)  # before the optimizer exists, so its state is created on the device too
        if ref_model is not None:
            ref_model.to(self.device)
        self.autocast_dtype = autocast_dtype(cfg, self.device)  # float32 (off) under trainer.weights=bf16_master
        self.model = model.train()
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        self._memory = PeakMemory()
        self.algo = algo
        self.cfg = cfg
        num_optimizer_steps = None if max_steps is None else max_steps * cfg.num_minibatches
        self.optim_cfg = for_run(optim, num_optimizer_steps)  # decay_steps resolved: what the scheduler follows
        self.dp = dp
        if cfg.share_prefixes and _flash_attention(model):
            raise ConfigError("trainer.share_prefixes needs an explicit attention mask (a prefix trie is not a varlen "
                              "flash-attention segment): load the model with attn_implementation='sdpa' or 'eager', "
                              "or use trainer.packing")
        if dp.enabled and dp.shards_model:
            assert cfg.data_parallel == "fsdp", "a DiLoCo rank's Trainer has no data parallel (DiLoCoTrainer)"
            if optim.name == "muon":
                raise ValueError("optim.name=muon is not supported with data parallel FSDP: Newton-Schulz needs each "
                                 "whole matrix, and FSDP shards them (use adamw or ademamix)")
            dp.shard(model)
            if ref_model is not None:
                dp.shard(ref_model.eval().requires_grad_(False))
        self.weight_sync_metrics: dict[str, float] = {}
        """Bytes and gather time of the last ``state_dict_for_engine`` (``perf/weight_sync_bytes``, ...)."""
        self.lora = lora.is_peft(model)
        if self.lora and optim.name == "muon":
            raise ConfigError("optim.name=muon with model.lora: Muon orthogonalizes whole hidden matrices, and LoRA's "
                              "A and B are rank-r factors (use adamw or ademamix)")
        self.optimizer, self.scheduler = build_optimizer(lora.trainable_parameters(model) if self.lora else model,
                                                         self.optim_cfg)
        self.num_trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.policy_loss = POLICY_LOSSES[algo.policy_loss]
        self.critic: Critic | None = None  # a learned value model, for a VALUE_ADVANTAGES estimator (gae)
        if algo.advantage in VALUE_ADVANTAGES:
            check_supported(cfg, data_parallel=dp.enabled)
            self.critic = Critic(model, critic or CriticConfig(), cfg, num_steps=num_optimizer_steps)
        self.advantage = (VALUE_ADVANTAGES if self.critic is not None else ADVANTAGES)[algo.advantage]
        self.correction = CORRECTIONS[algo.correction]
        if algo.kl_coef > 0 and ref_model is None and not self.lora:
            raise ValueError("algo.kl_coef > 0 needs a reference model (the run's base model)")
        self.ref_model = ref_model.eval().requires_grad_(False) if ref_model is not None else None
        self.weights = compute_weights(cfg, model, self.optimizer, self.ref_model, dp.enabled)  # train/precision.py
        self._needs_prox = (_accepts(self.policy_loss, "prox_logp_bt") or algo.correction != "none"
                            or _accepts(self.advantage, "seq_is_weight_b"))
        self.version = 0
        self.last_logp_bt: torch.Tensor | None = None
        """The last step's trainer log-probs ([B, T], the batch's layout: what each minibatch's loss saw)
        and advantages ([B] or [B, T]), kept for the sample recorder (``inspector/record.py``)."""
        self.last_adv: torch.Tensor | None = None
        self._host: HostBatch | None = None  # the step's batch as read on the host (``_host_of``)
        self._head_tf32 = self.device.type == "cuda" and cfg.head_matmul == "tf32"
        self.routes = TrainerRouting(model, cfg.moe)  # MoE models: routing replay, agreement, router losses
        if self.critic is not None:
            self.critic.routes = self.routes
        self.observers: list = []
        """Objects told ``after_backward()`` (gradients final, before clipping) and ``after_optimizer()``
        (parameters updated) in every minibatch: the SDC recorder (``integrity/sdc.py``) and fault injection."""

    # ---- pieces ----------------------------------------------------------------------------------
    def _logprobs(self, model: torch.nn.Module, *args, **kwargs):
        """``token_logprobs`` of ``model`` under ``trainer.precision``'s autocast, through its FSDP root when
        sharded (which unshards its weights)."""
        root = root_of(model)
        kwargs["tf32"] = self._head_tf32  # the head's matmuls only (``models/logprobs.py``'s ``tf32_matmul``)
        kwargs["head_kernel"] = self.cfg.head_kernel  # chunked | fused | compiled (``models/logprobs.py``)
        with self.autocast():
            return root(*args, **kwargs) if root is not None else token_logprobs(model, *args, **kwargs)

    def autocast(self) -> torch.autocast:
        """bf16 autocast on the trainer's device when ``trainer.precision`` is bf16 (a no-op for fp32 and under
        ``trainer.weights=bf16_master``, whose parameters are bf16 already)."""
        return torch.autocast(self.device.type, dtype=self.autocast_dtype,
                              enabled=self.autocast_dtype != torch.float32)

    def _host_of(self, batch: TrainBatch) -> HostBatch:
        """``batch``'s layout on the host, read once per batch: laying out passes then never waits for the
        device (``train/host_batch.py``)."""
        if self._host is None or self._host.source is not batch:
            self._host = HostBatch.of(batch)
        return self._host

    def _my_micro_batches(self, batch: TrainBatch, rows: torch.Tensor) -> list[torch.Tensor | None]:
        """This rank's micro-batches of ``rows`` (positions into ``rows``): its whole groups, split as
        ``_micro_batches`` splits; with data parallel, padded with None up to the most any rank has, so
        every rank runs as many forward/backward passes (FSDP's collectives pair up across ranks)."""
        host = self._host_of(batch)
        mine = torch.tensor(self.dp.part(host.groups(rows), host.lengths(rows)), dtype=torch.long)
        micros: list[torch.Tensor | None] = []
        if len(mine):
            micros = [mine[m] for m in self._micro_batches(batch, rows[mine])]
        return micros + [None] * (self.dp.max_int(len(micros)) - len(micros))

    def _micro_batches(self, batch: TrainBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        """Positions (into ``rows``) of the micro-batches that make up one forward/backward each."""
        budget = self.cfg.micro_batch_tokens
        if budget is None:
            return [torch.arange(len(rows))]
        host = self._host_of(batch)
        lengths = host.lengths(rows)
        if self.cfg.share_prefixes:  # whole groups, budgeted in trie nodes
            split = group_micro_batches(host.input_ids_bt[rows], lengths, host.groups(rows), budget)
        elif self.cfg.packing:
            split = pack_sequences(lengths, budget)
        else:
            split = greedy_collation(lengths, budget)
        return [torch.tensor(sorted(m)) for m in split]

    def _forward(self, model: torch.nn.Module, batch: TrainBatch, rows: torch.Tensor, with_entropy: bool = False,
                 entropy_grad: bool = False):
        """Per-token log-probs (and entropies, differentiable if ``entropy_grad``) of ``rows`` in the batch's
        [len(rows), T] layout, computed padded to the longest of these rows, packed without padding
        (``packing``), or packed as one token trie per group (``share_prefixes``). With ``head_tokens=loss`` the
        LM head scores the loss mask's tokens only; the others carry the sampler's log-prob and entropy 0."""
        with phase("forward"):
            logp, ent = self._layout_forward(model, batch, rows, with_entropy, entropy_grad)
        if self.cfg.head_tokens == "loss":
            scored = batch.loss_mask_bt[rows] > 0
            logp = torch.where(scored, logp, batch.behav_logp_bt[rows])  # every ratio and KL outside is exact 0
        return logp, ent

    def _layout_forward(self, model: torch.nn.Module, batch: TrainBatch, rows: torch.Tensor, with_entropy: bool,
                        entropy_grad: bool):
        width = batch.input_ids_bt.shape[1]
        host = self._host_of(batch)
        lengths = host.lengths(rows)
        score_bt = host.loss_mask_bt[rows] if self.cfg.head_tokens == "loss" else None  # on the host: no sync
        kw = {"chunk_size": self.cfg.logprob_chunk_size, "entropy_grad": entropy_grad}
        if self.cfg.share_prefixes or self.cfg.packing:
            if self.cfg.share_prefixes:
                layout = pack_prefix_trees(host.input_ids_bt[rows], lengths, host.groups(rows), self.cfg.pack_tokens)
                kw["parents_bt"], undo = layout.parents_rl, unpack_trees
            else:
                layout, undo = pack(host.input_ids_bt[rows], lengths, self.cfg.pack_tokens), unpack
            if score_bt is not None:
                kw["score_mask_bt"] = _packed_score_mask(layout, score_bt)
            mask = packed_attention_mask(layout, model, self.cfg.packed_attention)  # None for varlen flash
            self.routes.before_forward(model, rows, layout, tuple(layout.input_ids_rl.shape), None)
            logp, ent = self._logprobs(with_images(model, batch, rows, layout), layout.input_ids_rl, mask,  # vision.py
                                       self.cfg.temperature, with_entropy, position_ids=layout.position_ids_rl, **kw)
            return undo(logp, layout, width), undo(ent, layout, width) if ent is not None else None
        used = max(lengths)  # right-padded rows: drop the columns none of them uses
        if score_bt is not None:
            kw["score_mask_bt"] = score_bt[:, :used]
        self.routes.before_forward(model, rows, None, (len(rows), used), batch.attention_mask_bt[rows, :used])
        logp, ent = self._logprobs(with_images(model, batch, rows, used), batch.input_ids_bt[rows, :used],
                                   batch.attention_mask_bt[rows, :used], self.cfg.temperature, with_entropy, **kw)
        pad = (0, width - used)
        return torch.nn.functional.pad(logp, pad), torch.nn.functional.pad(ent, pad) if ent is not None else None

    @torch.no_grad()
    def _scores(self, model: torch.nn.Module, batch: TrainBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Log-probs of ``rows`` (default: the whole batch) under ``model``, without gradient, one micro-batch
        at a time; other rows are 0."""
        rows = torch.arange(batch.num_sequences) if rows is None else rows.cpu()  # positions, laid out on the host
        out = torch.zeros_like(batch.behav_logp_bt)
        for micro in self._my_micro_batches(batch, rows):
            if micro is None:  # nothing left on this rank: a pass for the collectives only
                self._forward(model, batch, rows[:1])
                self.routes.end_pass()
                continue
            out[rows[micro]] = self._forward(model, batch, rows[micro])[0]
            self.routes.after_forward(batch)  # r2's recording pass keeps the routes it chose
            self.routes.end_pass()
        return self.dp.sum_(out)  # each row is non-zero on exactly one rank

    def _reference_scores(self, batch: TrainBatch) -> torch.Tensor | None:
        """The reference policy's log-probs (for the KL terms), or None without one: the reference model's, or
        with LoRA the base's, from the policy itself with its adapters switched off."""
        if self.ref_model is not None:
            return self._scores(self.ref_model, batch)
        if self.lora and self.algo.kl_coef > 0:
            with self.model.disable_adapter():
                return self._scores(self.model, batch)
        return None

    def _advantages(self, batch: TrainBatch, idx: torch.Tensor, rewards_b: torch.Tensor,
                    prox_bt: torch.Tensor | None, kl_penalty_bt: torch.Tensor | None = None) -> torch.Tensor:
        mask = batch.loss_mask_bt[idx]
        data = {"lengths_b": mask.sum(-1), "mask_bt": mask}
        if kl_penalty_bt is not None:  # a token-level estimator folds the KL into each token's reward
            data["kl_penalty_bt"] = kl_penalty_bt[idx]
        if prox_bt is not None:  # VCPO: sequence importance ratio of the current policy to the sampler
            log_w = sequence_log_ratio(prox_bt[idx], batch.behav_logp_bt[idx], mask).clamp(-20, 20)
            data["seq_is_weight_b"] = log_w.exp()
        adv = bind(self.advantage, self.algo, **data)(rewards_b[idx], batch.group_index_b[idx])
        if batch.teacher_logp_bt is not None:  # on-policy distillation: the teacher's per-token reverse KL
            adv = bind(distill_advantage, self.algo)(adv, batch.teacher_logp_bt[idx], batch.behav_logp_bt[idx], mask)
        return adv

    def _agg_weights(self, fn, mask_bt: torch.Tensor, group_ids_b: torch.Tensor) -> torch.Tensor:
        """Per-token weights of ``fn``'s aggregation over a whole minibatch: sliced per micro-batch, the
        micro-batch losses sum exactly to the minibatch loss (gradient accumulation weighted by tokens)."""
        agg = self.algo.loss_agg or inspect.signature(fn).parameters["agg"].default
        return aggregation_weights(mask_bt, agg=agg, group_ids_b=group_ids_b, max_gen_len=self.algo.max_gen_len)

    # ---- the step --------------------------------------------------------------------------------
    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One policy update on ``batch`` (the module docstring's three stages); returns its metrics.
        ``trainer.head_matmul=tf32`` applies inside the LM head's matmuls only (``models/logprobs.py``)."""
        self._host = None  # read afresh, even from a batch object passed before
        with PhaseTimer(self.device) as timer:  # perf/trainer_{forward,head,backward,optimizer}_ms
            metrics = self._step(tensors_to(batch, self.device))
        return {**metrics, **timer.read()}

    def _step(self, batch: TrainBatch) -> dict[str, float]:
        algo = self.algo
        everything = torch.arange(batch.num_sequences)
        chunks = minibatches(batch.group_index_b, self.cfg.num_minibatches)
        # prox_bt stays None with one minibatch: the weights do not change before its loss (prox = logp.detach())
        self.routes.begin_step(batch, self.version)
        needs_prox = self._needs_prox and (len(chunks) > 1 or _accepts(self.advantage, "seq_is_weight_b"))
        score = lambda rows=None: self._scores(self.model, batch, rows)  # noqa: E731
        prox_bt, moe_metrics = self.routes.before_updates(batch, chunks, needs_prox, score, self.version)
        if (demos := demonstration_rows(batch)) is not None:  # guidance: a demonstration's ratio starts at 1
            now_bt = prox_bt if prox_bt is not None else self._scores(self.model, batch, demos[0])
            batch.behav_logp_bt = torch.where(demos[1], now_bt, batch.behav_logp_bt)
        ref_bt = self._reference_scores(batch)

        rewards_b = batch.rewards_b
        step_metrics: dict[str, float] = {}
        kl_penalty_bt = None
        if ref_bt is not None and algo.kl_in_reward:  # penalty on what the sampler did, vs the reference
            if _accepts(self.advantage, "kl_penalty_bt"):  # per token (REINFORCE++), not summed into the reward
                kl_penalty_bt = bind(kl_reward_penalty_tokens, algo)(batch.behav_logp_bt, ref_bt, batch.loss_mask_bt)
                penalty_b = kl_penalty_bt.sum(-1)
            else:
                penalty_b = bind(kl_reward_penalty, algo)(batch.behav_logp_bt, ref_bt, batch.loss_mask_bt)
                rewards_b = rewards_b - penalty_b
            step_metrics["algo/kl_reward_penalty"] = penalty_b.mean().item()
        per_minibatch = getattr(self.advantage, "scope", "group") == "minibatch"
        targets: CriticTargets | None = None
        if self.critic is not None:  # per-token advantages from the critic's values before this step
            targets = self.critic.targets(self.advantage, algo, batch, rewards_b,
                                          self._micro_batches(batch, everything))
            adv_b = targets.adv_bt
            step_metrics.update(targets.metrics)
        else:
            adv_b = None if per_minibatch else self._advantages(batch, everything, rewards_b, prox_bt, kl_penalty_bt)
        self.last_logp_bt, self.last_adv = torch.zeros_like(batch.behav_logp_bt), adv_b

        metrics_sum: dict[str, float] = {}
        for mb_index, idx in enumerate(chunks):
            adv = self._advantages(batch, idx, rewards_b, prox_bt, kl_penalty_bt) if per_minibatch else adv_b[idx]
            if per_minibatch:
                if self.last_adv is None:
                    self.last_adv = adv.new_zeros((batch.num_sequences, *adv.shape[1:]))
                self.last_adv[idx] = adv
            metrics = self._minibatch_step(batch, idx, adv, prox_bt, ref_bt, first=mb_index == 0)
            if mb_index == 0 and self.routes.replay != "r2":  # the step's first pass, before any update
                moe_metrics.update(self.routes.agreement())
            if self.critic is not None:  # the same rows and micro-batches as the policy's step
                metrics.update(self.critic.minibatch_step(algo, batch, idx, self._micro_batches(batch, idx), targets))
            for k, v in metrics.items():
                metrics_sum[k] = metrics_sum.get(k, 0.0) + v / len(chunks)
        metrics_sum.update(step_metrics)
        metrics_sum.update(moe_metrics)
        metrics_sum["train/lr"] = self.scheduler.get_last_lr()[0]
        metrics_sum["train/num_tokens"] = float(self._host_of(batch).loss_mask_bt.sum())
        metrics_sum.update(self._memory.step_metrics())
        metrics_sum["perf/trainable_params"] = float(self.num_trainable_params)
        metrics_sum["perf/optimizer_state_gb"] = optimizer_state_bytes(self.optimizer) / 1e9
        self.version += 1
        return metrics_sum

    def _minibatch_step(self, batch: TrainBatch, idx: torch.Tensor, adv: torch.Tensor,
                        prox_bt: torch.Tensor | None, ref_bt: torch.Tensor | None, first: bool) -> dict[str, float]:
        """One optimizer step on the minibatch ``idx``, accumulated over its micro-batches."""
        algo = self.algo
        mask_mb = batch.loss_mask_bt[idx]
        groups_mb = batch.group_index_b[idx]
        weights_mb = self._agg_weights(self.policy_loss, mask_mb, groups_mb)
        kl_weights_mb = self._agg_weights(kl_loss, mask_mb, groups_mb) if ref_bt is not None else None
        bonus = algo.entropy_coef > 0  # only then do entropies carry a gradient (the default path is unchanged)
        entropy_weights_mb = self._agg_weights(entropy_loss, mask_mb, groups_mb) if bonus else None
        logp_mb = torch.zeros_like(mask_mb)
        entropy_mb = torch.zeros_like(mask_mb)
        totals: dict[str, float | torch.Tensor] = {}
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)  # read once, after the loop
        host_mask = self._host_of(batch).loss_mask_bt  # token counts from the host copy: no sync per micro-batch
        num_tokens = max(float(host_mask[idx].sum()), 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        for micro in self._my_micro_batches(batch, idx):
            if micro is None:  # nothing left on this rank: a zero-weight pass keeps FSDP's collectives paired
                zero = self._forward(self.model, batch, idx[:1])[0].sum() * 0.0
                with phase("backward"):
                    zero.backward()
                self.routes.end_pass()
                continue
            rows = idx[micro]
            mask, behav = batch.loss_mask_bt[rows], batch.behav_logp_bt[rows]
            logp, entropy = self._forward(self.model, batch, rows, with_entropy=True, entropy_grad=bonus)
            prox = prox_bt[rows] if prox_bt is not None else logp.detach() if self._needs_prox else None
            data = {"group_ids_b": batch.group_index_b[rows], "agg_weights_bt": weights_mb[micro]}
            old = behav
            metrics: dict[str, float] = {}
            if algo.top_entropy_frac < 1.0:  # Beyond the 80/20 Rule: only the high-entropy tokens get loss weight
                keep, entropy_metrics = bind(high_entropy_mask, algo)(entropy.detach(), mask)
                data["agg_weights_bt"] = data["agg_weights_bt"] * keep
                metrics.update(entropy_metrics)
            if prox is not None:
                data["prox_logp_bt"] = prox
                if algo.correction != "none":  # adv: DeepSeek-V3.2's off-policy masking drops negative samples
                    correct = bind(self.correction, algo, adv=adv[micro])
                    data["is_weight_bt"], correction_metrics = correct(prox, behav, mask)
                    metrics.update(correction_metrics)
                    old = prox
            loss, loss_metrics = bind(self.policy_loss, algo, **data)(logp, old, adv[micro], mask)
            metrics.update(loss_metrics)
            if ref_bt is not None and not algo.kl_in_reward:
                data["agg_weights_bt"] = kl_weights_mb[micro]
                data["behav_logp_bt"] = behav  # k3_is weighs by pi / pi_behav: the tokens come from the sampler
                kl_term, kl_metrics = bind(kl_loss, algo, **data)(logp, ref_bt[rows], mask)
                loss = loss + kl_term
                metrics.update(kl_metrics)
            if bonus:
                bonus_term, bonus_metrics = bind(entropy_loss, algo, agg_weights_bt=entropy_weights_mb[micro])(
                    entropy, mask)
                loss = loss + bonus_term
                metrics.update(bonus_metrics)
            share = float(host_mask[rows].sum()) / num_tokens  # per-token metrics: a token-weighted mean
            router_loss = self.routes.aux_loss(metrics)  # MoE: the router's losses (when on) and their values
            if router_loss is not None:
                loss = loss + router_loss * share  # a mean over this micro-batch's tokens, weighted like them
            with phase("backward"):
                loss.backward()
            self.routes.end_pass()  # after the backward: activation checkpointing's recompute replays the plan
            loss_total = loss_total + loss.detach().double()  # float64 as the Python floats it replaces
            logp_mb[micro], entropy_mb[micro] = logp.detach(), entropy.detach()
            for k, v in metrics.items():  # a tensor stays on the device, in float64 as the float it replaces
                totals[k] = totals.get(k, 0.0) + (v.double() if isinstance(v, torch.Tensor) else v) * share

        totals = read_metrics({**totals, "train/loss": loss_total})  # the micro-batches' one read
        loss_total = totals.pop("train/loss")
        if self.dp.enabled:  # every rank filled its own rows; token-weighted metrics and losses add up
            self.dp.sum_(logp_mb)
            self.dp.sum_(entropy_mb)
            totals = self.dp.sum_floats({**totals, "train/loss": loss_total})
            loss_total = totals.pop("train/loss")
            self.dp.reduce_gradients(self.model)  # replicas sum theirs here; FSDP's reduce-scatter already did
        self.last_logp_bt[idx] = logp_mb
        for observer in self.observers:
            observer.after_backward()
        ess, lr_scale = self._lr_scale(logp_mb, batch, idx)
        with phase("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.weights.grad_tensors(), self.optim_cfg.grad_clip)
            if self.dp.enabled:  # a DTensor: the global norm over every rank's shards
                grad_norm = local_value(grad_norm)
            if lr_scale != 1.0:  # the scheduler recomputes every group's lr from its base at its next step
                for group in self.optimizer.param_groups:
                    group["lr"] *= lr_scale
            self.optimizer.step()
            self.weights.after_step()  # bf16_master: the stepped masters into the bf16 parameters
        for observer in self.observers:
            observer.after_optimizer()
        self.scheduler.step()
        totals.update(advantage_metrics(adv, mask_mb))
        totals["algo/seq_ess"] = ess
        totals["algo/lr_scale"] = lr_scale
        totals["train/loss"] = loss_total
        totals["train/grad_norm"] = grad_norm
        totals["train/entropy"] = masked_mean(entropy_mb, mask_mb)
        if first:  # before any update on this batch
            totals.update(self._mismatch(logp_mb, batch.behav_logp_bt[idx], batch.versions_bt[idx], mask_mb))
        return read_metrics(totals)

    def _lr_scale(self, logp_bt: torch.Tensor, batch: TrainBatch, idx: torch.Tensor) -> tuple[float, float]:
        """VCPO: the normalized ESS of this minibatch's sequence weights pi_theta / pi_behav, and the lr
        multiplier it implies (1 unless ``ess_lr_scaling``)."""
        log_w = sequence_log_ratio(logp_bt.detach(), batch.behav_logp_bt[idx], batch.loss_mask_bt[idx])
        ess = effective_sample_size_log(log_w)
        return ess, bind(ess_lr_scale, self.algo)(ess) if self.algo.ess_lr_scaling else 1.0

    def _mismatch(self, logp, behav, versions, mask) -> dict[str, torch.Tensor]:
        """The engine/trainer gap on tokens the trainer's current weights sampled (``algo/correction.py``)."""
        return mismatch_metrics(logp.detach(), behav, versions, mask, self.version)

    def skip_step(self) -> None:
        """A batch with no learning signal (every group's rewards equal): the weights carry over
        unchanged as the next version, so version numbers keep counting training steps."""
        self.version += 1

    def state_dict_for_engine(self, quant: str = "none", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A detached copy of the weights to ship to the rollout engine, on the trainer's device: a
        colocated engine takes them device to device, never through host memory. ``dtype``: the engine's
        (``rollout.dtype``), cast here so a bf16 engine is sent half the bytes. With data parallel: the
        full weights gathered on rank 0 (an empty dict elsewhere; every rank must call it). ``quant``
        ``fp8_block``: linear weights as e4m3 plus a ``weight_scale`` per 128 x 128 tile
        (``models/quant.py``); the engine dequantizes them. A parameter listed under two names (tied input
        and output embeddings) is sent once, under its first name; the engine fills in the other
        (``models/tied.py``)."""
        start = time.perf_counter()
        if self.lora:  # the adapters only; the engine merges them into its own copy of the base
            if quant != "none":
                raise ValueError(f"rollout.weight_quant={quant!r} with model.lora: the adapters are sent unquantized")
            sd = lora.adapter_update(self.model, dtype)  # data parallel: gathered on every rank, kept on rank 0
            if self.dp.enabled and self.dp.rank != 0:
                sd = {}
            self.weight_sync_metrics = {"perf/weight_gather_s": time.perf_counter() - start,
                                        "perf/weight_sync_bytes": float(state_dict_bytes(sd))}
            return sd
        tied = tied_names(self.model)
        if self.dp.enabled and self.dp.shards_model:
            sd = untie(root_of(self.model).full_state_dict(), tied)
            if dtype is not None:
                sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        else:  # one copy, already in the engine's dtype (``to`` with copy=True never aliases the weights)
            sd = {k: v.detach().to(dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype, copy=True)
                  for k, v in untie(self.model.state_dict(), tied).items()}
        if quant == "fp8_block":
            sd = quantize_state_dict(sd, [n for n in linear_weight_names(self.model) if n in sd])
        elif quant != "none":
            raise ValueError(f"rollout.weight_quant={quant!r}: use none or fp8_block")
        self.weight_sync_metrics = {"perf/weight_gather_s": time.perf_counter() - start,
                                    "perf/weight_sync_bytes": float(state_dict_bytes(sd))}
        return sd

    def gather_full_state(self) -> tuple[dict, dict]:
        """Data parallel: full weights and optimizer state on rank 0 (for a checkpoint). Collective."""
        return root_of(self.model).gather_full_state(self.optimizer)

    def save_checkpoint(self, root: str | Path, tokenizer, state: TrainingState, keep: int = 2,
                        writer: AsyncCheckpointer | None = None,
                        on_saved: Callable[[Path], None] | None = None) -> Path | None:
        """``train/checkpoint.py``'s checkpoint of this trainer (data parallel: every rank calls it, rank 0
        writes the 1-process layout and returns its path, the others None). With ``writer``
        (``async_checkpoint.py``) the step pays only for a host snapshot and the files are written in the
        background: the path returned is complete once ``writer.wait()`` returns. ``on_saved(path)`` runs
        once the checkpoint is complete. Under ``trainer.weights=bf16_master`` it holds the float32 masters."""
        with self.weights.masters_in_model():  # the snapshot (or the whole write) reads them; no-op for fp32
            if writer is not None:
                return writer.save(root, self.model, tokenizer, self.optimizer, self.scheduler, state, keep,
                                   components=self._components(), on_saved=on_saved)
            path = save_checkpoint(root, self.model, tokenizer, self.optimizer, self.scheduler, state, keep,
                                   components=self._components())
        if on_saved is not None and path is not None:
            on_saved(path)
        return path

    def load_checkpoint(self, path: str | Path) -> TrainingState:
        """Restore weights, optimizer, scheduler, RNG state and the policy version; return the counters
        (data parallel: every rank calls it, rank 0 reads the files)."""
        with self.weights.masters_in_model():  # bf16_master: into the float32 masters, then cast
            state = load_checkpoint(path, self.model, self.optimizer, self.scheduler, components=self._components())
        self.version = state.version
        return state

    def _components(self) -> dict:
        """What a checkpoint holds besides the policy: the critic, when there is one."""
        return {"critic": self.critic} if self.critic is not None else {}

