"""Block-FP8 rollout weights: bytes per weight sync, quantization error (with and without a Hadamard
rotation, FP8 and INT4), and the quickstart trained with and without FP8 rollouts.

1. *Bytes per sync* of the quickstart's warm-started model (what ``perf/weight_sync_bytes`` counts)
   as float32, bfloat16 and ``fp8_block`` (e4m3 linear weights + one float32 scale per 128 x 128
   tile; embeddings and norms as they are), and the same for a model with Qwen2.5-1.5B's shapes
   (built on the meta device: shapes only) from a bfloat16 baseline.
2. *Quantization error*: relative Frobenius error ||W - deq(q(W))|| / ||W|| averaged over the
   quickstart model's linear weights and over random matrices with 4 planted outlier input
   channels (x20), for FP8 128 x 128 blocks and INT4 1 x 128 groups, each without and with the
   randomized Hadamard rotation (undone after dequantizing).
3. *Training*: ``quickstart_grpo`` in sync mode (``SYNC``: plain GRPO, as measured; sync so that the
   result does not depend on thread timing), 1 torch thread, the same number of steps, seeds 0 and 1,
   with ``rollout.weight_quant`` none and fp8_block: held-out greedy accuracy along the way, the
   engine/trainer log-prob gap (``train/logp_mismatch_mean`` / ``_max``, on the tokens of the version
   being trained) and the bytes per sync.

    tidal bench quant [--set max_steps=40 ...]
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tidal.config import apply_overrides
from tidal.models import tiny
from tidal.models.quant import fake_quantize, linear_weight_names, quantize_state_dict
from tidal.recipes import RECIPES
from tidal.system.run import base_model_path, train
from tidal.tasks import TASKS

DESCRIPTION = "block-FP8 rollout weights: bytes per sync, quantization error, quickstart with/without"

# 32 prompts per step: the quickstart's batch when these results were measured (it is 128 since issue 15).
BASE = ["rollout.prompts_per_step=32", "max_steps=40", "eval_every=10", "max_time_s=null", "target_accuracy=null",
        "checkpoint_every=1000",
        "system.num_threads=1", "log.progress=false", "log.tensorboard=false", "log.report=false"]
# quickstart_sync as it was measured: plain GRPO (the quickstart took pass@k and guidance in issue 39).
SYNC = ["system.mode=sync", "rollout.max_staleness=0"]
ARMS = {"none": [], "fp8_block": ["rollout.weight_quant=fp8_block"]}
SEEDS = (0, 1)
"""Two run seeds (prompt order and sampling noise; the warm-started base is the same): one run per
arm cannot tell a quantization effect from seed noise."""
FORMATS = [("fp8_block", False), ("fp8_block", True), ("int4_block", False), ("int4_block", True)]


def _nbytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def _sync_bytes(model: torch.nn.Module, baseline: torch.dtype) -> dict[str, float]:
    sd = {k: v.to(baseline) for k, v in model.state_dict().items()}
    names = linear_weight_names(model)
    out = {"params": float(sum(v.numel() for v in sd.values())),
           "linear_share": sum(sd[n].numel() for n in names) / sum(v.numel() for v in sd.values()),
           "float32_bytes": float(_nbytes({k: v.float() for k, v in sd.items()})),
           "bfloat16_bytes": float(_nbytes({k: v.to(torch.bfloat16) for k, v in sd.items()})),
           "fp8_block_bytes": float(_nbytes(quantize_state_dict(sd, names)))}
    out["fp8_over_float32"] = out["fp8_block_bytes"] / out["float32_bytes"]
    out["fp8_over_bfloat16"] = out["fp8_block_bytes"] / out["bfloat16_bytes"]
    return out


def _qwen_shapes() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # Qwen2.5-1.5B's config
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def _errors(weights: list[torch.Tensor]) -> dict[str, float]:
    out = {}
    for fmt, rotation in FORMATS:
        rel = [float((fake_quantize(w, fmt, rotation) - w).norm() / w.norm()) for w in weights]
        out[f"{fmt}{'+hadamard' if rotation else ''}"] = sum(rel) / len(rel)
    return out


def _planted(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(512, 512, generator=gen)
    w[:, torch.randperm(512, generator=gen)[:4]] *= 20
    return w


def run(overrides: list[str], out_dir: Path) -> dict:
    cfg0 = apply_overrides(RECIPES.get("quickstart_grpo")(), [*SYNC, *BASE, *overrides])
    base = base_model_path(cfg0, TASKS.get(cfg0.task.name)(cfg0.task), progress=False)
    model, _ = tiny.load(base)
    sizes = {"quickstart (float32 trainer)": _sync_bytes(model, torch.float32),
             "Qwen2.5-1.5B shapes (bfloat16)": _sync_bytes(_qwen_shapes(), torch.bfloat16)}
    sd = model.state_dict()
    errors = {"quickstart linear weights": _errors([sd[n] for n in linear_weight_names(model)]),
              "random 512x512, 4 outlier channels x20": _errors([_planted(s) for s in range(4)])}

    rows = []
    for seed in SEEDS:
        for arm, extra in ARMS.items():
            run_overrides = [*BASE, f"seed={seed}", *extra, *overrides]
            rows.append(_train_arm(arm, seed, run_overrides, out_dir / f"{arm}-seed{seed}"))
    summary = {arm: {k: sum(r[k] for r in rows if r["rollout_weights"] == arm) / len(SEEDS)
                     for k in ("final_accuracy", "best_accuracy", "logp_gap_mean", "sync_bytes")} for arm in ARMS}
    return {"benchmark": "quant", "description": DESCRIPTION, "table": rows, "mean_over_seeds": summary,
            "sync_bytes": sizes, "relative_error": errors}


def _train_arm(arm: str, seed: int, overrides: list[str], out_dir: Path) -> dict:
    cfg = apply_overrides(RECIPES.get("quickstart_grpo")(), [*SYNC, *overrides])
    start = time.perf_counter()
    result = train(cfg, out_dir)
    wall = time.perf_counter() - start
    gaps = [h for h in result.history if "train/logp_mismatch_mean" in h]
    return {
        "rollout_weights": arm,
        "seed": seed,
        "steps": result.steps,
        "base_accuracy": result.base_accuracy,
        "accuracy_by_eval": [round(h["eval/accuracy"], 3) for h in result.history if "eval/accuracy" in h],
        "final_accuracy": result.final_accuracy,
        "best_accuracy": result.best_accuracy,
        "sync_bytes": result.history[-1]["perf/weight_sync_bytes"],
        "logp_gap_mean": sum(h["train/logp_mismatch_mean"] for h in gaps) / max(len(gaps), 1),
        "logp_gap_max": max((h["train/logp_mismatch_max"] for h in gaps), default=0.0),
        "weight_sync_s_mean": sum(h["perf/weight_sync_s"] for h in result.history[1:]) / max(result.steps, 1),
        "wall_s": wall,
    }
