"""Padded vs greedy collation vs padding-free packing vs prefix sharing, on long-tailed lengths, side by side.

The same batches (one RL batch of ``num_sequences`` sequences whose response lengths follow a 1/n
law up to ``max_len``, the shape of real reasoning traces; each group of ``group_size`` shares its
``prompt_len``-token prompt, as GRPO's samples do) go through the same trainer step four ways, each
from the same initial weights:

- ``padded``: one [B, T] pass, every row padded to the longest;
- ``collated``: Magistral's greedy collation, micro-batches of sorted lengths filled to a token budget;
- ``packed``: sequences packed end to end into rows of ``pack_tokens`` (block-diagonal attention);
- ``prefix_shared``: each group as one token trie (``train/prefix_tree.py``): the shared prompt is
  computed once per group. Random response tokens share nothing past the prompt, so this arm gains
  only the prompt's repeats; the quickstart's short, mostly agreeing answers gain far more (4x fewer
  tokens, ``tidal/recipes/quickstart.py``).

Reported: real tokens trained per second (median step time; the arms take turns step by step, so
load changes on a shared machine hit all of them alike), the tokens each layout computes, how many
are distinct after prefix sharing, the fraction that were padding, and the speed-up over padded; the
gradients of every arm are checked to agree with padded first.

    tidal bench packing [--set num_sequences=256 --set max_len=256 ...]
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from tidal.algo.config import AlgoConfig
from tidal.config import apply_overrides
from tidal.models import tiny
from tidal.optim import OptimConfig
from tidal.train.microbatch import greedy_collation, pack_sequences, padded_tokens
from tidal.train.prefix_tree import group_micro_batches, pack_prefix_trees
from tidal.train.trainer import Trainer, TrainerConfig
from tidal.types import TrainBatch

DESCRIPTION = "padded vs greedy collation vs packing vs prefix sharing: tokens/s and padding on long-tailed lengths"


@dataclass
class Settings:
    num_sequences: int = 256
    group_size: int = 8
    prompt_len: int = 8
    max_len: int = 256
    micro_batch_tokens: int = 4096
    pack_tokens: int = 256
    steps: int = 3
    threads: int = 2
    seed: int = 0


def long_tailed_batch(s: Settings, vocab: int) -> TrainBatch:
    """Responses of length n with probability proportional to 1/n, n in [1, max_len - prompt_len]."""
    rng = random.Random(s.seed)
    top = s.max_len - s.prompt_len
    weights = [1 / n for n in range(1, top + 1)]
    lengths = [s.prompt_len + n for n in rng.choices(range(1, top + 1), weights, k=s.num_sequences)]
    width = max(lengths)
    gen = torch.Generator().manual_seed(s.seed)
    ids = torch.randint(3, vocab, (s.num_sequences, width), generator=gen)
    attn = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    group = torch.arange(s.num_sequences) // s.group_size
    ids[:, : s.prompt_len] = ids[group * s.group_size, : s.prompt_len]  # a group's samples share its prompt
    ids = ids * attn
    loss_mask = attn.float()
    loss_mask[:, : s.prompt_len] = 0
    behav = -torch.rand(s.num_sequences, width, generator=gen) * loss_mask
    versions = torch.where(loss_mask > 0, 0, -1)
    rewards = torch.randint(0, 2, (s.num_sequences,), generator=gen).float()
    return TrainBatch(ids, attn, loss_mask, behav, versions, group, rewards)


def packed_tokens(lengths: list[int], micro_batch_tokens: int, pack_tokens: int) -> int:
    """Tokens the packed layout computes: per micro-batch, rows x the longest packed row."""
    total = 0
    for micro in pack_sequences(lengths, micro_batch_tokens):
        rows = pack_sequences([lengths[i] for i in micro], pack_tokens)
        total += len(rows) * max(sum(lengths[micro[j]] for j in row) for row in rows)
    return total


def trie_tokens(batch: TrainBatch, lengths: list[int], micro_batch_tokens: int,
                pack_tokens: int) -> tuple[int, int]:
    """Tokens the prefix-shared layout computes (per micro-batch, the trainer's split: rows x the
    widest row) and the trie nodes among them (the real tokens, each shared prefix counted once)."""
    total = nodes = 0
    groups = batch.group_index_b.tolist()
    for rows in group_micro_batches(batch.input_ids_bt, lengths, groups, micro_batch_tokens):
        trees = pack_prefix_trees(batch.input_ids_bt[rows], [lengths[i] for i in rows],
                                  batch.group_index_b[rows].tolist(), pack_tokens)
        total += trees.input_ids_rl.numel()
        nodes += trees.num_tokens
    return total, nodes


def run(overrides: list[str], out_dir: Path) -> dict:
    s = apply_overrides(Settings(), overrides)
    torch.set_num_threads(s.threads)
    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(tiny.ModelConfig(max_position_embeddings=max(s.max_len, 128)), tokenizer)
    batch = long_tailed_batch(s, len(tokenizer))
    lengths = batch.attention_mask_bt.sum(-1).tolist()
    real = sum(lengths)
    arms = {
        "padded": (TrainerConfig(), len(lengths) * max(lengths), real),
        "collated": (TrainerConfig(micro_batch_tokens=s.micro_batch_tokens),
                     padded_tokens(lengths, greedy_collation(lengths, s.micro_batch_tokens)), real),
        "packed": (TrainerConfig(micro_batch_tokens=s.micro_batch_tokens, packing=True, pack_tokens=s.pack_tokens),
                   packed_tokens(lengths, s.micro_batch_tokens, s.pack_tokens), real),
        "prefix_shared": (TrainerConfig(micro_batch_tokens=s.micro_batch_tokens, share_prefixes=True,
                                        pack_tokens=s.pack_tokens),
                          *trie_tokens(batch, lengths, s.micro_batch_tokens, s.pack_tokens)),
    }
    trainers, grads = {}, {}
    for name, (cfg, *_) in arms.items():
        trainers[name] = Trainer(copy.deepcopy(model), AlgoConfig(), OptimConfig(lr=0.0, grad_clip=1e9), cfg)
        trainers[name].step(batch)  # warm-up (and the gradient to compare)
        grads[name] = torch.cat([p.grad.flatten() for p in trainers[name].model.parameters()])
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(s.steps):  # round robin: a load change on this shared machine hits every arm alike
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.step(batch)
            times[name].append(time.perf_counter() - start)
    rows = []
    for name, (_, computed, unique) in arms.items():  # unique: tokens after sharing (only tries share)
        seconds = statistics.median(times[name])
        rows.append({"layout": name, "step_s": seconds, "tokens_per_s": real / seconds,
                     "computed_tokens": computed, "unique_tokens": unique, "padding_frac": 1 - unique / computed})
    for name in ("collated", "packed", "prefix_shared"):
        gap = (grads[name] - grads["padded"]).abs().max().item()
        assert gap < 1e-4 * max(grads["padded"].abs().max().item(), 1e-6), f"{name} changed the gradient: {gap}"
    for row in rows:
        row["speedup"] = rows[0]["step_s"] / row["step_s"]
    return {"benchmark": "packing", "description": DESCRIPTION, "table": rows,
            "settings": {f.name: getattr(s, f.name) for f in fields(s)},
            "real_tokens": real}
