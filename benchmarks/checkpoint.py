"""What a checkpoint at every step costs a training step: no saves vs synchronous vs asynchronous saves.

The model has Qwen2.5-0.5B's shapes (``benchmarks/gpu.py`` ``MODELS``: hidden 896, 14 heads, 2 KV heads,
intermediate 4864, vocab 151,936, tied embeddings), built here with random float32 weights (no hub);
``num_layers`` shrinks the 24 decoder layers for a quicker run (the JSON says how many it had). A step is
one forward and backward of the causal-LM loss on ``rows`` x ``seq_len`` random tokens and one AdamW step,
the work of ``Trainer.step`` without the RL loss terms. The checkpoint is ``train/checkpoint.py``'s (weights
as ``model.safetensors``, the AdamW moments, scheduler and RNG in ``trainer_state.pt``, ``hashes.json``,
tmp-then-rename), with ``keep=1``.

Arms, interleaved in every repeat (``none``, ``sync``, ``async``) so a noisy neighbour on the shared machine
hits all of them alike:

- ``none``: the step alone;
- ``sync``: the step, then ``save_checkpoint`` (write and hash every file, rename) before the next step;
- ``async``: the step, then ``AsyncCheckpointer.save``: wait for the previous write if it is still running,
  snapshot into the reused host buffers, hand the write to the background thread. Its step time includes
  whatever the background write takes from the step (CPU, memory bandwidth) and any wait for it.

Each arm runs ``steps`` timed steps per repeat after one untimed warm-up step per repeat (the async arm's
warm-up step saves too, so every timed async step runs beside the previous step's write: the steady state of
a run that checkpoints every step); a step's time is from the start of its forward to the return of its save
call. ``*_ckpt_overhead_frac`` = median step time
of the arm / median step time of ``none`` - 1, medians over every timed step of every repeat. The first
snapshot allocates the host buffers (page faults, a one-time cost: ``first_snapshot_s``); it is taken in an
untimed warm-up. The async arm's last write of each repeat finishes untimed before the next arm starts
(``drain_s``): a run pays it once, at its end.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal import bench
from tidal.config import apply_overrides
from tidal.models import tiny
from tidal.train.async_checkpoint import AsyncCheckpointer
from tidal.train.checkpoint import TrainingState, save_checkpoint

DESCRIPTION = "checkpoint every step: step time with no saves vs synchronous vs asynchronous saves (0.5B shapes)"
ARMS = ("none", "sync", "async")


@dataclass
class Settings:
    model: str = "qwen2.5-0.5b"
    """A key of ``benchmarks/gpu.py`` ``MODELS``."""
    num_layers: list[int] = field(default_factory=lambda: [24, 4])
    """Decoder layers of each model measured (Qwen2.5-0.5B has 24; 4 keeps its embedding and head, the
    largest matrices, at a sixth of the layers' time). The top-level keys are the first model's."""
    rows: int = 1
    seq_len: int = 512
    """Tokens per step = rows x seq_len."""
    steps: int = 2
    """Timed steps per arm and repeat."""
    repeats: int = 3
    threads: int = 2
    """torch threads (the machine this was measured on has 2 cores)."""
    seed: int = 0
    out: str = ""
    """Where the checkpoints are written (default: the benchmark's output directory); removed at the end."""


def _settings(overrides: list[str]) -> Settings:
    return apply_overrides(Settings(), overrides)


def _build(s: Settings, num_layers: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    shapes = {**bench.load("gpu").MODELS[s.model], "num_hidden_layers": num_layers}
    with torch.random.fork_rng():
        torch.manual_seed(s.seed)
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shapes, attn_implementation="sdpa"),
                                                 dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    return model, opt, sched, shapes


def _step(model, opt, sched, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _state_bytes(model, opt) -> int:
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    moments = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor))
    return sum(params.values()) + moments


def run(overrides: list[str], out_dir: Path) -> dict:
    s = _settings(overrides)
    torch.set_num_threads(s.threads)
    root = Path(s.out) if s.out else Path(out_dir) / "ckpt"
    runs = {}
    try:
        for num_layers in s.num_layers:
            runs[str(num_layers)] = measure(s, num_layers, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    first = runs[str(s.num_layers[0])]
    return {"benchmark": "checkpoint", "description": DESCRIPTION, "settings": dataclasses.asdict(s),
            "async_ckpt_overhead_frac": first["async_ckpt_overhead_frac"],
            "sync_ckpt_overhead_frac": first["sync_ckpt_overhead_frac"],
            "model": first["model"], "runs": runs,
            "table": [{"layers": int(n), **row} for n, r in runs.items() for row in r.pop("table")]}


def measure(s: Settings, num_layers: int, root: Path) -> dict:
    """The three arms on one model (see the module docstring)."""
    shutil.rmtree(root, ignore_errors=True)
    model, opt, sched, shapes = _build(s, num_layers)
    tokenizer = tiny.build_tokenizer()  # saved with each checkpoint, as a run's is; its size is negligible
    gen = torch.Generator().manual_seed(s.seed)
    ids = torch.randint(0, shapes["vocab_size"], (s.rows, s.seq_len), generator=gen)
    writer = AsyncCheckpointer()
    step_no = 0

    def state() -> TrainingState:
        return TrainingState(step=step_no, version=step_no, next_group=0, extra={})

    _step(model, opt, sched, ids)  # the AdamW moments exist from here on
    step_no += 1
    start = time.perf_counter()
    writer.save(root / "async", model, tokenizer, opt, sched, state(), keep=1)  # allocates the host buffers
    first_snapshot_s = time.perf_counter() - start
    writer.wait()
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    snapshot_s, wait_s, write_s, sync_save_s, drain_s, write_cpu_s, step_cpu_s = [], [], [], [], [], [], []
    for _ in range(s.repeats):
        for arm in ARMS:
            _step(model, opt, sched, ids)  # warm-up, untimed
            step_no += 1
            if arm == "async":  # so every timed step runs beside the previous step's write, as at every step of a run
                writer.save(root / "async", model, tokenizer, opt, sched, state(), keep=1)
            for _ in range(s.steps):
                start, cpu = time.perf_counter(), time.process_time()
                _step(model, opt, sched, ids)
                step_no += 1
                if arm == "none":
                    step_cpu_s.append(time.process_time() - cpu)
                if arm == "sync":
                    saved = time.perf_counter()
                    save_checkpoint(root / "sync", model, tokenizer, opt, sched, state(), keep=1)
                    sync_save_s.append(time.perf_counter() - saved)
                elif arm == "async":
                    previous = dict(writer.timings)
                    writer.save(root / "async", model, tokenizer, opt, sched, state(), keep=1)
                    snapshot_s.append(writer.timings["snapshot_s"])
                    wait_s.append(writer.timings["wait_s"])
                    if "write_s" in previous:
                        write_s.append(previous["write_s"])
                        write_cpu_s.append(previous["write_cpu_s"])
                times[arm].append(time.perf_counter() - start)
            if arm == "async":
                start = time.perf_counter()
                writer.wait()
                drain_s.append(time.perf_counter() - start)
                write_s.append(writer.timings["write_s"])
                write_cpu_s.append(writer.timings["write_cpu_s"])
    writer.wait()
    checkpoint_bytes = sum(p.stat().st_size for p in (root / "async").rglob("*") if p.is_file())

    median = {arm: statistics.median(ts) for arm, ts in times.items()}
    overhead = {arm: median[arm] / median["none"] - 1.0 for arm in ARMS}
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    table = [{"arm": arm, "median_step_s": median[arm], "overhead_frac": overhead[arm], "timed_steps": len(times[arm]),
              "min_step_s": min(times[arm]), "max_step_s": max(times[arm])} for arm in ARMS]
    return {
        "model": f"{s.model} shapes with {num_layers} decoder layers (Qwen2.5-0.5B has 24), random float32 weights",
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_per_step": s.rows * s.seq_len,
        "threads": s.threads,
        "async_ckpt_overhead_frac": overhead["async"],
        "sync_ckpt_overhead_frac": overhead["sync"],
        "median_step_s": median,
        "state_bytes": _state_bytes(model, opt),
        "checkpoint_bytes": checkpoint_bytes,
        "first_snapshot_s": first_snapshot_s,
        "async_snapshot_s_median": med(snapshot_s),
        "async_wait_for_previous_write_s_median": med(wait_s),
        "async_background_write_s_median": med(write_s),
        # a CPU-bound step on every core cannot hide more than the idle share of its cores: this ratio bounds
        # what an asynchronous write can save there
        "async_background_write_cpu_s_median": med(write_cpu_s),
        "none_step_cpu_s_median": med(step_cpu_s),
        "async_drain_s_median": med(drain_s),
        "sync_save_s_median": med(sync_save_s),
        "step_times_s": times,
        "table": table,
    }
