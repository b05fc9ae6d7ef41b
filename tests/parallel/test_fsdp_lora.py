"""LoRA under FSDP2 (two gloo processes): the base frozen and sharded, the adapters trained, and the same
update, adapter sync and checkpoint as one process; the KL reference is the sharded policy with its
adapters disabled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tidal.algo.config import AlgoConfig
from tidal.models import lora, tiny
from tidal.optim import OptimConfig
from tidal.parallel.fsdp import LOCAL, LeaderTrainer, follow, teardown
from tidal.train.checkpoint import TrainingState, save_checkpoint
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer

from .test_fsdp import _free_port, assert_state_dicts_close, join_group, make_batch, spawn

pytest.importorskip("peft", reason="needs peft: pip install 'tidal[lora]'")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
STEPS = 3


def make_trainer(dp=LOCAL) -> Trainer:
    tok = tiny.build_tokenizer()
    cfg = tiny.ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the same adapters' init on every rank and in the reference
        model = lora.wrap(tiny.build_model(cfg, tok), lora.LoraConfig(rank=2))
    return Trainer(model, AlgoConfig(kl_coef=0.05), OptimConfig(lr=3e-2), TrainerConfig(micro_batch_tokens=40),
                   dp=dp)


def batches():
    return [make_batch(seed) for seed in range(STEPS)]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    dp = join_group(rank, world, port)
    out_dir = Path(out)
    try:
        trainer = make_trainer(dp)
        from torch.distributed.tensor import DTensor

        params = dict(trainer.model.named_parameters())
        assert all(isinstance(p, DTensor) for p in params.values()), "every weight sharded, base and adapters"
        assert all(p.requires_grad == (".lora_" in n) for n, p in params.items()), "the base frozen"
        tok = tiny.build_tokenizer() if rank == 0 else None
        b = batches()
        if rank == 0:
            lead = LeaderTrainer(trainer)
            metrics = [lead.step(b[0])]
            save_checkpoint(out_dir / "ckpt", lead.model, tok, lead.optimizer, lead.scheduler,
                            TrainingState(1, lead.version, 7, {}))
            metrics += [lead.step(batch) for batch in b[1:]]
            sd = lead.state_dict_for_engine()
            lead.close()
            torch.save({"metrics": metrics, "sd": sd, "sync": trainer.weight_sync_metrics}, out_dir / "lora.pt")
        else:
            follow(trainer)
        fresh = make_trainer(dp)  # every rank resumes the checkpoint rank 0 wrote
        fresh.load_checkpoint(out_dir / "ckpt" / "step_1")
        for batch in b[1:]:
            fresh.step(batch)
        resumed = fresh.state_dict_for_engine()
        if rank == 0:
            torch.save(resumed, out_dir / "resumed.pt")
        else:
            assert resumed == {}
    finally:
        teardown()


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_lora")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spawn(_worker, 2, (_free_port(), str(out)), timeout_s=240)
    finally:
        torch.set_num_threads(before)
    return out


def test_two_processes_train_the_same_adapters_as_one(two_procs):
    got = torch.load(two_procs / "lora.pt", weights_only=False)
    ref = make_trainer()
    for step, batch in enumerate(batches()):
        want = ref.step(batch)
        have = got["metrics"][step]
        for key in ("train/loss", "train/grad_norm", "algo/kl", "train/entropy"):
            assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key, have[key], want[key])
    want_sd = ref.state_dict_for_engine()
    assert lora.is_adapter_update(want_sd) and all(".lora_" in k for k in want_sd)
    assert_state_dicts_close(got["sd"], want_sd)
    assert got["sync"]["perf/weight_sync_bytes"] == ref.weight_sync_metrics["perf/weight_sync_bytes"] > 0


def test_a_sharded_lora_checkpoint_is_peft_layout_and_resumes_exactly(two_procs):
    ckpt = two_procs / "ckpt" / "step_1"
    assert (ckpt / lora.ADAPTER_CONFIG).exists() and not (ckpt / "model.safetensors").exists()
    got = torch.load(two_procs / "lora.pt", weights_only=False)
    assert_state_dicts_close(torch.load(two_procs / "resumed.pt", weights_only=False), got["sd"], atol=1e-6, rtol=1e-6)
    one = make_trainer()  # the 2-process checkpoint resumed by one process
    one.load_checkpoint(ckpt)
    for batch in batches()[1:]:
        one.step(batch)
    assert_state_dicts_close(one.state_dict_for_engine(), got["sd"])
