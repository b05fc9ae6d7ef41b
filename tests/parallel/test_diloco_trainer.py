"""``trainer.data_parallel=diloco``: the RL trainer's ranks as DiLoCo workers (``parallel/diloco_trainer.py``).

- The config switch is validated with an error naming the key (fast, default suite).
- Two gloo processes run the run's protocol (rank 0 a ``LeaderTrainer``, rank 1 ``follow``) with
  ``DiLoCoTrainer``: after each sync both ranks hold the same parameters, equal to the hand-written outer
  step (``outer_step_reference``) applied to two plain 1-process trainers that each trained on their own
  share of the groups (own denominators), including a batch with one group, where rank 1 has nothing.
  After every round the ranks' weights agree bit for bit (the replica check finds nothing), and a bit
  flipped on rank 1 right after a round's outer update is found there, naming the layer (slow).
- ``tidal train quickstart`` under torchrun with DiLoCo finishes and logs the bytes and sync count (slow).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from tests.parallel.test_diloco import load_params
from tests.parallel.test_fsdp import _free_port, join_group, make_batch, spawn
from tidal.cli import main
from tidal.config import ConfigError
from tidal.parallel.diloco import outer_step_reference, pseudo_gradient
from tidal.train.config import TrainerConfig, validate

needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                   reason="torchft not installed (pip install -e '.[dev]')")


def test_config_errors_name_the_key(tmp_path):
    bad = TrainerConfig()
    bad.data_parallel = "ddp"  # as an override sets it: no __init__
    with pytest.raises(ConfigError, match="trainer.data_parallel must be fsdp, diloco or elastic, got 'ddp'"):
        validate(bad)
    bad = TrainerConfig(data_parallel="diloco")
    bad.diloco.sync_every = 0
    with pytest.raises(ConfigError, match=r"trainer\.diloco\.sync_every must be >= 1"):
        validate(bad)
    validate(TrainerConfig(data_parallel="diloco"))
    # the command line stops before any work, naming the key
    assert main(["train", "quickstart", "--out", str(tmp_path / "run"), "--set", "trainer.data_parallel=ddp"]) == 2


# ---- two processes, the run's protocol ------------------------------------------------------------
H = 2
BATCHES = [dict(seed=1), dict(seed=2), dict(seed=3, group_sizes=(4,)), dict(seed=4)]
"""Two rounds of H=2; the third batch has one group, so rank 1 takes an empty inner step."""


def _trainer():
    from tidal.algo.config import AlgoConfig
    from tidal.models import tiny
    from tidal.optim import OptimConfig
    from tidal.train.trainer import Trainer

    torch.manual_seed(0)
    cfg = tiny.ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64)
    return Trainer(tiny.build_model(cfg, tiny.build_tokenizer()), AlgoConfig(),
                   OptimConfig(lr=3e-3, warmup_steps=0), TrainerConfig())


FLIPPED = "model.layers.1.mlp.up_proj.weight"
"""The parameter whose bit rank 1 flips right after round 1's outer update (``flip``)."""


def _flip_after_first_sync(worker) -> None:
    """Fault injection on this rank: the first inner step that ends after round 1 flips bit 20 of one weight
    (a post-step hook registered after DiLoCo's, which runs the sync): what a corrupted outer update on
    this worker leaves behind."""
    from tidal.integrity.faults import flip_bit

    done = []

    def hook(*_):
        if not done and worker.manager.current_step() == 1:
            flip_bit(dict(worker.trainer.model.named_parameters())[FLIPPED].data, 5, 20)
            done.append(True)

    worker.trainer.optimizer.register_step_post_hook(hook)


def _worker(rank: int, world: int, port: int, out: str, outer: tuple[float, float], flip: bool = False) -> None:
    from tidal.parallel.diloco import DiLoCoConfig, start_lighthouse
    from tidal.parallel.diloco_trainer import DiLoCoTrainer, broadcast_weights
    from tidal.parallel.fsdp import LeaderTrainer, follow, teardown

    dp = join_group(rank, world, port)
    lighthouse = start_lighthouse(min_replicas=world) if rank == 0 else None
    addr = dp.broadcast(lighthouse.address() if lighthouse else None)
    trainer = _trainer()
    broadcast_weights(trainer.model)
    cfg = DiLoCoConfig(sync_every=H, outer_lr=outer[0], outer_momentum=outer[1], timeout_s=30)
    worker = DiLoCoTrainer(trainer, cfg, dp, addr)
    if flip and rank == 1:
        _flip_after_first_sync(worker)
    metrics = []
    try:
        if rank == 0:
            lead = LeaderTrainer(worker)
            metrics = [lead.step(make_batch(**kw)) for kw in BATCHES]
            lead.close()
        else:
            follow(worker)
    finally:
        worker.close()
        if lighthouse is not None:
            lighthouse.shutdown()
        teardown()
    torch.save({"params": [p.detach() for p in trainer.model.parameters()], "metrics": metrics,
                "version": trainer.version, "incidents": worker.incidents}, Path(out) / f"rank{rank}.pt")


@pytest.mark.slow
@needs_torchft
@pytest.mark.parametrize("outer", [(0.7, 0.9), (1.0, 0.0)], ids=["nesterov", "averaging"])
def test_two_ranks_match_the_reference_outer_step(tmp_path, outer):
    """The paper's outer Nesterov step, and plain model averaging (outer lr 1, no momentum)."""
    from tidal.parallel.diloco_trainer import rows_of
    from tidal.parallel.fsdp import split_groups

    spawn(_worker, 2, (_free_port(), str(tmp_path), outer), timeout_s=180)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # two independent 1-process trainers, each on its own groups, then the outer step by hand
        replicas = [_trainer() for _ in (0, 1)]
        theta = [p.detach().clone() for p in replicas[0].model.parameters()]
        start, momentum = [t.clone() for t in theta], None
        for r in range(len(BATCHES) // H):
            for kw in BATCHES[r * H : (r + 1) * H]:
                batch = make_batch(**kw)
                parts = split_groups(batch.group_index_b.tolist(), batch.attention_mask_bt.sum(-1).tolist(), 2)
                for part, replica in zip(parts, replicas):
                    if part:  # an empty share moves nothing (AdamW skips parameters without a gradient)
                        replica.step(rows_of(batch, part))
            deltas = [pseudo_gradient(theta, [p.detach() for p in rep.model.parameters()]) for rep in replicas]
            theta, momentum = outer_step_reference(theta, deltas, momentum, lr=outer[0], mu=outer[1])
            for rep in replicas:
                load_params(rep.model, theta)
    finally:
        torch.set_num_threads(threads)
    assert max((t - s).abs().max() for t, s in zip(theta, start)) > 1e-3, "the run should move the weights"
    for g in got:
        assert g["version"] == len(BATCHES)
        for have, want in zip(g["params"], theta):
            assert torch.allclose(have, want, atol=1e-5), (have - want).abs().max()
    num_params = sum(t.numel() for t in theta)
    syncs = [m["perf/diloco_syncs"] for m in got[0]["metrics"]]
    assert syncs == [0.0, 1.0, 1.0, 2.0]
    assert got[0]["metrics"][-1]["perf/diloco_bytes"] == 2 * num_params * 4, "one fp32 all-reduce per round"
    # after each round both ranks hold the same weights bit for bit: the replica check finds nothing
    assert [m["diloco/replica_mismatches"] for m in got[0]["metrics"]] == [0.0] * len(BATCHES)
    assert got[0]["incidents"] == got[1]["incidents"] == []


@pytest.mark.slow
@needs_torchft
def test_a_flip_on_one_rank_after_a_sync_is_found_and_named(tmp_path):
    """Rank 1's weights are corrupted right after round 1's outer update: the post-sync comparison names
    rank 1 and the layer, on both ranks, at round 1."""
    from tidal.integrity.sdc import layer_of

    spawn(_worker, 2, (_free_port(), str(tmp_path), (0.7, 0.9), True), timeout_s=180)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    want = {"round": 1, "entry": layer_of(FLIPPED), "ambiguous": True, "ranks": [0, 1]}  # 2 ranks: a tie
    for g in got:
        assert g["incidents"][0] == want, g["incidents"]
    assert got[0]["metrics"][1]["diloco/replica_mismatches"] >= 1.0


# ---- the command line under torchrun ---------------------------------------------------------------
@pytest.mark.slow
@needs_torchft
def test_tidal_train_under_torchrun_with_diloco(tmp_path):
    from tests.launch.test_torchrun import _torchrun
    from tests.system.test_controller import TINY_OVERRIDES
    from tidal.models import tiny

    settings = [*TINY_OVERRIDES(tmp_path), "model.num_layers=2", "max_steps=4", "trainer.data_parallel=diloco",
                "trainer.diloco.sync_every=2", "system.mode=sync", "rollout.max_staleness=0"]
    out = tmp_path / "run"
    done = _torchrun("quickstart_grpo", "--out", str(out), *[x for s in settings for x in ("--set", s)])
    assert done.stdout.count('"steps": 4') == 1  # rank 0 alone reports
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "perf/diloco_bytes" in r]
    assert trained, "rank 0 logs the DiLoCo metrics with every trained step"
    last = trained[-1]
    model = tiny.load(out / "checkpoints" / "step_4")[0]  # rank 0's replica, 1-process layout
    num_params = sum(p.numel() for p in model.parameters())
    assert last["perf/diloco_syncs"] >= 1
    assert last["perf/diloco_bytes"] == last["perf/diloco_syncs"] * num_params * 4


def test_quiet_torchft_keeps_a_user_setting(monkeypatch):
    from tidal.parallel.replica_group import quiet_torchft

    monkeypatch.delenv("RUST_LOG", raising=False)
    quiet_torchft()
    assert os.environ["RUST_LOG"] == "warn"
    monkeypatch.setenv("RUST_LOG", "debug")
    quiet_torchft()
    assert os.environ["RUST_LOG"] == "debug"
