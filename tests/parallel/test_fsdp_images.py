"""FSDP2 on gloo with a vision-language policy (issue 54): two processes train the tiny Qwen2-VL exactly like one
process on the same batch of pictures and text (padded, packed and prefix-trie layouts, micro-batched), the image
view running inside the FSDP root's forward (``LogprobModule.forward(..., images=)``: the embeddings, vision tower,
norm and head are the root unit's), and a full-weight checkpoint the two write is the Qwen2-VL folder one process
writes, which ``vlm.load`` reads and one process resumes from.

The batch's groups split so that one rank's rows show no picture (two text groups there, both image groups on the
other rank): its passes give the vision tower a zero gradient, so both ranks' reduce-scatters of the root unit
pair up. One spawn (2 ranks, 1 thread each) runs every case; the 1-process reference runs here. The pattern is
``test_fsdp.py``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.parallel.test_fsdp import _free_port, assert_state_dicts_close, join_group, spawn
from tests.train.test_vlm_trainer import _groups
from tests.vlm_support import BOARD, SEEN, tiny_vlm_policy
from tidal.algo.config import AlgoConfig
from tidal.models import vlm
from tidal.optim import OptimConfig
from tidal.parallel.fsdp import LOCAL, LeaderTrainer, follow, split_groups, teardown
from tidal.train.batch import build_train_batch
from tidal.train.checkpoint import TrainingState, save_checkpoint
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

STEPS = 2
CASES = {
    "padded": TrainerConfig(),
    "packed_micro": TrainerConfig(packing=True, pack_tokens=160, micro_batch_tokens=80),
    "tries_micro": TrainerConfig(share_prefixes=True, pack_tokens=160, micro_batch_tokens=40),
}
IMAGES = [[BOARD], [], [SEEN], []]
RESPONSES = [["2<|im_end|>", "13<|im_end|>"], ["4 squares<|im_end|>", "1<|im_end|>", "22<|im_end|>"],
             ["3<|im_end|>", "9"], ["5<|im_end|>", "7 7<|im_end|>"]]
REWARDS = [[1.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]


def policy():
    """The tiny Qwen2-VL, the same weights in every process, and its processor."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, _, processor = tiny_vlm_policy()
    return model, processor


def make_trainer(case: str, dp=LOCAL) -> Trainer:
    model, _ = policy()
    return Trainer(model, AlgoConfig(), OptimConfig(lr=1e-3), CASES[case], dp=dp)


def make_batch():
    """Two groups with a picture each and two text groups; behaviour log-probs the untrained policy's own."""
    model, processor = policy()
    groups = _groups(processor, model, IMAGES, RESPONSES, REWARDS)
    batch, _ = build_train_batch(groups, AlgoConfig(), processor.tokenizer.pad_token_id, processor)
    return batch


def _worker(rank: int, world: int, port: int, out: str) -> None:
    dp = join_group(rank, world, port)
    out_dir = Path(out)
    batch = torch.load(out_dir / "batch.pt", weights_only=False) if rank == 0 else None
    processor = policy()[1] if rank == 0 else None
    try:
        for case in CASES:  # rank 0 leads, the other rank follows
            trainer = make_trainer(case, dp)
            if rank == 0:
                lead = LeaderTrainer(trainer)
                metrics = [lead.step(batch)]
                if case == "padded":  # as the controller saves: rank 0 alone calls it, the gather brings rank 1 in
                    save_checkpoint(out_dir / "ckpt", lead.model, processor, lead.optimizer, lead.scheduler,
                                    TrainingState(1, lead.version, 0, {}))
                metrics += [lead.step(batch) for _ in range(STEPS - 1)]
                sd = lead.state_dict_for_engine()
                lead.close()
                torch.save({"metrics": metrics, "sd": sd}, out_dir / f"{case}.pt")
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
    out = tmp_path_factory.mktemp("dist_vlm")
    torch.save(make_batch(), out / "batch.pt")
    spawn(_worker, 2, (_free_port(), str(out)), timeout_s=240)
    return out


def test_one_rank_shows_no_picture():
    """The premise of the zero vision-gradient passes: split by whole groups, rank 0's rows are text only."""
    batch = make_batch()
    parts = split_groups(batch.group_index_b.tolist(), batch.attention_mask_bt.sum(1).tolist(), 2)
    shown = [{i for r in part for i in batch.images.row_images[r]} for part in parts]
    assert sorted(map(len, shown)) == [0, 2]


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_train_a_vision_language_policy_like_one(two_procs, case):
    got = torch.load(two_procs / f"{case}.pt", weights_only=False)
    batch = torch.load(two_procs / "batch.pt", weights_only=False)
    ref = make_trainer(case)
    for step in range(STEPS):
        want, have = ref.step(batch), got["metrics"][step]
        assert ("train/logp_mismatch_mean" in have) == ("train/logp_mismatch_mean" in want) == (step == 0)
        for key in ("train/loss", "train/grad_norm", "train/entropy", "train/logp_mismatch_mean")[:4 - step]:
            assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (case, step, key, have[key], want[key])
    want_sd = ref.state_dict_for_engine()
    assert any(k.startswith("model.visual.") for k in want_sd)
    before = policy()[0].state_dict()
    assert not torch.equal(want_sd["model.visual.patch_embed.proj.weight"],
                           before["model.visual.patch_embed.proj.weight"])  # the vision tower trained
    # Adam moves a weight whose gradient is ~0 by up to lr on float noise: a tenth of a step's size (lr 1e-3) apart
    assert_state_dicts_close(got["sd"], want_sd, atol=1e-4)


def test_a_sharded_full_weight_checkpoint_is_the_one_process_qwen2_vl_folder(two_procs, tmp_path):
    """Gathered from the shards and written by rank 0: the same files, names and config as one process writes,
    ``vlm.load`` reads it as the one-process trained model, and one process resumes from it as the two went on."""
    from safetensors import safe_open

    sharded = two_procs / "ckpt" / "step_1"
    batch = torch.load(two_procs / "batch.pt", weights_only=False)
    one = make_trainer("padded")
    one.step(batch)
    written = one.save_checkpoint(tmp_path, policy()[1], TrainingState(1, one.version, 0, {}))
    assert {p.name for p in sharded.iterdir()} == {p.name for p in written.iterdir()}
    with safe_open(sharded / "model.safetensors", "pt") as f, safe_open(written / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())
        assert any(k.startswith("visual.") for k in f.keys())
        for k in g.keys():
            assert torch.allclose(f.get_tensor(k), g.get_tensor(k), atol=2e-5, rtol=1e-4), k
    assert json.loads((sharded / "config.json").read_text()) == json.loads((written / "config.json").read_text())
    loaded, _ = vlm.load(sharded)
    assert type(loaded) is type(one.model)
    assert_state_dicts_close(loaded.state_dict(), one.model.state_dict())
    resumed = make_trainer("padded")
    assert resumed.load_checkpoint(sharded).step == 1
    resumed.step(batch)
    got = torch.load(two_procs / "padded.pt", weights_only=False)
    assert_state_dicts_close(got["sd"], resumed.state_dict_for_engine())
