"""tidal on one CUDA GPU: the proofs the CPU suite cannot give (``-m gpu``; skipped without CUDA, never in the
default suite). ``scripts/device_check.sh`` runs them on a borrowed GPU machine.

Each test compares against the CPU fp32 reference on the same inputs, with the tolerance stated where it is
asserted. Measured numbers go to ``$TIDAL_GPU_REPORT`` (one JSON object per line) when it is set, so the
device check's output keeps them.
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.system.test_controller import run, tiny_cfg
from tests.train.test_precision import grads_of_step
from tidal.algo.config import AlgoConfig
from tidal.optim import OptimConfig
from tidal.recipes import RECIPES
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import Group, Prompt
from tidal.utils.device import tensors_to

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def report(name: str, **values) -> None:
    path = os.environ.get("TIDAL_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **values}) + "\n")


def _batch(engine, tokenizer, num_prompts=6, group=6):
    prompts = [Prompt(f"p{i}", f"{i}+{i + 3}=", str(2 * i + 3)) for i in range(num_prompts)]
    trajs = engine.generate(group_requests(tokenizer, prompts, group))
    for i, t in enumerate(trajs):
        t.reward = float(i % 3 == 0)  # every group mixed
    groups = [Group(p, trajs[k * group : (k + 1) * group]) for k, p in enumerate(prompts)]
    return build_train_batch(groups, AlgoConfig(), tokenizer.pad_token_id)[0]


LAYOUTS = {"padded": {}, "packed": {"packing": True, "pack_tokens": 64},
           "prefix_shared": {"share_prefixes": True, "pack_tokens": 64}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_bf16_trainer_step_matches_the_cpu_fp32_step(small_model, tokenizer, layout):
    """Same batch, same weights: CUDA bf16 autocast vs CPU fp32. Loss within 5e-3 absolute, gradient cosine
    >= 0.999, log-probs within the bf16 band (max 0.05); weights, optimizer state on CUDA in fp32."""
    batch = _batch(LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12)), tokenizer)
    cfg = LAYOUTS[layout]
    optim = OptimConfig(lr=1e-3)
    cpu = Trainer(copy.deepcopy(small_model), AlgoConfig(), optim, TrainerConfig(precision="fp32", **cfg))
    gpu = Trainer(copy.deepcopy(small_model), AlgoConfig(), optim, TrainerConfig(precision="bf16", **cfg),
                  device="cuda")
    m_cpu, g_cpu = grads_of_step(cpu, batch)
    m_gpu, g_gpu = grads_of_step(gpu, batch)
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in gpu.model.parameters())
    state = [v for s in gpu.optimizer.state.values() for v in s.values() if v.dim() > 0]
    assert state and all(v.device.type == "cuda" and v.dtype == torch.float32 for v in state)
    cosine = torch.nn.functional.cosine_similarity(g_cpu, g_gpu, dim=0).item()
    mask = batch.loss_mask_bt.bool()
    gap = (gpu.last_logp_bt.cpu() - cpu.last_logp_bt).abs()[mask]
    loss_gap = abs(m_gpu["train/loss"] - m_cpu["train/loss"])
    report("trainer_step_cuda_bf16_vs_cpu_fp32", layout=layout, grad_cosine=cosine, loss_cpu=m_cpu["train/loss"],
           loss_gpu=m_gpu["train/loss"], logp_gap_max=gap.max().item(), logp_gap_mean=gap.mean().item())
    assert cosine >= 0.999, cosine
    assert loss_gap <= 5e-3, (m_cpu["train/loss"], m_gpu["train/loss"])
    assert gap.max() < 0.05, gap.max()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_engine_generates_and_its_logprobs_agree_with_the_trainer(small_model, tokenizer, dtype):
    """The engine on CUDA (weights and KV slots there) samples tokens whose behaviour log-probs match the
    trainer's fp32 scores: to 1e-3 (fp32 engine; TF32 is off by default for matmuls) or within the bf16 band
    (bf16 engine: mean gap < 0.02, max < 0.2)."""
    engine = LocalEngine(copy.deepcopy(small_model).to("cuda"), tokenizer,
                         SamplingConfig(max_new_tokens=24, dtype=dtype))
    assert all(p.device.type == "cuda" for p in engine.model.parameters())
    batch = _batch(engine, tokenizer)
    trainer = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(), TrainerConfig(precision="fp32"),
                      device="cuda")
    scored = trainer._scores(trainer.model, tensors_to(batch, trainer.device)).cpu()
    mask = batch.loss_mask_bt.bool()
    gap = (scored - batch.behav_logp_bt).abs()[mask]
    report("engine_cuda_logprobs_vs_trainer", dtype=dtype, gap_mean=gap.mean().item(), gap_max=gap.max().item(),
           tokens=int(mask.sum()))
    assert int(mask.sum()) > 50
    if dtype == "fp32":
        assert gap.max() < 1e-3, gap.max()
    else:
        assert gap.mean() < 0.02 and gap.max() < 0.2, (gap.mean(), gap.max())


def test_cuda_inflight_weight_update_device_to_device(small_model, tokenizer):
    """A CUDA trainer's weights reach a CUDA bf16 engine mid-generation without leaving the GPU; tokens after
    the switch carry the new version."""
    trainer = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(), TrainerConfig(), device="cuda")
    engine = LocalEngine(trainer.model, tokenizer, SamplingConfig(max_new_tokens=16, dtype="bf16"))
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sd = trainer.state_dict_for_engine(dtype=torch.bfloat16)
    assert all(v.device.type == "cuda" for v in sd.values())  # no host round trip
    assert trainer.weight_sync_metrics["perf/weight_sync_bytes"] == sum(v.numel() * 2 for v in sd.values())
    apply, calls = engine._apply_pending_update, []

    def interrupt():
        calls.append(1)
        if len(calls) == 4:
            engine.request_weight_update(sd, version=7)
        return apply()

    engine._apply_pending_update = interrupt
    prompts = [Prompt(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(8)]
    trajs = engine.generate(group_requests(tokenizer, prompts, 4))
    assert engine.version == 7 and engine.num_interruptions >= 1
    assert any(len(set(t.versions)) == 2 for t in trajs)
    assert all(t.versions == sorted(t.versions) for t in trajs)
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, sd[name]), name


def test_cuda_resume_equals_uninterrupted(tmp_path):
    """4 steps in one go vs 2 steps, then ``--resume`` to 4, on CUDA: the same metrics and weights (within
    float noise: atomics in CUDA backward kernels may reorder additions)."""
    cuda = ("system.mode=sync", "system.device=cuda")
    full, full_r = run(tiny_cfg(tmp_path, *cuda), tmp_path / "full")
    assert full.trainer.device.type == "cuda"
    run(tiny_cfg(tmp_path, *cuda, "max_steps=2"), tmp_path / "split")
    resumed, _ = run(tiny_cfg(tmp_path, *cuda), tmp_path / "split", resume=True)
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for a, b in zip(rows, full_r.history):
        for key in ("reward/mean", "eval/accuracy", "rollout/response_len_mean"):
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))
        if "train/loss" in a:
            assert abs(a["train/loss"] - b["train/loss"]) < 1e-5, (a["step"], a["train/loss"], b["train/loss"])
    worst = max((full.trainer.model.state_dict()[k] - v).abs().max().item()
                for k, v in resumed.trainer.model.state_dict().items())
    report("resume_on_cuda", max_weight_diff=worst)
    assert worst < 1e-5, worst


def test_cuda_graph_decode_matches_eager_decode(small_model, tokenizer):
    """Replayed CUDA graphs (the CUDA default) sample the tokens eager dynamic decoding samples (fp32 engine;
    log-probs within 1e-4), through continuous batching and buffer growth; recording did not fall back."""
    prompts = [Prompt(f"p{i}", f"{i}+{3 * i}=" + "1" * (i % 3), str(4 * i)) for i in range(7)]
    runs = {}
    for graphs in ("off", "auto"):
        engine = LocalEngine(copy.deepcopy(small_model).to("cuda"), tokenizer,
                             SamplingConfig(max_new_tokens=40, max_batch_size=5, dtype="fp32", cuda_graphs=graphs))
        runs[graphs] = engine.generate(group_requests(tokenizer, prompts, 3))
    static = engine._slots.static
    report("cuda_graph_decode", recorded=static.num_recorded, failed=static.failed)
    assert static.num_recorded >= 3 and not static.failed
    assert [t.token_ids for t in runs["auto"]] == [t.token_ids for t in runs["off"]]
    for a, b in zip(runs["auto"], runs["off"]):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_every_bucket_is_recorded_once_before_decoding(small_model, tokenizer):
    """Issue 51: the slot cache is sized from the call's requests before its first row joins, and every bucket its
    rows pass through is recorded right then: none in the middle of decoding, no growth, none recorded again by a
    second call of the same shape, and the replays sample what eager decoding samples."""
    from tidal.rollout.graphs import bucket

    prompts = [Prompt(f"p{i}", f"{i}+{3 * i}=" + "1" * (i % 3), str(4 * i)) for i in range(7)]
    requests = group_requests(tokenizer, prompts, 3)  # 21 rows in one wave: buckets 1, 2, 4, 8, 16, 21
    engine = LocalEngine(copy.deepcopy(small_model).to("cuda"), tokenizer,
                         SamplingConfig(max_new_tokens=40, dtype="fp32", cuda_graphs="auto"))
    first = engine.generate(requests)
    static = engine._slots.static
    recorded = static.num_recorded
    engine.generate(requests)
    stats = engine.stats()
    report("graph_buckets_once", recorded=recorded, again=static.num_recorded - recorded,
           late=stats["rollout/graph_late_steps"], resizes=stats["rollout/slot_resizes"],
           record_s=stats["rollout/graph_record_s"])
    assert not static.failed
    assert recorded == len({bucket(n, len(requests)) for n in range(1, len(requests) + 1)}) == 6
    assert static.num_recorded == recorded and stats["rollout/graph_late_steps"] == 0
    assert stats["rollout/slot_resizes"] == 0
    eager = LocalEngine(copy.deepcopy(small_model).to("cuda"), tokenizer,
                        SamplingConfig(max_new_tokens=40, dtype="fp32", cuda_graphs="off")).generate(requests)
    assert [t.token_ids for t in first] == [t.token_ids for t in eager]


def test_compiled_sampler_draws_the_eager_tokens_on_cuda():
    """The fused (torch.compile) Gumbel sampler evaluates the same float64 noise as the eager one: the same
    tokens on a [256 x 151,936] batch (a Qwen2.5-sized vocabulary), and did not fall back."""
    from tidal.rollout import sampling

    g = torch.Generator(device="cuda").manual_seed(0)
    logp = torch.log_softmax(4 * torch.randn(256, 151_936, device="cuda", generator=g), dim=-1)
    keys = torch.randint(0, 2**62, (256,), device="cuda", generator=g)
    pos = torch.randint(0, 4096, (256,), device="cuda", generator=g)
    fused = sampling._gumbel_argmax_for(logp.device)
    tokens = fused(logp, keys, pos)
    assert sampling._compiled_gumbel_argmax is not sampling.gumbel_argmax, "compiling fell back"
    assert torch.equal(tokens, sampling.gumbel_argmax(logp, keys, pos))


def test_tf32_head_stays_within_a_stated_band_of_the_fp32_head():
    """``trainer.head_matmul=tf32`` on a Qwen2.5-sized head (hidden 896, vocab 151,936, logits of std ~4):
    per-token log-probs within 2e-2 of the float32 head (mean under 2e-3). The bf16-rounded head that
    MiniMax-M1 warns about is reported beside it for scale."""
    from tidal.models.logprobs import chunked_head_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(1, 2048, 896, device="cuda", generator=g)
    weight = torch.randn(151_936, 896, device="cuda", generator=g) * (4 / 896**0.5)
    targets = torch.randint(0, 151_936, (1, 2048), device="cuda", generator=g)
    exact, _ = chunked_head_logprobs(hidden, weight, None, targets)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        tf32, _ = chunked_head_logprobs(hidden, weight, None, targets)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    logits_bf16 = (hidden.bfloat16() @ weight.bfloat16().T).float()
    bf16 = torch.log_softmax(logits_bf16, -1).gather(-1, targets[..., None])[..., 0]
    gap, gap_bf16 = (tf32 - exact).abs(), (bf16 - exact).abs()
    report("tf32_head", gap_mean=gap.mean().item(), gap_max=gap.max().item(), bf16_gap_mean=gap_bf16.mean().item(),
           bf16_gap_max=gap_bf16.max().item())
    assert gap.max() < 2e-2 and gap.mean() < 2e-3, (gap.mean(), gap.max())


def test_quickstart_on_cuda_reaches_its_target(tmp_path):
    """The README's main job on the GPU: ``tidal train quickstart --set system.device=cuda`` (the warm-started
    base is built on the CPU, cached) stops at its target accuracy."""
    out = tmp_path / "qs"
    cmd = [sys.executable, "-m", "tidal.cli", "train", "quickstart", "--out", str(out), "--set", "system.device=cuda",
           "--set", "log.report=false", "--set", "log.progress=false", "--set", f"sft.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    target = RECIPES.get("quickstart")().target_accuracy
    steps = rows[-1]["step"]
    report("quickstart_on_cuda", base=evals[0], final=evals[-1], steps=steps,
           rl_s=sum(r.get("perf/step_s", 0.0) for r in rows),
           mismatch_mean=[r["train/logp_mismatch_mean"] for r in rows if "train/logp_mismatch_mean" in r][-5:])
    assert evals[-1] >= target, (evals, steps)
