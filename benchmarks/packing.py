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

Then one long packed row goes forward and backward through the tiny model twice: with the dense
[1, 1, L, L] mask (``trainer.packed_attention=dense``) and with the block path (``block``: no [L, L]
tensor; ``models/attention.py``). The row is ``row_tokens`` long (default 32 x ``max_len``: 8,192)
of long-tailed sequences up to ``row_max_len`` (default 8 x ``max_len``), so a small run stays small.
Reported at the top level: each one's peak of tensor memory over what the model holds
(``row8k_peak_mb_dense``, ``row8k_peak_mb_block``; on CPU replayed from the profiler's allocation
events, ``utils/memory.tensor_peak_bytes``; on CUDA the allocator's peak) and median time
(``row8k_s_dense``, ``row8k_s_block``), gradients checked to agree. ``device=cuda`` runs the row on a
GPU (FlexAttention); ``compare_layouts=false`` runs the row alone; ``row_tokens=0`` skips it.

    tidal bench packing [--set num_sequences=256 --set max_len=256 ...]
    tidal bench packing --set compare_layouts=false --set row_tokens=32768 --set device=cuda
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
from tidal.models.logprobs import token_logprobs
from tidal.optim import OptimConfig
from tidal.train.config import TrainerConfig
from tidal.train.microbatch import greedy_collation, pack_sequences, padded_tokens
from tidal.train.packing import pack, packed_attention_mask
from tidal.train.prefix_tree import group_micro_batches, pack_prefix_trees
from tidal.train.trainer import Trainer
from tidal.types import TrainBatch
from tidal.utils.memory import tensor_peak_bytes

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
    compare_layouts: bool = True
    row_tokens: int | None = None  # None: 32 x max_len (8,192); 0: no row
    row_max_len: int | None = None  # None: 8 x max_len (2,048)
    row_repeats: int = 2
    device: str = "cpu"


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


def one_row(s: Settings, vocab: int) -> tuple[torch.Tensor, list[int]]:
    """Sequences with lengths drawn as in ``long_tailed_batch`` (1/n, up to ``row_max_len``) that fill
    exactly ``row_tokens``: one packed row."""
    rng = random.Random(s.seed)
    weights = [1 / n for n in range(1, s.row_max_len + 1)]
    lengths: list[int] = []
    while sum(lengths) < s.row_tokens:
        lengths.append(min(rng.choices(range(1, s.row_max_len + 1), weights)[0], s.row_tokens - sum(lengths)))
    ids = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(s.seed))
    return ids, lengths


def row_attention(s: Settings, tokenizer) -> dict:
    """Peak tensor memory and time of forward + backward of one ``row_tokens`` packed row, dense mask
    vs block path (mask built inside the measured step: it is what differs)."""
    device = torch.device(s.device)
    model = tiny.build_model(tiny.ModelConfig(max_position_embeddings=s.row_max_len), tokenizer).to(device)
    ids, lengths = one_row(s, len(tokenizer))
    key = f"row{s.row_tokens // 1024}k"
    out: dict[str, float] = {f"{key}_sequences": len(lengths)}
    grads = {}
    for mode in ("dense", "block"):
        m = copy.deepcopy(model).train()

        def step(m=m, mode=mode):
            m.zero_grad(set_to_none=True)
            packed = pack(ids, lengths, s.row_tokens)
            assert packed.input_ids_rl.shape == (1, s.row_tokens)
            mask = packed_attention_mask(packed, m, mode)
            logp, _ = token_logprobs(m, packed.input_ids_rl.to(device), mask,
                                     position_ids=packed.position_ids_rl.to(device))
            logp.sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()

        if device.type == "cuda":  # on CPU the profiled step is the warm-up
            step()  # FlexAttention compiles
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = tensor_peak_bytes(step)
        times = []
        for _ in range(s.row_repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        out[f"{key}_peak_mb_{mode}"] = peak / 2**20
        out[f"{key}_s_{mode}"] = statistics.median(times)
        grads[mode] = torch.cat([p.grad.flatten() for p in m.parameters()])
    gap = (grads["block"] - grads["dense"]).abs().max().item()
    assert gap < 1e-3 * grads["dense"].abs().max().item(), f"the block path changed the gradient: {gap}"
    return out


def run(overrides: list[str], out_dir: Path) -> dict:
    s = apply_overrides(Settings(), overrides)
    torch.set_num_threads(s.threads)
    tokenizer = tiny.build_tokenizer()
    s.row_tokens = 32 * s.max_len if s.row_tokens is None else s.row_tokens
    s.row_max_len = 8 * s.max_len if s.row_max_len is None else s.row_max_len
    settings = {f.name: getattr(s, f.name) for f in fields(s)}
    long_row = row_attention(s, tokenizer) if s.row_tokens else {}
    if not s.compare_layouts:
        return {"benchmark": "packing", "description": DESCRIPTION, "table": [long_row], "settings": settings,
                **long_row}
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
    return {"benchmark": "packing", "description": DESCRIPTION, "table": rows, "settings": settings,
            "real_tokens": real, **long_row}
