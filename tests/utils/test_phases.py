"""The trainer's phase times (``utils/phases.py``, issue 51): every phase is logged, the head is a part of the
forward, the head's recompute in a backward counts as backward, and nothing is timed without a timer."""

import copy
import time

import torch

from tidal.algo.config import AlgoConfig
from tidal.optim import OptimConfig
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import TrainBatch
from tidal.utils.phases import PHASES, PhaseTimer, phase


def test_phases_sum_what_ran_inside_them():
    with PhaseTimer(torch.device("cpu")) as timer:
        for _ in range(2):
            with phase("forward"):
                time.sleep(0.01)
                with phase("head"):
                    time.sleep(0.01)
        with phase("backward"):
            with phase("head"):  # a checkpoint's recompute: the backward's time, not the head's
                time.sleep(0.01)
    ms = timer.read()
    assert set(ms) == {f"perf/trainer_{p}_ms" for p in PHASES}
    assert ms["perf/trainer_forward_ms"] >= 40 and 20 <= ms["perf/trainer_head_ms"] < ms["perf/trainer_forward_ms"]
    assert ms["perf/trainer_backward_ms"] >= 10 and ms["perf/trainer_optimizer_ms"] == 0.0


def test_without_a_timer_phase_does_nothing():
    with phase("forward"):
        pass  # no timer open: nothing recorded, nothing raised


def test_a_trainer_step_logs_its_phases(small_model):
    ids = torch.tensor([[1, 5, 6, 7, 8, 9], [1, 5, 6, 7, 0, 0]])
    attn = (ids > 0).long()
    attn[:, 0] = 1
    loss = attn.float() * (torch.arange(6) >= 3)
    batch = TrainBatch(input_ids_bt=ids, attention_mask_bt=attn, loss_mask_bt=loss, behav_logp_bt=-2 * loss,
                       versions_bt=torch.zeros_like(ids), group_index_b=torch.tensor([0, 0]),
                       rewards_b=torch.tensor([1.0, 0.0]))
    trainer = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(lr=1e-3), TrainerConfig())
    metrics = trainer.step(batch)
    ms = {p: metrics[f"perf/trainer_{p}_ms"] for p in PHASES}
    assert all(v > 0 for v in ms.values()), ms
    assert ms["head"] < ms["forward"]
