"""Named simulator setups: ``cpu`` (this machine, calibrated) and ``areal`` (AReaL's published run).

``cpu`` mirrors ``tidal bench async`` (repeat task, max_repeat 48, 16 prompts x 8 samples, eta 2,
40 steps on 2 cores) with costs measured by ``benchmarks/simulate_calibrate.py``. The async mode
splits the cores 1 + 1 (one torch thread each, ``system.async_threads``) while sync gives each phase
both (``system.num_threads``), and the two threads of one process share the GIL and memory
bandwidth: that is the shared pool with overlap slowdowns, all measured.

``areal`` is the 1.5B math run behind AReaL's 2.77x (arXiv 2505.24298; AReaL v0.3 blog, Table 2:
synchronous AReaL 41.0 h vs asynchronous 14.8 h for 1,000 PPO steps on 16 nodes of 8 H800 GPUs).
``AREAL_SOURCES`` says where every number comes from; the ones no source gives (decode overheads,
MFU, the response-length law, weight-sync time) are marked as assumptions, and
``benchmarks/simulate.py`` shows how the prediction moves with each.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tidal.sim.config import SimConfig, WorkloadConfig
from tidal.sim.costs import CostModel, Layout

CALIBRATION = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "sim_calibration.json"


def _cpu_costs(cal: dict) -> CostModel:
    """One-thread costs; decoding on 2 threads as measured (``CostModel.measured``); the 1 -> 2 thread
    speed-ups as scaling exponents (speed = threads ** x) where the benchmark operates: decoding one
    step's 128 rows (for other thread counts), training one step's batch."""
    d1, d2 = cal["decode"]["1"], cal["decode"]["2"]
    t1, t2 = cal["train"]["1"], cal["train"]["2"]
    rows, ctx = 128, 128 * (cal["prompt_len"] + cal["lengths"]["mean"] / 2)  # one step's batch, mid-way
    padded = cal.get("informative_frac", 1.0) * rows * (cal["prompt_len"] + max(cal["lengths"].get("values", [50])))

    def decode(d):
        return d["step_s"] + d["per_seq_s"] * rows + d["per_ctx_token_s"] * ctx

    def train(t):
        return t["step_s"] + t["per_padded_token_s"] * padded

    overlap = cal["overlap"]
    return CostModel(
        decode_step_s=d1["step_s"],
        decode_per_seq_s=d1["per_seq_s"],
        decode_per_ctx_token_s=d1["per_ctx_token_s"],
        prefill_per_token_s=cal["prefill_per_token_s"]["1"],
        train_step_s=t1["step_s"],
        train_per_token_s=t1["per_padded_token_s"],
        train_padded=True,
        weight_sync_s=t1["weight_sync_s"],
        weight_load_s=t1["weight_load_s"],
        reward_s=cal["reward_s"]["group"],
        gen_scaling=math.log2(decode(d1) / decode(d2)),
        train_scaling=math.log2(train(t1) / train(t2)),
        overlap_gen_slowdown=max(1.0, overlap["gen_slowdown"]),
        overlap_train_slowdown=max(1.0, overlap["train_slowdown"]),
        measured={2: {"decode_step_s": d2["step_s"], "decode_per_seq_s": d2["per_seq_s"],
                      "decode_per_ctx_token_s": d2["per_ctx_token_s"],
                      "prefill_per_token_s": cal["prefill_per_token_s"]["2"]}},  # sync's generation
    )


def cpu(calibration: str | Path = CALIBRATION) -> SimConfig:
    """``tidal bench async`` on this machine's measured costs."""
    path = Path(calibration)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no CPU calibration yet; run `python benchmarks/simulate_calibrate.py`")
    cal = json.loads(path.read_text())
    return SimConfig(
        preset="cpu",
        steps=40,  # benchmarks/async.py: max_steps=40, throughput from the first step on
        warmup_steps=0,
        costs=_cpu_costs(cal),
        layout=Layout(devices=2, gen_devices=1, engine_devices=0, max_batch=512, sync_colocated=True,
                      shared_pool=True),
        workload=WorkloadConfig(prompts_per_step=16, group_size=8, prompt_len=round(cal["prompt_len"]),
                                lengths=f"groups:{path}", max_staleness=2, periodic_staleness=1,
                                train_informative_only=True),  # algo.skip_zero_adv_groups=True
    )


# ---- AReaL (1.5B, 16 nodes) ---------------------------------------------------------------------------
GPUS = 16 * 8
PARAMS = 1.78e9  # DeepSeek-R1-Distill-Qwen-1.5B (untied embeddings)
LAYERS, HIDDEN, KV_HEADS, HEAD_DIM = 28, 1536, 2, 128
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # K and V, bf16: 28,672 B
HBM_BYTES_S, BF16_FLOPS, HBM_BYTES = 3.35e12, 989e12, 80e9  # H800 = H100 SXM compute and memory
BANDWIDTH_EFF, DECODE_MFU, TRAIN_MFU = 0.8, 0.5, 0.4
PROMPT_LEN, MAX_GEN, MEAN_GEN, SIGMA = 256, 32768 - 1024, 5500, 1.0
KV_FRACTION = 0.8

AREAL_SOURCES = {
    "2.77x": "AReaL v0.3 blog (inclusionAI/AReaL blog/AReaL_v0_3.md) Table 2: 1.5B, 16 nodes, 1,000 PPO steps, "
             "synchronous 41.0 h vs asynchronous 14.8 h (41.0 / 14.8 = 2.77); 7B on 24 nodes: 57.7 vs 25.4 h",
    "gpus": "16 nodes x 8 H800 (same table; AReaL v0.1 blog: 'nodes, each equipped with 8 H800 GPUs')",
    "split": "3/4 of the GPUs generate (SGLang, TP 1 below 32B), 1/4 train: get_allocation_mode in "
             "AReaL benchmark/verl_312a8cb/build_cmd.py",
    "sync_colocated": "synchronous systems run generation and training on every GPU in turn (AReaL v0.3 blog: "
                      "'Synchronous systems distribute generation across all devices')",
    "batch": "512 prompts x 16 responses (AReaL benchmark/verl_v0_3_0_post1_312a8cb/README.md, 'following DAPO')",
    "max_gen": "31k = 32k context - 1k prompt (same README; build_cmd.py: max_new_tokens = ctx - 1024)",
    "eta": "8 for math (the paper's setting as summarised by secondary sources; the v0.3 blog's code recipe "
           "uses 16, its Table 3 sweeps 0-16); assumption-sensitive, see the eta sweep",
    "model": "DeepSeek-R1-Distill-Qwen-1.5B: 1.78B parameters, 28 layers, hidden 1536, 2 KV heads of 128",
    "h800": "H100 SXM memory and compute (80 GB HBM3 at 3.35 TB/s, 989 dense BF16 TFLOPS); the H800 differs "
            "in interconnect only",
    "decode_costs": "assumption: weights read once per step at 80% of HBM bandwidth plus 1 ms of scheduling "
                    "and sampling; 2 FLOPs/parameter/token at 50% MFU; the KV cache read at 80% bandwidth",
    "train_costs": "assumption: 8 FLOPs/parameter/token (forward + backward + the decoupled-PPO log-prob "
                   "recomputation) at 40% MFU; causal attention 4 x 4 x hidden x layers FLOPs per token pair",
    "lengths": "lognormal with DeepScaleR's mean response length for this base model (~5,500 tokens at the "
               "start of its RL; its blog: wrong answers run 3x longer than right ones), sigma 1.0 (assumption: "
               "a long tail), clipped at 31k (~1% truncated, ~80 responses of a 8,192-response batch)",
    "prompt_len": "assumption: 256 prompt tokens (a math problem in the chat template; the 1k of context "
                  "reserved for prompts is an upper bound)",
    "kv_slots": "assumption: 80% of HBM for weights + KV cache (SGLang mem_fraction_static); slots = KV tokens / "
                "(prompt + mean response)",
    "weight_sync": "assumption: 2 s to publish (trainer) and 2 s to load (each engine) 3.6 GB of bf16 weights",
    "reward": "assumption: 0.5 s to verify a group (math-verify runs in CPU workers beside the GPUs)",
}


def areal() -> SimConfig:
    """AReaL's 1.5B math run (see ``AREAL_SOURCES`` for every number)."""
    kv_tokens = (HBM_BYTES * KV_FRACTION - 2 * PARAMS) / KV_BYTES_PER_TOKEN
    costs = CostModel(
        decode_step_s=2 * PARAMS / (HBM_BYTES_S * BANDWIDTH_EFF) + 1e-3,
        decode_per_seq_s=2 * PARAMS / (BF16_FLOPS * DECODE_MFU),
        decode_per_ctx_token_s=KV_BYTES_PER_TOKEN / (HBM_BYTES_S * BANDWIDTH_EFF),
        prefill_per_token_s=2 * PARAMS / (BF16_FLOPS * DECODE_MFU),
        train_per_token_s=8 * PARAMS / (BF16_FLOPS * TRAIN_MFU),
        train_per_token_ctx_s=4 * 4 * HIDDEN * LAYERS / (BF16_FLOPS * TRAIN_MFU),
        weight_sync_s=2.0,
        weight_load_s=2.0,
        reward_s=0.5,
    )
    return SimConfig(
        preset="areal",
        steps=16,
        warmup_steps=6,  # the paper's 1,000 steps are steady state: leave the pipeline fill out
        costs=costs,
        layout=Layout(devices=GPUS, gen_devices=GPUS * 3 // 4, engine_devices=1,
                      max_batch=int(kv_tokens / (PROMPT_LEN + MEAN_GEN)), sync_colocated=True),
        workload=WorkloadConfig(prompts_per_step=512, group_size=16, prompt_len=PROMPT_LEN,
                                lengths=f"lognormal:{MEAN_GEN},{SIGMA},{MAX_GEN}", max_staleness=8,
                                periodic_staleness=1),
    )


PRESETS = {"cpu": cpu, "areal": areal}


def build(overrides: list[str]) -> SimConfig:
    """A preset (``preset=NAME`` among the overrides; default ``cpu``) with the other overrides applied."""
    from tidal.config import ConfigError, apply_overrides
    from tidal.sim.config import validate

    names = [o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == "preset"]
    name = names[-1] if names else "cpu"
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[name]()
    return validate(apply_overrides(cfg, [o for o in overrides if o.partition("=")[0].strip() != "preset"]))
