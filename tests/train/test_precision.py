"""Mixed precision on CPU (bf16 autocast runs on every device, so its logic is tested on every commit):
fp32 master weights and optimizer state, an fp32 log-prob head, a trainer step close to the fp32 step on the
same batch, and a bf16 rollout engine whose gap to the trainer shows in the mismatch metrics and is what the
TIS correction acts on. The same comparisons on CUDA: ``tests/gpu/test_cuda.py``."""

import copy

import torch

from tidal.algo.config import AlgoConfig
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.rollout.slots import SlotCache
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import Group, Prompt


def _batch(engine, tokenizer, num_prompts=4, group=4):
    prompts = [Prompt(f"p{i}", f"{i}+{i + 3}=", str(2 * i + 3)) for i in range(num_prompts)]
    trajs = engine.generate(group_requests(tokenizer, prompts, group))
    for i, t in enumerate(trajs):
        t.reward = float(i % 2)  # every group mixed: every row has an advantage
    groups = [Group(p, trajs[k * group : (k + 1) * group]) for k, p in enumerate(prompts)]
    return build_train_batch(groups, AlgoConfig(), tokenizer.pad_token_id)[0]


def grads_of_step(trainer: Trainer, batch) -> tuple[dict[str, float], torch.Tensor]:
    """One trainer step's metrics and its flattened gradient, read when the gradients are final."""
    grads = []

    class Capture:
        def after_backward(self):
            grads.append(torch.cat([p.grad.detach().float().flatten().cpu() for p in trainer.model.parameters()]))

        def after_optimizer(self):
            pass

    trainer.observers.append(Capture())
    metrics = trainer.step(batch)
    return metrics, grads[0]


def test_bf16_step_keeps_fp32_master_weights_and_state_and_tracks_the_fp32_step(small_model, tokenizer):
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=6))
    batch = _batch(engine, tokenizer)
    fp32 = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(lr=1e-3), TrainerConfig(precision="fp32"))
    bf16 = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(lr=1e-3), TrainerConfig(precision="bf16"))
    assert fp32.autocast_dtype == torch.float32 and bf16.autocast_dtype == torch.bfloat16
    m32, g32 = grads_of_step(fp32, batch)
    m16, g16 = grads_of_step(bf16, batch)

    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # master weights
    state = [s for s in bf16.optimizer.state.values() if s]
    assert state and all(v.dtype == torch.float32 for s in state for v in s.values() if v.dim() > 0)
    assert bf16.last_logp_bt.dtype == torch.float32  # the head and log-softmax stay fp32
    # bf16 rounds activations to 8 significant bits: the step moves, but stays close to the fp32 one.
    gap = (bf16.last_logp_bt - fp32.last_logp_bt).abs()[batch.loss_mask_bt.bool()]
    assert 0 < gap.max() < 0.05, gap.max()
    cosine = torch.nn.functional.cosine_similarity(g32, g16, dim=0).item()
    assert cosine > 0.999, cosine
    assert abs(m16["train/grad_norm"] - m32["train/grad_norm"]) < 0.1 * m32["train/grad_norm"]


def test_bf16_engine_samples_in_bf16_and_its_gap_shows_in_mismatch_and_is_corrected(small_model, tokenizer):
    algo = AlgoConfig(correction="tis")
    gaps, ess = {}, {}
    for dtype in ("fp32", "bf16"):
        engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=6, dtype=dtype))
        expected = torch.bfloat16 if dtype == "bf16" else torch.float32
        assert all(p.dtype == expected for p in engine.model.parameters())
        assert SlotCache(engine.model, 4).dtype == expected  # keys and values in the engine's dtype
        batch = _batch(engine, tokenizer)
        trainer = Trainer(copy.deepcopy(small_model), algo, OptimConfig(lr=1e-3), TrainerConfig(precision="fp32"))
        metrics = trainer.step(batch)
        gaps[dtype], ess[dtype] = metrics["train/logp_mismatch_mean"], metrics["algo/is_ess"]
    assert gaps["fp32"] < 1e-4 and ess["fp32"] > 1 - 1e-6  # same numerics: weights are all 1
    assert gaps["bf16"] > 10 * gaps["fp32"] and gaps["bf16"] > 1e-4, gaps
    assert ess["bf16"] < ess["fp32"], ess  # TIS weighs the bf16 engine's tokens by pi_trainer / pi_engine


def test_weights_for_a_bf16_engine_are_sent_in_bf16(small_model):
    trainer = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(), TrainerConfig())
    full = trainer.state_dict_for_engine()
    full_bytes = trainer.weight_sync_metrics["perf/weight_sync_bytes"]
    half = trainer.state_dict_for_engine(dtype=torch.bfloat16)
    assert trainer.weight_sync_metrics["perf/weight_sync_bytes"] == full_bytes / 2
    assert all(v.dtype == torch.bfloat16 for v in half.values() if v.is_floating_point())
    name, weight = next(iter(trainer.model.state_dict().items()))
    assert full[name].data_ptr() != weight.data_ptr()  # a copy: the engine never aliases the trainer's weights
