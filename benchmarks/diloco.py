"""DiLoCo vs plain data parallel on a small LM: bytes communicated and held-out loss after equal steps.

Two gloo processes (torchrun, one thread each) pre-train the same tiny Qwen2 (hidden 64, 2 layers,
~135k parameters) next-token on locally generated ``a+b=c`` text (``tidal/stages/pretrain.py``), each
worker on its own stream, for the same number of optimizer steps at the same per-worker batch:

- ``data parallel``: gradients all-reduced every step (one flat fp32 buffer);
- ``DiLoCo H=...``: torchft DiLoCo, inner AdamW, outer Nesterov SGD (lr 0.7, momentum 0.9), one
  pseudo-gradient all-reduce every H steps;
- ``DiLoCo H=... + AdLoCo``: the same with the norm-test batch growth (it sees more examples; its
  ``examples`` column says how many).

Bytes are the payload each worker hands to all-reduce (``bytes_sent``; what a ring all-reduce moves per
worker is ~2x that for both arms alike, so the ratio is the same). ``loss gap`` is the arm's held-out
loss minus data parallel's, averaged over ``seeds`` (the per-seed gaps are in ``gap_per_seed``: at this
size seed-to-seed noise is a few hundredths). The arms run one after the other on a shared machine;
time is not the point.

    tidal bench diloco [--set steps=500 --set sync_every=[50,250] --set adaptive_h=50 --set seeds=[0,1]]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path

from tidal.config import apply_overrides

DESCRIPTION = "DiLoCo (torchft, 2 gloo workers) vs per-step data parallel: bytes sent and held-out loss, equal steps"


@dataclass
class Settings:
    steps: int = 500
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    nproc: int = 2
    sync_every: list[int] = field(default_factory=lambda: [50, 250])
    """DiLoCo arms' H (each must divide ``steps``)."""
    adaptive_h: int = 50
    """H of the DiLoCo + AdLoCo arm (0 skips it)."""
    max_micro_batch: int = 16
    """AdLoCo arm's largest pass: a batch above it accumulates (switch mode)."""
    max_batch: int = 32
    """AdLoCo arm's cap on the grown batch (2x the initial one keeps the run short)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    """Each arm runs once per seed (model init and every worker's data); the table averages them."""


def _launch(s: Settings, sets: list[str], seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        common = [f"steps={s.steps}", f"batch_size={s.batch_size}", f"seq_len={s.seq_len}", f"lr={s.lr}",
                  f"seed={seed}", f"model.init_seed={seed}", f"out={out}"]
        argv = [a for kv in [*common, *sets] for a in ("--set", kv)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={s.nproc}",
               "-m", "tidal.stages.pretrain", *argv]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def run(overrides: list[str], out_dir: Path) -> dict:
    s = apply_overrides(Settings(), overrides)
    arms = [("data parallel", ["sync=dp"])]
    arms += [(f"DiLoCo H={h}", ["sync=diloco", f"diloco.sync_every={h}"]) for h in s.sync_every]
    if s.adaptive_h:
        arms.append((f"DiLoCo H={s.adaptive_h} + AdLoCo", [
            "sync=diloco", f"diloco.sync_every={s.adaptive_h}", "adaptive=true",
            f"adaptive_batch.initial_batch={s.batch_size}", f"adaptive_batch.max_micro_batch={s.max_micro_batch}",
            f"adaptive_batch.max_batch={s.max_batch}"]))
    runs = {name: [_launch(s, sets, seed) for seed in s.seeds] for name, sets in arms}
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)
    dp = runs["data parallel"]
    table = [{"arm": name, "steps": rs[0]["steps"], "rounds": rs[0]["rounds"] or rs[0]["steps"],
              "MB_sent_per_worker": rs[0]["bytes_sent"] / 2**20,
              "bytes_ratio_vs_dp": dp[0]["bytes_sent"] / rs[0]["bytes_sent"],
              "eval_loss": mean(rs, "eval_loss"), "loss_gap_vs_dp": mean(rs, "eval_loss") - mean(dp, "eval_loss"),
              "gap_per_seed": " ".join(f"{r['eval_loss'] - d['eval_loss']:+.3f}" for r, d in zip(rs, dp)),
              "examples_per_worker": mean(rs, "examples"), "final_batch": rs[0]["final_batch"],
              "train_s": mean(rs, "train_s")}
             for name, rs in runs.items()]
    return {"settings": {f.name: getattr(s, f.name) for f in fields(s)}, "params": dp[0]["params"],
            "workers": s.nproc, "runs": runs, "table": table}
