"""A small pre-training (or supervised) loop, one process per worker, synced one of three ways.

- ``sync="none"``: one process, no communication.
- ``sync="dp"``: plain data parallel over ``torch.distributed`` (gloo): every step the gradients are
  flattened into one buffer and all-reduced (averaged) before AdamW steps: P parameters' bytes per step.
- ``sync="diloco"``: DiLoCo through torchft (``parallel/diloco.py``): inner AdamW steps on local data, one
  pseudo-gradient all-reduce every H steps (P bytes per H steps); ``adaptive=True`` adds AdLoCo's
  per-worker norm-test batch growth with gradient accumulation past ``max_micro_batch``.

``objective="lm"`` (pre-training): the text is generated locally (no downloads): lines ``a+b=c`` with a,
b uniform in 0..999, joined into one stream; each worker draws windows of ``seq_len`` characters from
its own stream (seeded by rank), and the held-out loss is measured on a stream from a seed no worker
trains on. ``objective="sft"``: the supervised warm start's examples and loss (``stages/warm_start.py``) on a
task's reference answers, held out on the task's eval prompts.

Launch (each process is one worker; rank 0 starts a torchft lighthouse in-process unless
``TORCHFT_LIGHTHOUSE`` names one, which a fault-tolerant run should: a torchrun job dies with any rank)::

    torchrun --nproc_per_node 2 -m tidal.stages.pretrain --set sync=diloco --set diloco.sync_every=50
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tidal.config import apply_overrides
from tidal.models import tiny
from tidal.optim.rules import check_optim
from tidal.parallel.diloco import (
    AdaptiveBatchConfig,
    DiLoCoConfig,
    accumulate_gradients,
    diloco_worker,
    micro_batch_sizes,
    norm_test_batch_size,
    start_lighthouse,
)
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig
from tidal.tasks.supervised import sft_batch


@dataclass
class PretrainConfig:
    """One pre-training run; every worker gets the same config."""

    objective: str = "lm"
    """lm: next-token loss on generated ``a+b=c`` text (pre-training); sft: the supervised warm start's
    loss (``stages/warm_start.py``: reference answers of ``task``, answer tokens only)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task ``objective=sft`` trains on."""
    sync: str = "diloco"
    """none | dp (all-reduce gradients every step) | diloco (pseudo-gradients every H steps, torchft)."""
    steps: int = 500
    """Inner (optimizer) steps per worker; DiLoCo needs a multiple of ``diloco.sync_every``."""
    batch_size: int = 16
    """Windows per worker per step (``adaptive_batch.initial_batch`` instead when ``adaptive``)."""
    seq_len: int = 64
    lr: float = 3e-3
    """Inner AdamW learning rate (DiLoCo's inner optimizer is AdamW; Sec. 3)."""
    weight_decay: float = 0.1
    """DiLoCo's inner AdamW weight decay (their Table 5 setup)."""
    adaptive: bool = False
    """AdLoCo: grow each worker's batch by the norm test (``adaptive_batch``); only with sync=diloco."""
    eval_windows: int = 256
    seed: int = 0
    out: str = ""
    """Where rank 0 writes its result JSON (empty: print it)."""
    model: tiny.ModelConfig = field(default_factory=lambda: tiny.ModelConfig(
        hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=256))
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    adaptive_batch: AdaptiveBatchConfig = field(default_factory=AdaptiveBatchConfig)

    def __post_init__(self):
        if self.objective not in ("lm", "sft"):
            raise ValueError(f"objective must be lm or sft, got {self.objective!r}")
        if self.sync not in ("none", "dp", "diloco"):
            raise ValueError(f"sync must be none, dp or diloco, got {self.sync!r}")
        if self.adaptive and self.sync != "diloco":
            raise ValueError("adaptive=true needs sync=diloco")
        check_optim(self, "")  # lr, weight_decay: RL's optim.* rules (optim/rules.py), named as this config's keys


def text_stream(seed: int, num_chars: int) -> torch.Tensor:
    """Token ids of ``a+b=c`` lines (a, b uniform in 0..999), at least ``num_chars`` long."""
    tok = tiny.build_tokenizer()
    g = torch.Generator().manual_seed(seed)
    ab = torch.randint(0, 1000, (num_chars // 8 + 1, 2), generator=g).tolist()
    text = "".join(f"{a}+{b}={a + b}\n" for a, b in ab)
    return torch.tensor(tok(text, add_special_tokens=False).input_ids)


def windows(stream: torch.Tensor, n: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len, (n,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


Batch = dict[str, torch.Tensor]
"""Keyword arguments of the model's forward, every tensor with the batch first; ``labels`` included."""


def lm_data(cfg: PretrainConfig, rank: int) -> tuple[Callable[[int], Batch], Batch]:
    """(draw n windows of this worker's stream, the held-out windows): next-token loss on every token."""
    stream = text_stream(cfg.seed * 1000 + rank, 400_000)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)

    def sample(n: int) -> Batch:
        ids = windows(stream, n, cfg.seq_len, gen)
        return {"input_ids": ids, "labels": ids}

    held = windows(text_stream(10_000 + cfg.seed, 200_000), cfg.eval_windows, cfg.seq_len,
                   torch.Generator().manual_seed(1))
    return sample, {"input_ids": held, "labels": held}


def sft_data(cfg: PretrainConfig, rank: int) -> tuple[Callable[[int], Batch], Batch]:
    """The supervised warm start's examples (``stages/warm_start.py``: answer tokens only) of ``cfg.task``; each
    worker draws its own prompts; held out: the task's first ``eval_windows`` eval prompts."""
    tok = tiny.build_tokenizer()
    task = TASKS.get(cfg.task.name)(cfg.task)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)

    def sample(n: int) -> Batch:
        idx = torch.randint(0, task.num_train, (n,), generator=gen).tolist()
        ids, attn, labels = sft_batch(tok, task, [task.train_prompt(i) for i in idx])
        return {"input_ids": ids, "attention_mask": attn, "labels": labels}

    ids, attn, labels = sft_batch(tok, task, task.eval_prompts()[: cfg.eval_windows])
    return sample, {"input_ids": ids, "attention_mask": attn, "labels": labels}


def loss_of(model: torch.nn.Module, batch: Batch, start: int = 0, stop: int | None = None) -> torch.Tensor:
    return model(**{k: v[start:stop] for k, v in batch.items()}).loss


@torch.no_grad()
def eval_loss(model: torch.nn.Module, held_out: Batch) -> float:
    return float(loss_of(model, held_out))


def allreduce_grads(model: torch.nn.Module, world: int) -> int:
    """Average gradients over the default process group in one flat buffer; returns bytes sent."""
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return flat.numel() * flat.element_size()


def _lighthouse_addr(rank: int, world: int):
    """rank 0 hosts a lighthouse unless TORCHFT_LIGHTHOUSE is set; the address travels in torchrun's store.
    Its quorum needs all ``world`` workers (a torchrun job is all or nothing anyway), so a rank that starts
    a little late is not left out of the first round."""
    if os.environ.get("TORCHFT_LIGHTHOUSE"):
        return os.environ["TORCHFT_LIGHTHOUSE"], None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    if rank == 0:
        server = start_lighthouse(min_replicas=world)
        store.set("tidal/lighthouse", server.address())
        return server.address(), server
    return store.get("tidal/lighthouse").decode(), None


def train(cfg: PretrainConfig) -> dict:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if cfg.sync == "diloco" and cfg.steps % cfg.diloco.sync_every:
        raise ValueError(f"steps ({cfg.steps}) must be a multiple of diloco.sync_every ({cfg.diloco.sync_every})")
    model = tiny.build_model(cfg.model, tiny.build_tokenizer()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sample, held_out = (lm_data if cfg.objective == "lm" else sft_data)(cfg, rank)
    lighthouse, bytes_sent = None, 0
    if cfg.sync == "dp":
        dist.init_process_group("gloo")
        ctx = nullcontext((None, None))
    elif cfg.sync == "diloco":
        addr, lighthouse = _lighthouse_addr(rank, world)
        ctx = diloco_worker(model, opt, cfg.diloco, addr, f"worker{rank}")
    else:
        ctx = nullcontext((None, None))
    batch = cfg.adaptive_batch.initial_batch if cfg.adaptive else cfg.batch_size
    examples, batches, start = 0, [], time.perf_counter()
    with ctx as (manager, stats):
        for _ in range(cfg.steps):
            rows = sample(batch)
            opt.zero_grad(set_to_none=True)
            if cfg.adaptive:
                sizes = micro_batch_sizes(batch, cfg.adaptive_batch.max_micro_batch)
                _, micro = accumulate_gradients(model, lambda a, b, rows=rows: loss_of(model, rows, a, b), sizes)
                batch = norm_test_batch_size(micro, sizes, cfg.adaptive_batch, batch)
            else:
                loss_of(model, rows).backward()
            examples += len(rows["input_ids"])
            batches.append(len(rows["input_ids"]))
            if cfg.sync == "dp":
                bytes_sent += allreduce_grads(model, world)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        rounds = manager.current_step() if manager is not None else None
    seconds = time.perf_counter() - start
    if stats is not None:
        bytes_sent = stats.bytes_sent
    result = {"objective": cfg.objective, "sync": cfg.sync, "adaptive": cfg.adaptive, "rank": rank,
              "world": world, "steps": cfg.steps, "eval_loss": eval_loss(model.eval(), held_out),
              "bytes_sent": bytes_sent, "examples": examples, "final_batch": batches[-1], "rounds": rounds,
              "train_s": seconds, "params": sum(p.numel() for p in model.parameters())}
    if cfg.sync == "dp":
        dist.destroy_process_group()
    if lighthouse is not None:
        time.sleep(1.0)  # let the other workers finish their last quorum before the lighthouse goes
        lighthouse.shutdown()
    return result


def main(argv: list[str]) -> None:
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    try:
        cfg = apply_overrides(PretrainConfig(), sets)
        for part in (cfg, cfg.diloco, cfg.adaptive_batch):  # overrides bypass __init__: validate again
            part.__post_init__()
    except ValueError as e:  # a bad key or value (ConfigError is one): one line, exit 2, as the other stages
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    result = train(cfg)
    if result["rank"] == 0:
        text = json.dumps(result)
        if cfg.out:
            with open(cfg.out, "w") as f:
                f.write(text)
        else:
            print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
