"""Measure the simulator's CPU cost model on this machine with the real engine and trainer.

Same model and task as ``tidal bench async`` (its ``BASE`` overrides: the warm-started tiny model
on the ``repeat`` task). Measured, each with 1 and 2 torch threads:

- decode: ``LocalEngine.generate`` on 1..48 groups of 8 (the fastest of 3 runs: other processes
  on the cores only ever add time); the times are fit as
  ``a * steps + b * tokens + c * context_token_reads + d`` (least squares, a
  negative coefficient is dropped and the rest refit): a, b, c are the cost model's
  ``decode_step_s``, ``decode_per_seq_s``, ``decode_per_ctx_token_s``;
- prefill: one forward with a KV cache over [rows x width] tokens (what a re-prefill after an
  interruption runs), per token;
- training: ``build_train_batch`` + ``Trainer.step`` on 1..12 informative groups (the trainer
  skips all-equal groups), fit as ``t0 + t * rows * width`` (the batch is padded);
- weight sync (``state_dict_for_engine``), weight load (``load_state_dict`` into the engine's copy),
  reward latency (``RewardPool.score`` of one group and of one step's batch);
- overlap: generation and training at the same time on two threads with one torch thread each
  (the async controller's setting) against each alone: the slowdown each gets from the other;
- the groups the model produced: their response lengths and whether their rewards differ (the
  trainer skips all-equal groups, ``algo.skip_zero_adv_groups``), sampled whole by the simulator.

    python benchmarks/simulate_calibrate.py      # writes benchmarks/results/sim_calibration.json (~1-2 min)

Run it on an idle machine (``uptime`` load below ~1.5): other processes on the cores inflate every
number (FACTS.md: a second process made a training step 21x slower).
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

DESCRIPTION = "measure the simulator's CPU cost model (decode, prefill, train, sync, reward, overlap)"
OUT = Path(__file__).resolve().parent / "results" / "sim_calibration.json"


def _fit(rows: list[list[float]], times: list[float], names: list[str]) -> dict[str, float]:
    """Least squares with non-negative coefficients (drop the most negative one and refit)."""
    keep = list(range(len(names)))
    x, y = np.asarray(rows, dtype=float), np.asarray(times, dtype=float)
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all():
            break
        keep.pop(int(np.argmin(coef)))
    out = dict.fromkeys(names, 0.0)
    out.update({names[k]: float(c) for k, c in zip(keep, coef)})
    pred = x[:, keep] @ coef
    out["rel_rmse"] = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
    return out


def _setup():
    from tidal.bench import load
    from tidal.config import apply_overrides
    from tidal.models import tiny
    from tidal.recipes import RECIPES
    from tidal.system.run import base_model_path
    from tidal.tasks import TASKS

    base = load("async")
    cfg = apply_overrides(RECIPES.get("quickstart_grpo")(), [*base.BASE, *base.MODES["async"]])
    task = TASKS.get(cfg.task.name)(cfg.task)
    model, tokenizer = tiny.load(base_model_path(cfg, task, progress=False))
    return cfg, task, model, tokenizer


def _best(fn, *args, reps: int = 3) -> float:
    """Fastest of ``reps`` timings of ``fn(*args)``: other processes on the cores only ever add time."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def _sample_groups(cfg, task, model, tokenizer, pool, n_groups: int) -> list:
    """Scored groups of the training stream, as the controller builds them."""
    from tidal.rollout.local import LocalEngine
    from tidal.rollout.requests import group_requests
    from tidal.types import Group

    engine = LocalEngine(model, tokenizer, cfg.rollout, seed=cfg.seed)
    prompts = [task.train_prompt(i) for i in range(n_groups)]
    g = cfg.rollout.group_size
    trajs = engine.generate(group_requests(tokenizer, prompts, g, cfg.rollout.max_new_tokens))
    for t, (reward, details) in zip(trajs, pool.score([(t.text, prompts[i // g]) for i, t in enumerate(trajs)])):
        t.reward, t.reward_details = reward, details
    return [Group(p, trajs[i * g : (i + 1) * g]) for i, p in enumerate(prompts)]


def _measure_decode(cfg, model, tokenizer, groups: list) -> dict:
    """Time ``generate`` on 1..48 groups at 1 and 2 threads and fit the per-step cost terms."""
    from tidal.rollout.local import LocalEngine
    from tidal.rollout.requests import group_requests

    engine = LocalEngine(model, tokenizer, cfg.rollout, seed=cfg.seed)  # same seed: the same tokens again
    g = cfg.rollout.group_size
    rows, times = {"1": [], "2": []}, {"1": [], "2": []}
    start = 0
    for n in (1, 2, 4, 8, 16, 32, 48):
        chosen = groups[start : start + n]
        start = (start + n) % max(len(groups) - 48, 1)
        requests = group_requests(tokenizer, [x.prompt for x in chosen], g, cfg.rollout.max_new_tokens)
        lens = [len(t.token_ids) for x in chosen for t in x.trajectories]
        plen = [len(r.prompt_ids) for r in requests]
        ctx = sum(k * p + k * (k - 1) / 2 for k, p in zip(lens, plen))
        for threads in ("1", "2"):
            torch.set_num_threads(int(threads))
            times[threads].append(_best(engine.generate, requests))
            rows[threads].append([max(lens), sum(lens), ctx, 1.0])
    # No prompt-token term: prompts are a constant length here, so it is collinear with the tokens
    # and steals the per-row cost (prefill is measured on its own below).
    names = ["step_s", "per_seq_s", "per_ctx_token_s", "call_s"]
    return {k: _fit(rows[k], times[k], names) for k in rows}


@torch.no_grad()
def _measure_prefill(model) -> dict:
    from transformers import DynamicCache

    def forward(ids, mask):
        model(input_ids=ids, attention_mask=mask, position_ids=mask.cumsum(-1) - 1, past_key_values=DynamicCache(),
              use_cache=True)

    rows, times = {"1": [], "2": []}, {"1": [], "2": []}
    for b, width in [(32, 16), (64, 24), (128, 32), (256, 40), (384, 56)]:
        ids = torch.randint(3, 40, (b, width))
        mask = torch.ones_like(ids)
        for threads in ("1", "2"):
            torch.set_num_threads(int(threads))
            times[threads].append(_best(forward, ids, mask))
            rows[threads].append([b * width, 1.0])
    return {k: _fit(rows[k], times[k], ["per_token_s", "call_s"])["per_token_s"] for k in rows}


def _measure_train(cfg, model, tokenizer, groups: list) -> dict:
    """``build_train_batch`` + ``Trainer.step`` on batches of 1..12 informative groups (the trainer skips
    the others), fit as step_s + per_padded_token_s * rows * width; and the weight sync's two halves."""
    import copy

    from tidal.system.batching import informative
    from tidal.train.batch import build_train_batch
    from tidal.train.trainer import Trainer

    useful = [x for x in groups if informative(x)]
    trainer = Trainer(copy.deepcopy(model), cfg.algo, cfg.optim, cfg.trainer)
    def step(groups):
        trainer.step(build_train_batch(groups, cfg.algo, tokenizer.pad_token_id)[0])

    rows, times = {"1": [], "2": []}, {"1": [], "2": []}
    for n in (1, 2, 4, 8, 12):
        batch_groups = useful[:n]
        batch, _ = build_train_batch(batch_groups, cfg.algo, tokenizer.pad_token_id)
        for threads in ("1", "2"):
            torch.set_num_threads(int(threads))
            times[threads].append(_best(step, batch_groups))
            rows[threads].append([batch.input_ids_bt.numel(), 1.0])
    out = {k: _fit(rows[k], times[k], ["per_padded_token_s", "step_s"]) for k in rows}
    engine_model = copy.deepcopy(model).eval()
    for k in out:
        torch.set_num_threads(int(k))
        out[k]["weight_sync_s"] = _best(trainer.state_dict_for_engine, reps=5)
        out[k]["weight_load_s"] = _best(engine_model.load_state_dict, trainer.state_dict_for_engine(), reps=5)
    return out


def _measure_overlap(cfg, model, tokenizer, groups: list, seconds: float = 3.0) -> dict:
    """Generation and training each alone, then both at once on two threads (1 torch thread each, the
    async controller's setting); fastest-quartile times, so outside load inflates them less."""
    import copy

    from tidal.rollout.local import LocalEngine
    from tidal.rollout.requests import group_requests
    from tidal.system.batching import informative
    from tidal.train.batch import build_train_batch
    from tidal.train.trainer import Trainer

    torch.set_num_threads(1)
    engine = LocalEngine(model, tokenizer, cfg.rollout, seed=cfg.seed)
    trainer = Trainer(copy.deepcopy(model), cfg.algo, cfg.optim, cfg.trainer)
    requests = group_requests(tokenizer, [x.prompt for x in groups[:16]], cfg.rollout.group_size,
                              cfg.rollout.max_new_tokens)
    batch_groups = [x for x in groups if informative(x)][:5]  # one step's informative groups (~30% of 16)
    jobs = {"gen": lambda: engine.generate(requests),
            "train": lambda: trainer.step(build_train_batch(batch_groups, cfg.algo, tokenizer.pad_token_id)[0])}

    def loop(fn, stop: threading.Event, out: list):
        while not stop.is_set():
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)

    def quartile(xs):
        return sorted(xs)[len(xs) // 4]

    alone = {}
    for name, fn in jobs.items():
        out, stop = [], threading.Event()
        threading.Timer(seconds / 2, stop.set).start()
        loop(fn, stop, out)
        alone[name] = quartile(out)
    outs, stop = {"gen": [], "train": []}, threading.Event()
    workers = [threading.Thread(target=loop, args=(fn, stop, outs[name])) for name, fn in jobs.items()]
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    both = {k: quartile(v) for k, v in outs.items()}
    return {"gen_alone_s": alone["gen"], "train_alone_s": alone["train"], "gen_both_s": both["gen"],
            "train_both_s": both["train"], "gen_slowdown": both["gen"] / alone["gen"],
            "train_slowdown": both["train"] / alone["train"]}


def calibrate() -> dict:
    from tidal.rewards import build_reward
    from tidal.rewards.pool import RewardPool

    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    cfg, task, model, tokenizer = _setup()
    pool = RewardPool(build_reward(cfg.reward.name, cfg.reward.params), cfg.reward)
    try:
        torch.set_num_threads(2)
        groups = _sample_groups(cfg, task, model, tokenizer, pool, 200)
        decode = _measure_decode(cfg, model, tokenizer, groups)
        prefill = _measure_prefill(model)
        train = _measure_train(cfg, model, tokenizer, groups)
        overlap = _measure_overlap(cfg, model, tokenizer, groups)
        reward = {}
        for name, n in [("group", 1), ("batch", 16)]:
            items = [(t.text, x.prompt) for x in groups[:n] for t in x.trajectories]
            pool.score(items)  # warm
            reward[name] = _best(pool.score, items, reps=5)
    finally:
        pool.close()
    from tidal.system.batching import informative

    lengths = [len(t.token_ids) for x in groups for t in x.trajectories]
    values, counts = np.unique(np.asarray(lengths), return_counts=True)
    return {
        "benchmark": "simulate_calibrate",
        "description": DESCRIPTION,
        "measured": time.strftime("%Y-%m-%d %H:%M"),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg()[0],
        "seconds": time.perf_counter() - started,
        "decode": decode,
        "prefill_per_token_s": prefill,
        "train": train,
        "overlap": overlap,
        "reward_s": reward,
        "prompt_len": statistics.mean(len(t.prompt_ids) for x in groups for t in x.trajectories),
        "lengths": {"values": values.tolist(), "weights": counts.tolist(), "mean": float(np.mean(lengths))},
        "informative_frac": sum(map(informative, groups)) / len(groups),
        "groups": [{"lengths": [len(t.token_ids) for t in x.trajectories], "informative": informative(x)}
                   for x in groups],
    }


def run(overrides: list[str], out_dir: Path) -> dict:
    """``tidal bench simulate_calibrate``: measure, write ``sim_calibration.json``, show the table."""
    result = calibrate()
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    table = [{"threads": k, **{f"decode_{n}": v for n, v in result["decode"][k].items()},
              "prefill_per_token_s": result["prefill_per_token_s"][k],
              **{f"train_{n}": v for n, v in result["train"][k].items()}} for k in ("1", "2")]
    return {**result, "table": table}


if __name__ == "__main__":
    res = calibrate()
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("lengths", "groups")}, indent=2))
