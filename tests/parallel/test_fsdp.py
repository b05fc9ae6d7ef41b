"""Two gloo processes with FSDP2 train exactly like one process on the same global batch.

One spawn (2 ranks, 1 thread each) runs every case and writes rank 0's results; the 1-process reference
runs here. The batch has an odd number of groups of different sizes, so the ranks get different numbers
of rows, tokens and micro-batches (the zero-weight passes that keep FSDP's collectives paired run).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tidal.algo.config import AlgoConfig
from tidal.models import tiny
from tidal.optim import OptimConfig
from tidal.parallel.fsdp import (
    FSDP,
    LOCAL,
    LeaderTrainer,
    follow,
    init_distributed,
    split_groups,
    teardown,
)
from tidal.train.checkpoint import TrainingState, save_checkpoint
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import TrainBatch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

STEPS = 3
CASES = {  # name: (algo, trainer[, optim]) settings
    # DAPO's token mean, one pass per minibatch
    "token_mean": ({}, {}),
    # AdEMAMix (optimizer state in DTensor shards) under a warm-up schedule
    "ademamix_warmup": ({}, {"micro_batch_tokens": 60}, {"name": "ademamix", "warmup_steps": 2}),
    # GRPO's sequence mean over greedy-collated micro-batches, with a KL loss against a (sharded) reference
    "seq_mean_micro_kl": ({"loss_agg": "seq_mean_token_mean", "kl_coef": 0.05}, {"micro_batch_tokens": 40}),
    # Magistral: group-length aggregation and per-minibatch advantages, decoupled PPO (proximal log-probs
    # from a sharded scoring pass), packed micro-batches, two minibatches
    "group_length_packed": ({"loss_agg": "group_length", "advantage": "magistral", "policy_loss": "decoupled_ppo"},
                            {"packing": True, "pack_tokens": 32, "micro_batch_tokens": 40, "num_minibatches": 2}),
    # VCPO's baseline (sequence importance weights from a sharded scoring pass) and ESS-scaled lr, TIS
    "vcpo_tis": ({"advantage": "vcpo", "correction": "tis", "ess_lr_scaling": True}, {"micro_batch_tokens": 30}),
    # sequence-level aggregation with packing and a batch-scope advantage (REINFORCE++)
    "seq_sum_packed": ({"loss_agg": "seq_mean_token_sum", "advantage": "reinforce_pp"},
                       {"packing": True, "pack_tokens": 48}),
    # each group as a prefix trie (through the FSDP root's forward), split into micro-batches of whole groups
    "prefix_shared": ({}, {"share_prefixes": True, "pack_tokens": 32, "micro_batch_tokens": 40}),
}


def make_batch(seed: int, group_sizes=(4, 3, 4, 2, 4)) -> TrainBatch:
    """An odd number of groups of different sizes, prompts of 3-6 and responses of 2-14 tokens."""
    g = torch.Generator().manual_seed(seed)
    b = sum(group_sizes)
    plen = torch.randint(3, 7, (b,), generator=g)
    rlen = torch.randint(2, 15, (b,), generator=g)
    width = int((plen + rlen).max())
    ids = torch.zeros((b, width), dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width))
    behav = torch.zeros((b, width))
    for r in range(b):
        p, n = int(plen[r]), int(rlen[r])
        ids[r, : p + n] = torch.randint(3, 50, (p + n,), generator=g)
        attn[r, : p + n] = 1
        mask[r, p : p + n] = 1.0
        behav[r, p : p + n] = -3.0 * torch.rand(n, generator=g) - 0.1
    versions = torch.where(mask > 0, 0, -1).long()
    group_index = torch.tensor([gi for gi, n in enumerate(group_sizes) for _ in range(n)])
    rewards = torch.randint(0, 2, (b,), generator=g).float()
    firsts = torch.tensor([0, *group_sizes[:-1]]).cumsum(0)
    rewards[firsts], rewards[firsts + 1] = 1.0, 0.0  # every group has a learning signal
    return TrainBatch(ids, attn, mask, behav, versions, group_index, rewards)


def make_trainer(case: str, dp=LOCAL) -> Trainer:
    algo_kw, trainer_kw, *rest = CASES[case]
    optim = OptimConfig(lr=3e-3, **(rest[0] if rest else {}))
    tok = tiny.build_tokenizer()
    cfg = tiny.ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64)
    model = tiny.build_model(cfg, tok)
    ref = tiny.build_model(cfg, tok) if algo_kw.get("kl_coef") else None
    return Trainer(model, AlgoConfig(**algo_kw), optim, TrainerConfig(**trainer_kw), ref_model=ref, dp=dp)


def batches() -> list[TrainBatch]:
    return [make_batch(seed) for seed in range(STEPS)]


def _worker(rank: int, world: int, port: int, out: str, ckpt_1proc: str) -> None:
    dp = join_group(rank, world, port)
    out_dir = Path(out)
    try:
        for case in CASES:  # the run's protocol: rank 0 leads, the other ranks follow
            trainer = make_trainer(case, dp)
            if rank == 0:
                lead = LeaderTrainer(trainer)
                metrics = []
                for batch in batches():
                    start = time.perf_counter()
                    metrics.append({**lead.step(batch), "step_s": time.perf_counter() - start})
                sd = lead.state_dict_for_engine()
                lead.close()
                torch.save({"metrics": metrics, "sd": sd, "sync": trainer.weight_sync_metrics,
                            "version": trainer.version}, out_dir / f"{case}.pt")
            else:
                follow(trainer)
        # checkpoints. Saved as the controller saves (rank 0 alone calls save_checkpoint on the leader's
        # model; the gather brings the followers in), resumed with every rank calling the same method.
        tok = tiny.build_tokenizer() if rank == 0 else None
        b0, b1, _ = batches()
        trainer = make_trainer("token_mean", dp)
        if rank == 0:
            lead = LeaderTrainer(trainer)
            lead.step(b0)
            save_checkpoint(out_dir / "ckpt", lead.model, tok, lead.optimizer, lead.scheduler,
                            TrainingState(1, lead.version, 7, {}))
            lead.step(b1)
            continued = lead.state_dict_for_engine()
            lead.close()
        else:
            follow(trainer)
        fresh = make_trainer("token_mean", dp)
        state = fresh.load_checkpoint(out_dir / "ckpt" / "step_1")
        fresh.step(b1)
        resumed = fresh.state_dict_for_engine()
        written = fresh.save_checkpoint(out_dir / "ckpt_spmd", tok, TrainingState(2, fresh.version, 9, {}))
        # a checkpoint written by one process, resumed by two
        other = make_trainer("token_mean", dp)
        other.load_checkpoint(ckpt_1proc)
        other.step(b1)
        from_1proc = other.state_dict_for_engine()
        if rank == 0:
            torch.save({"continued": continued, "resumed": resumed, "from_1proc": from_1proc, "written": written,
                        "state": state.__dict__, "version": fresh.version}, out_dir / "ckpt.pt")
        else:
            assert written is None and resumed == {} and from_1proc == {}
    finally:
        teardown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, world: int, port: int):
    """In a spawned worker: join the gloo group of ``world`` processes on ``port`` with one thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    return init_distributed(timeout_s=120)


def spawn(fn, world: int, args: tuple, timeout_s: float) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes; fail (and kill them) past the timeout."""
    ctx = mp.start_processes(fn, args=(world, *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"distributed workers still running after {timeout_s} s")


@pytest.fixture(autouse=True)
def _one_thread():
    """The workers use one thread each; the 1-process reference too (2 threads on a shared 2-core machine
    can be many times slower, FACTS.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    one = make_trainer("token_mean")
    one.step(batches()[0])
    one.save_checkpoint(out / "ckpt1", tiny.build_tokenizer(), TrainingState(1, one.version, 7, {}))
    spawn(_worker, 2, (_free_port(), str(out), str(out / "ckpt1" / "step_1")), timeout_s=240)
    return out


def assert_state_dicts_close(got: dict, want: dict, atol=2e-5, rtol=1e-4):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], atol=atol, rtol=rtol), f"{k}: max diff {(got[k] - want[k]).abs().max()}"


def test_split_keeps_groups_whole_and_balances_tokens():
    groups = [0, 0, 1, 1, 1, 2, 3, 3]
    lengths = [5, 5, 1, 1, 1, 20, 3, 3]
    parts = split_groups(groups, lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert parts == [[5], [0, 1, 2, 3, 4, 6, 7]]  # 20 tokens vs 19: the long group alone
    assert split_groups([0, 0, 1], [1, 1, 1], 3)[2] == []  # more ranks than groups: an empty part


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_match_one(two_procs, case):
    got = torch.load(two_procs / f"{case}.pt", weights_only=False)
    ref = make_trainer(case)
    for step, batch in enumerate(batches()):
        want = ref.step(batch)
        have = got["metrics"][step]
        for key in ("train/loss", "train/grad_norm", "train/lr", "train/entropy", "algo/adv_abs_mean", "algo/seq_ess",
                    "algo/lr_scale"):
            assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key, have[key], want[key])
    assert got["version"] == ref.version == STEPS
    want_sd = ref.state_dict_for_engine()
    assert_state_dicts_close(got["sd"], want_sd)
    assert "lm_head.weight" not in got["sd"]  # the tied head: gathered, sent once (as the embedding)
    unique = sum(p.numel() * p.element_size() for p in ref.model.parameters())
    assert got["sync"]["perf/weight_sync_bytes"] == ref.weight_sync_metrics["perf/weight_sync_bytes"] == unique


def test_muon_is_refused_under_fsdp():
    with pytest.raises(ValueError, match="muon"):
        Trainer(torch.nn.Linear(2, 2), AlgoConfig(), OptimConfig(name="muon"), TrainerConfig(),
                dp=FSDP(rank=0, world_size=2))


def test_checkpoint_resume_across_world_sizes(two_procs):
    got = torch.load(two_procs / "ckpt.pt", weights_only=False)
    assert got["state"] == {"step": 1, "version": 1, "next_group": 7, "extra": {}} and got["version"] == 2
    assert_state_dicts_close(got["resumed"], got["continued"], atol=1e-6, rtol=1e-6)
    # the 2-process checkpoint resumed by one process, and the 1-process one by two: all the same update
    one = make_trainer("token_mean")
    one.load_checkpoint(two_procs / "ckpt" / "step_1")
    one.step(batches()[1])
    assert_state_dicts_close(got["continued"], one.state_dict_for_engine())
    assert_state_dicts_close(got["from_1proc"], got["continued"])
    model, _ = tiny.load(two_procs / "ckpt" / "step_1")  # an ordinary Hugging Face directory
    assert got["written"] == two_procs / "ckpt_spmd" / "step_2" and (got["written"] / "trainer_state.pt").exists()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
