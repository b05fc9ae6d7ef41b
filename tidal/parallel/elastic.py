"""Elastic data-parallel training over torchft: when a rank dies the survivors redo the step without it.

Every step, each live replica joins a torchft quorum (``Manager.start_quorum``; a lighthouse drops a
replica that stops heart-beating), takes its share of the step's *whole* batch (whole rows, balanced by
tokens over the ``num_participants`` live replicas, ``distributed.split_groups``), and computes

    loss_r = sum over its rows' loss tokens of  -log p(token)  /  N

with N the loss-token count of the whole batch, the same on every replica. The gradients are
all-reduced by *sum*, so sum_r grad loss_r = grad of the whole batch's per-token mean loss, exactly the
1-process gradient, for any number of live replicas: the per-token normalisation does not depend on
the world size (an average over replicas would weigh tokens by 1 / (n x rows per replica) and change
when one dies). Then ``should_commit``: if a replica died during the step, the all-reduce failed, every
survivor gets False, and the step is run again on the next quorum, split over fewer replicas. The batch
of step k is a function of k alone (seeded), so nothing is lost and nothing is trained twice.

A replica that (re)starts is behind the quorum's step: torchft sends it the current weights and
optimizer state from a live peer (``Manager(load_state_dict=..., state_dict=...)``, its HTTP checkpoint
transport) before it takes part (``use_async_quorum=False``: it heals inside ``start_quorum``), and it
continues with the quorum's step number, hence the quorum's batches.

Gemini 2.5 reports slice-granularity elasticity keeping ~97% of throughput through failures. Here
the cost of a death is the heartbeat timeout plus the failed step (``tidal bench faults`` measures it).

This module is the training loop of one replica on the supervised objective (``stages/warm_start.py``'s
answer-only loss on a task; accuracy = every answer token the argmax, which is greedy decoding's answer):

    torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 1 --join_timeout_ms 2000 &
    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA=0 python -m tidal.parallel.elastic --set steps=200 &
    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA=1 python -m tidal.parallel.elastic --set steps=200 &

The RL ``Trainer`` itself runs the same scheme in ``parallel/elastic_dp.py`` (every algorithm's loss, the
trainer's global denominators); what is not elastic yet is the torchrun launch of the RL controller's
ranks: a torchrun FSDP job stops when a rank dies (docs/faults.md says what is missing).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tidal.config import apply_overrides
from tidal.models import tiny
from tidal.parallel.fsdp import split_groups
from tidal.parallel.replica_group import replica_group
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig
from tidal.tasks.supervised import sft_batch


@dataclass
class ElasticConfig:
    """One elastic replica; every replica gets the same config."""

    task: TaskConfig = field(default_factory=lambda: TaskConfig(max_operand=99))
    """The task whose reference answers are trained on (2-digit addition)."""
    model: tiny.ModelConfig = field(default_factory=lambda: tiny.ModelConfig(
        hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=256))
    """The tiny model every replica builds from the same seed."""
    steps: int = 200
    """Committed optimizer steps to train (the quorum's step count)."""
    batch_size: int = 64
    """Examples per step, over all live replicas together (the whole batch the loss is normalised over)."""
    lr: float = 3e-3
    """AdamW learning rate (betas 0.9, 0.95)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip, applied to the summed gradient."""
    seed: int = 0
    """Seeds every step's batch (the same on every replica)."""
    num_eval: int = 200
    """Held-out prompts of the final greedy accuracy."""
    min_replicas: int = 1
    """Fewest live replicas a step needs; 1 lets a lone survivor keep training."""
    timeout_s: float = 10.0
    """All-reduce / healing timeout: a dead peer's all-reduce fails after at most this."""
    quorum_timeout_s: float = 60.0
    out: str = ""
    """Where to write this replica's result JSON (empty: print it); ``<out>.progress`` gets one line per
    committed step (the benchmark watches it)."""


def step_batch(cfg: ElasticConfig, task, tokenizer, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole batch of step ``step``: the same on every replica (a function of seed and step only)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    idx = torch.randint(0, task.num_train, (cfg.batch_size,), generator=gen).tolist()
    return sft_batch(tokenizer, task, [task.train_prompt(i) for i in idx])


def my_rows(labels_bt: torch.Tensor, num_parts: int, part: int) -> list[int]:
    """This replica's rows: whole rows dealt over ``num_parts`` replicas, balanced by loss tokens."""
    counts = (labels_bt[:, 1:] != -100).sum(-1).tolist()
    return split_groups(list(range(len(counts))), counts, num_parts)[part]


def loss_share(model: torch.nn.Module, batch: tuple, rows: list[int]) -> tuple[torch.Tensor, int]:
    """(sum of -log p over ``rows``' loss tokens / the WHOLE batch's loss-token count, that count)."""
    ids, attn, labels = batch
    total = int((labels[:, 1:] != -100).sum())
    if not rows:
        return sum(p.sum() for p in model.parameters()) * 0.0, total  # no rows: a zero gradient, same shapes
    index = torch.tensor(rows)
    logits = model(input_ids=ids[index], attention_mask=attn[index]).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[index][:, 1:].reshape(-1),
                          ignore_index=-100, reduction="sum")
    return nll / max(total, 1), total


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, batch: tuple) -> float:
    """Fraction of rows whose every answer token is the argmax given the right prefix: greedy decoding's
    answer is then exactly the reference."""
    ids, attn, labels = batch
    pred = model(input_ids=ids, attention_mask=attn).logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    mask = target != -100
    return float(((pred == target) | ~mask).all(-1).float().mean())


@contextmanager
def elastic_manager(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: ElasticConfig,
                    lighthouse_addr: str, replica_id: str) -> Iterator[object]:
    """A torchft Manager for one replica (its own replica group of one process), healing from a peer."""
    with replica_group(lambda: {"model": model.state_dict(), "opt": optimizer.state_dict()},
                       lambda sd: (model.load_state_dict(sd["model"]), optimizer.load_state_dict(sd["opt"])),
                       lighthouse_addr, replica_id, cfg.timeout_s, cfg.quorum_timeout_s, cfg.min_replicas) as manager:
        yield manager


def elastic_step(manager, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch_of,
                 grad_clip: float) -> dict[str, float]:
    """One attempt at the quorum's current step; ``committed`` 0 means it must be run again.
    ``batch_of(step)`` is the whole batch of a step: it is asked for *after* the quorum, because a replica
    that has just healed from a peer jumps to the quorum's step there and must train that step's rows."""
    from torch.distributed import ReduceOp

    manager.start_quorum()
    step = manager.current_step()
    batch = batch_of(step)
    n, rank = manager.num_participants(), manager.participating_rank()
    optimizer.zero_grad(set_to_none=False)
    rows = my_rows(batch[2], n, rank) if rank is not None else []
    loss, _ = loss_share(model, batch, rows)
    loss.backward()
    params = [p for p in model.parameters()]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    loss_t = loss.detach().reshape(1).clone()
    manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
    manager.allreduce(loss_t, reduce_op=ReduceOp.SUM).wait()
    committed = manager.should_commit()
    if committed:
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
    return {"committed": float(committed), "participants": float(n), "loss": float(loss_t), "step": float(step)}


def train(cfg: ElasticConfig, replica: int, lighthouse_addr: str) -> dict:
    tokenizer = tiny.build_tokenizer()
    task = TASKS.get(cfg.task.name)(cfg.task)
    model = tiny.build_model(cfg.model, tokenizer).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    eval_batch = sft_batch(tokenizer, task, task.eval_prompts()[: cfg.num_eval])
    attempts = failed = 0
    participants: list[int] = []
    start = time.perf_counter()
    progress = open(cfg.out + ".progress", "a") if cfg.out else None
    with elastic_manager(model, optimizer, cfg, lighthouse_addr, f"replica{replica}") as manager:
        while manager.current_step() < cfg.steps:
            info = elastic_step(manager, model, optimizer, lambda k: step_batch(cfg, task, tokenizer, k), cfg.grad_clip)
            step = int(info["step"])
            attempts += 1
            failed += info["committed"] == 0.0
            participants.append(int(info["participants"]))
            if progress is not None and info["committed"]:
                progress.write(json.dumps({"step": step + 1, "t": time.perf_counter() - start,
                                           "participants": int(info["participants"]), "loss": info["loss"]}) + "\n")
                progress.flush()
    seconds = time.perf_counter() - start
    if progress is not None:
        progress.close()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"replica": replica, "steps": cfg.steps, "attempts": attempts, "failed_attempts": failed,
            "min_participants": min(participants), "seconds": seconds,
            "accuracy": greedy_accuracy(model.eval(), eval_batch), "param_sum": float(params.double().sum()),
            "param_bits": int(params.view(torch.int32).to(torch.int64).sum())}


def main(argv: list[str]) -> None:
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    cfg = apply_overrides(ElasticConfig(), sets)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    result = train(cfg, int(os.environ.get("REPLICA", 0)), os.environ["TORCHFT_LIGHTHOUSE"])
    text = json.dumps(result)
    if cfg.out:
        with open(cfg.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
