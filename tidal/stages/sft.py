"""Chat SFT: next-token loss on the assistant tokens of a user's chat data, packed, with a held-out loss.

loss = - sum_t mask_t log p(x_t | x_<t) / sum_t mask_t over every row of the step (a token mean, as TRL's
SFTTrainer with ``assistant_only_loss``): ``mask`` is the chat template's own assistant mask
(``chat_data.py``). Rows are packed end to end into rows of ``pack_length`` tokens with the RL trainer's
padding-free packing (``train/packing.py``: positions restart per sequence, attention block-diagonal
causal), so no token is padding; the log-probs come back in the padded layout, so the loss equals the
padded computation's (``tests/stages/test_sft.py`` pins it).

    tidal sft --set data.path=chat.jsonl --set model.path=BASE --out runs/sft [--resume | --overwrite]

``runs/sft/model`` is then the next stage's (or RL's) ``model.path``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidal.models import tiny
from tidal.models.logprobs import token_logprobs
from tidal.optim import OptimConfig
from tidal.stages.chat_data import SFTExample, encode_sft
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
from tidal.train.packing import pack, packed_attention_mask, unpack


@dataclass
class SFTStageConfig:
    """``tidal sft``: chat SFT on assistant tokens."""

    model: tiny.ModelConfig = field(default_factory=tiny.ModelConfig)
    """``model.path``: the starting checkpoint (empty: the tiny model, built here)."""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=lambda: stage_optim(lr=2e-5))
    """``tidal.optim``'s keys (docs/optimizers.md); lr 2e-5: TRL SFTConfig's default (transformers' is 5e-5), a tiny
    model from scratch wants ~1e-3."""
    run: RunConfig = field(default_factory=RunConfig)
    pack_length: int = 0
    """Tokens per packed row; 0: ``data.max_length``. Rows longer than it get a row of their own."""
    packed_attention: str = "auto"
    """``trainer.packed_attention``'s choices: auto (block mask on CUDA), dense, block."""


def padded(seqs: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Right-padded [B, T] ids and the lengths."""
    lengths = [len(s) for s in seqs]
    ids = torch.zeros((len(seqs), max(lengths)), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, lengths


def packed_logprobs(model: torch.nn.Module, seqs: list[list[int]], pack_length: int,
                    attention: str = "auto") -> torch.Tensor:
    """log p(x_t | x_<t) of every sequence, computed packed, returned right-padded [B, T] (column 0: 0)."""
    ids_bt, lengths = padded(seqs)
    layout = pack(ids_bt, lengths, max(pack_length, ids_bt.shape[1]))
    mask = packed_attention_mask(layout, model, attention)
    logp_rl, _ = token_logprobs(model, layout.input_ids_rl, mask, position_ids=layout.position_ids_rl)
    return unpack(logp_rl, layout, ids_bt.shape[1])


def masks(examples: list[SFTExample], width: int) -> torch.Tensor:
    out = torch.zeros((len(examples), width))
    for i, e in enumerate(examples):
        out[i, 1: len(e.mask)] = torch.tensor(e.mask[1:], dtype=torch.float)  # token 0 is never predicted
    return out


def nll_sum(model, examples: list[SFTExample], pack_length: int, attention: str = "auto") -> tuple[torch.Tensor, int]:
    """(sum of -log p over assistant tokens, their number)."""
    logp_bt = packed_logprobs(model, [e.ids for e in examples], pack_length, attention)
    mask_bt = masks(examples, logp_bt.shape[1]).to(logp_bt.device)
    return -(logp_bt * mask_bt).sum(), int(mask_bt.sum())


def train(cfg: SFTStageConfig, out: str, resume: bool = False, overwrite: bool = False, log=print) -> dict:
    validate_stage(cfg)
    check_lora(cfg.model)
    with open_run(out, resume, overwrite, log, "sft", cfg) as run_dir:  # checked and locked, nothing deleted yet
        return _train(cfg, out, resume, overwrite, log, run_dir.begin)


def _train(cfg: SFTStageConfig, out: str, resume: bool, overwrite: bool, log, begin) -> dict:
    model, tokenizer = load_policy(cfg.model, cfg.data)
    model = with_lora(model, cfg.model, cfg.run.seed, "sft", log)
    rows, held = train_and_held(cfg, encode_sft, tokenizer, log)
    begin()  # the model and rows loaded: only now may --overwrite delete the previous run
    pack_length = cfg.pack_length or cfg.data.max_length

    def step_fn(model, batch):
        total, count = nll_sum(model, batch, pack_length, cfg.packed_attention)
        return total / max(count, 1), {"num_tokens": sum(len(e.ids) for e in batch), "assistant_tokens": count}

    def eval_fn(model):
        total, count = 0.0, 0
        for part in chunks(held, cfg.run.batch_size):
            s, n = nll_sum(model, part, pack_length, cfg.packed_attention)
            total, count = total + float(s), count + n
        return {"loss": total / max(count, 1), "num_rows": len(held)}

    return run_stage("sft", cfg, model, tokenizer, rows, step_fn, eval_fn, out, resume, overwrite, log)
