"""One process vs an FSDP data-parallel group (gloo, CPU) on the same batch: step time, weight gather.

The same RL batch (``num_groups`` groups of ``group_size`` sequences, response lengths uniform up to
``max_len``) trains from the same initial weights three ways:

- ``1 proc x 1 thread`` and ``1 proc x N threads``: the ordinary trainer;
- ``N procs x 1 thread``: ``nproc`` processes launched by torchrun (this file is their script), FSDP2
  over gloo, each rank training its share of the groups (``parallel/fsdp.py``).

Reported per arm: median step time (after one warm-up step), trained tokens/s, and the median time and
bytes of ``state_dict_for_engine`` (a clone in one process, an FSDP all-gather to rank 0 otherwise:
what the controller hands the rollout engine after every step). The FSDP arm's final weights are
checked against the 1-process ones (``max_param_diff``). The arms run one after the other, so on a
shared machine compare them only with the load averages printed beside them.

    tidal bench distributed [--set hidden_size=256 --set nproc=2 --set steps=5 ...]
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from tidal.algo.config import AlgoConfig
from tidal.config import apply_overrides
from tidal.models import tiny
from tidal.optim import OptimConfig
from tidal.parallel.fsdp import LOCAL, DataParallel, init_distributed, teardown
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import TrainBatch

DESCRIPTION = "1 process vs N FSDP processes (gloo): step time, tokens/s, weight gather time and bytes"


@dataclass
class Settings:
    hidden_size: int = 256
    num_layers: int = 4
    num_groups: int = 16
    group_size: int = 8
    prompt_len: int = 8
    max_len: int = 64
    micro_batch_tokens: int = 4096
    nproc: int = 2
    steps: int = 5
    seed: int = 0


def make_batch(s: Settings) -> TrainBatch:
    g = torch.Generator().manual_seed(s.seed)
    b = s.num_groups * s.group_size
    lengths = s.prompt_len + torch.randint(1, s.max_len - s.prompt_len + 1, (b,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(3, 50, (b, width), generator=g)
    attn = (torch.arange(width) < lengths[:, None]).long()
    mask = attn.float()
    mask[:, : s.prompt_len] = 0.0
    behav = -torch.rand(b, width, generator=g) * mask
    versions = torch.where(mask > 0, 0, -1).long()
    groups = torch.arange(s.num_groups).repeat_interleave(s.group_size)
    rewards = torch.randint(0, 2, (b,), generator=g).float()
    return TrainBatch(ids * attn, attn, mask, behav, versions, groups, rewards)


def make_trainer(s: Settings, dp: DataParallel = LOCAL) -> Trainer:
    tok = tiny.build_tokenizer()
    cfg = tiny.ModelConfig(hidden_size=s.hidden_size, num_layers=s.num_layers, num_heads=4, num_kv_heads=4,
                           intermediate_size=4 * s.hidden_size)
    return Trainer(tiny.build_model(cfg, tok), AlgoConfig(), OptimConfig(lr=1e-4),
                   TrainerConfig(micro_batch_tokens=s.micro_batch_tokens), dp=dp)


def measure(s: Settings, trainer: Trainer) -> tuple[dict, dict]:
    batch = make_batch(s)
    steps, gathers = [], []
    for _ in range(s.steps):
        start = time.perf_counter()
        trainer.step(batch)
        steps.append(time.perf_counter() - start)
        weights = trainer.state_dict_for_engine()
        gathers.append(trainer.weight_sync_metrics["perf/weight_gather_s"])
    step_s = statistics.median(steps[1:])
    row = {"step_s": step_s, "tokens_per_s": int(batch.attention_mask_bt.sum()) / step_s,
           "gather_s": statistics.median(gathers[1:]),
           "sync_mb": trainer.weight_sync_metrics["perf/weight_sync_bytes"] / 2**20}
    return row, weights


def _worker(settings_json: str, out: str) -> None:
    """One rank of the FSDP arm, under torchrun."""
    s = Settings(**json.loads(settings_json))
    torch.set_num_threads(1)
    dp = init_distributed(timeout_s=600)
    try:
        row, weights = measure(s, make_trainer(s, dp))
        if dp.rank == 0:
            torch.save((row, weights), out)
    finally:
        teardown()


def _launch(s: Settings) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.pt")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={s.nproc}",
               __file__, json.dumps(dataclasses.asdict(s)), out]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return torch.load(out, weights_only=False)


def run(overrides: list[str], out_dir: Path) -> dict:
    s = apply_overrides(Settings(), overrides)
    threads = torch.get_num_threads()
    table = []

    def arm(name, fn):
        load = os.getloadavg()[0]
        row, weights = fn()
        table.append({"arm": name, **row, "load_before": load, "load_after": os.getloadavg()[0]})
        return weights

    def single(n):
        torch.set_num_threads(n)
        return measure(s, make_trainer(s))

    reference = arm("1 proc x 1 thread", lambda: single(1))
    arm(f"1 proc x {s.nproc} threads", lambda: single(s.nproc))
    sharded = arm(f"{s.nproc} procs x 1 thread (FSDP)", lambda: _launch(s))
    torch.set_num_threads(threads)
    diff = max((sharded[k] - reference[k]).abs().max().item() for k in reference)
    params = sum(p.numel() for p in make_trainer(s).model.parameters())
    return {"settings": {f.name: getattr(s, f.name) for f in fields(s)}, "params": params,
            "max_param_diff": diff, "table": table}


if __name__ == "__main__":
    _worker(*sys.argv[1:])
