"""FSDP2 on gloo with a mixture-of-experts model (issue 52): two processes train the tiny Qwen3-MoE exactly like
one process on the same global batch (its fused 3-D expert weights sharded on dim 0, the experts), LoRA on its
attention and experts too, and a
checkpoint the two write (gathered, saved in the Hub's per-expert layout) resumes in one process.

One spawn (2 ranks, 1 thread each) runs both; the 1-process reference runs here. The pattern is
``test_fsdp.py``'s, kept to one case and two steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel.test_fsdp import _free_port, assert_state_dicts_close, join_group, make_batch, spawn
from tidal.algo.config import AlgoConfig
from tidal.models import lora, tiny
from tidal.optim import OptimConfig
from tidal.parallel.fsdp import LOCAL, LeaderTrainer, follow, teardown
from tidal.train.checkpoint import TrainingState, save_checkpoint
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

STEPS = 2


def make_trainer(dp=LOCAL, lora_rank: int = 0) -> Trainer:
    """The tiny MoE, whole (lr 3e-3) or LoRA on attention and experts (rank 2, lr 3e-2, the same init everywhere)."""
    tok = tiny.build_tokenizer()
    cfg = tiny.ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, num_experts=4,
                           expert_intermediate_size=16)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = tiny.build_model(cfg, tok)
        if lora_rank:
            model = lora.wrap(model, lora.LoraConfig(rank=lora_rank))
    return Trainer(model, AlgoConfig(), OptimConfig(lr=3e-2 if lora_rank else 3e-3),
                   TrainerConfig(micro_batch_tokens=60), dp=dp)


def batches():
    return [make_batch(seed) for seed in range(STEPS)]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    dp = join_group(rank, world, port)
    out_dir = Path(out)
    try:
        trainer = make_trainer(dp)
        if rank == 0:
            lead = LeaderTrainer(trainer)
            metrics = [lead.step(b) for b in batches()[:1]]
            save_checkpoint(out_dir / "ckpt", lead.model, tiny.build_tokenizer(), lead.optimizer, lead.scheduler,
                            TrainingState(1, lead.version, 0, {}))
            metrics += [lead.step(b) for b in batches()[1:]]
            sd = lead.state_dict_for_engine()
            lead.close()
            torch.save({"metrics": metrics, "sd": sd}, out_dir / "moe.pt")
        else:
            follow(trainer)
        trainer = make_trainer(dp, lora_rank=2)
        if rank == 0:
            lead = LeaderTrainer(trainer)
            metrics = [lead.step(b) for b in batches()]
            sd = lead.state_dict_for_engine()
            lead.close()
            torch.save({"metrics": metrics, "sd": sd}, out_dir / "moe_lora.pt")
        else:
            follow(trainer)
    finally:
        teardown()


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_moe")
    spawn(_worker, 2, (_free_port(), str(out)), timeout_s=240)
    return out


def test_two_processes_train_an_moe_like_one(two_procs):
    got = torch.load(two_procs / "moe.pt", weights_only=False)
    ref = make_trainer()
    for step, batch in enumerate(batches()):
        want, have = ref.step(batch), got["metrics"][step]
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key, have[key], want[key])
    want_sd = ref.state_dict_for_engine()
    assert want_sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    assert_state_dicts_close(got["sd"], want_sd)


def test_two_processes_train_moe_lora_adapters_like_one(two_procs):
    """LoRA on attention and the experts (``ParamWrapper`` over sharded 3-D weights): the same adapter update."""
    pytest.importorskip("peft", reason="needs peft: pip install 'tidal[lora]'")
    got = torch.load(two_procs / "moe_lora.pt", weights_only=False)
    ref = make_trainer(lora_rank=2)
    for step, batch in enumerate(batches()):
        want, have = ref.step(batch), got["metrics"][step]
        assert have["train/loss"] == pytest.approx(want["train/loss"], rel=1e-4, abs=1e-6), step
    want_sd = ref.state_dict_for_engine()
    assert "model.layers.0.mlp.experts.gate_up_proj.lora_A" in want_sd
    assert_state_dicts_close(got["sd"], want_sd)


def test_a_two_process_moe_checkpoint_resumes_in_one(two_procs):
    """Written gathered from the shards in the Hub's per-expert layout, read back fused (``in_model_layout``)."""
    got = torch.load(two_procs / "moe.pt", weights_only=False)
    one = make_trainer()
    state = one.load_checkpoint(two_procs / "ckpt" / "step_1")
    assert state.step == 1
    one.step(batches()[1])
    assert_state_dicts_close(got["sd"], one.state_dict_for_engine())
    model, _ = tiny.load(two_procs / "ckpt" / "step_1")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
