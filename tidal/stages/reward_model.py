"""Reward-model training: Bradley-Terry on preference rows, a scalar head on the policy's architecture.

The model is ``models/reward_model.from_policy(model.path)``: the policy's backbone with a new one-output
head. Each step packs the chosen and rejected chats of ``batch_size`` pairs, each pair one prefix trie whose
common prefix is computed once (``pair_tree.py``; ``share_prefix=false``: 2B sequences, ``train/packing.py``,
same rewards), reads the head at each sequence's last token and minimizes ``rm_loss.bradley_terry_loss``.
Held out: the loss and the accuracy (the share of pairs with r_chosen > r_rejected). ``model/`` is a Hugging
Face sequence-classification directory; ``reward.name=rm`` with ``reward.params.path`` set to it scores RL
samples (``rewards/rm.py``).

    tidal rm --set data.path=pairs.jsonl --set model.path=runs/sft/model --out runs/rm
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidal.models import tiny
from tidal.models.reward_model import backbone, from_policy
from tidal.optim import OptimConfig
from tidal.stages.chat_data import PairExample, encode_pair
from tidal.stages.checks import validate_stage
from tidal.stages.common import (
    DataConfig,
    RunConfig,
    check_lora,
    chunks,
    load_policy,
    open_run,
    run_stage,
    stage_optim,
    train_and_held,
    with_lora,
)
from tidal.stages.pair_tree import pair_last_hidden, shares_prefixes
from tidal.stages.rm_loss import bradley_terry_loss
from tidal.stages.sft import padded
from tidal.train.packing import pack, packed_attention_mask


@dataclass
class RMStageConfig:
    """``tidal rm``: a Bradley-Terry reward model."""

    model: tiny.ModelConfig = field(default_factory=tiny.ModelConfig)
    """``model.path``: the policy whose architecture and backbone the reward model takes."""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=lambda: stage_optim(lr=1e-4))
    """lr 1e-4: TRL RewardConfig's default."""
    run: RunConfig = field(default_factory=lambda: RunConfig(batch_size=8))
    center: float = 0.0
    """Weight of mean((r_c + r_r)^2) (TRL's ``center_rewards_coefficient``; Eisenstein et al. 2023 use 0.01)."""
    pack_length: int = 0
    """Tokens per packed row (with ``share_prefix``, the most: rows are as wide as costs least,
    ``pair_tree.row_width``); 0: ``data.max_length``."""
    share_prefix: bool = True
    """Each pair as one prefix trie, its chosen and rejected's common token prefix computed once
    (``pair_tree.py``); false: 2B packed sequences. Same rewards and gradients either way."""


def packed_rewards(rm: torch.nn.Module, seqs: list[list[int]], pack_length: int) -> torch.Tensor:
    """[N] rewards of ``seqs``, all in one packed forward: the head at each sequence's last token."""
    ids_bt, lengths = padded(seqs)
    layout = pack(ids_bt, lengths, max(pack_length, ids_bt.shape[1]))
    device = next(rm.parameters()).device
    hidden_rlh = backbone(rm)(
        input_ids=layout.input_ids_rl.to(device), attention_mask=packed_attention_mask(layout, rm, "auto"),
        position_ids=layout.position_ids_rl.to(device), use_cache=False).last_hidden_state
    rows = torch.tensor([r for r, _, _ in layout.where], device=device)
    last = torch.tensor([s + n - 1 for _, s, n in layout.where], device=device)
    return rm.score(hidden_rlh[rows, last]).squeeze(-1).float()


def pair_rewards(rm, pairs: list[PairExample], pack_length: int,
                 share_prefix: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rewards [B] each; with ``share_prefix`` each pair's common prefix computed once."""
    chosen, rejected = [p.chosen_ids for p in pairs], [p.rejected_ids for p in pairs]
    if share_prefix and shares_prefixes(rm) and min(map(len, chosen + rejected)) >= 2:
        hidden, _ = pair_last_hidden(rm, backbone(rm), chosen, rejected, pack_length)
        r = rm.score(hidden).squeeze(-1).float()
    else:  # one-token sequences (no completion) never come from encode_pair; the plain path takes them
        r = packed_rewards(rm, chosen + rejected, pack_length)
    return r[: len(pairs)], r[len(pairs):]


def train(cfg: RMStageConfig, out: str, resume: bool = False, overwrite: bool = False, log=print) -> dict:
    validate_stage(cfg)
    check_lora(cfg.model)
    with open_run(out, resume, overwrite, log, "rm", cfg) as run_dir:  # checked and locked, nothing deleted yet
        return _train(cfg, out, resume, overwrite, log, run_dir.begin)


def _train(cfg: RMStageConfig, out: str, resume: bool, overwrite: bool, log, begin) -> dict:
    policy, tokenizer = load_policy(cfg.model, cfg.data)
    rm = from_policy(policy, seed=cfg.run.seed)  # the head: a function of run.seed
    del policy
    # LoRA on the backbone and the new score head trained whole (PEFT's modules_to_save): a frozen random head
    # would leave the reward random
    rm = with_lora(rm, cfg.model, cfg.run.seed, "rm", log, task_type="SEQ_CLS")
    pairs, held = train_and_held(cfg, encode_pair, tokenizer, log)
    begin()  # the model and rows loaded: only now may --overwrite delete the previous run
    pack_length = cfg.pack_length or cfg.data.max_length

    def step_fn(model, batch):
        rc, rr = pair_rewards(model, batch, pack_length, cfg.share_prefix)
        diff = (rc - rr).detach()
        return bradley_terry_loss(rc, rr, center=cfg.center), {
            "accuracy": float((diff > 0).float().mean()), "margin": float(diff.mean()),
            "num_tokens": sum(len(p.chosen_ids) + len(p.rejected_ids) for p in batch)}

    def eval_fn(model):
        loss, acc, n = 0.0, 0.0, 0
        for part in chunks(held, 64):
            rc, rr = pair_rewards(model, part, pack_length, cfg.share_prefix)
            loss += float(bradley_terry_loss(rc, rr, center=cfg.center)) * len(part)
            acc, n = acc + float((rc > rr).float().sum()), n + len(part)
        return {"loss": loss / n, "accuracy": acc / n}

    return run_stage("rm", cfg, rm, tokenizer, pairs, step_fn, eval_fn, out, resume, overwrite, log)
