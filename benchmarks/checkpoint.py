"""What checkpoints cost a training loop, saved the way runs save them: every step and every 10 steps, with no
saves vs synchronous vs asynchronous saves, and how long an asynchronous save blocks the loop.

The model has Qwen2.5-0.5B's shapes (``benchmarks/gpu.py`` ``MODELS``: hidden 896, 14 heads, 2 KV heads,
intermediate 4864, vocab 151,936, tied embeddings) with ``num_layers`` of its 24 decoder layers (4 keeps the
embedding and head, its largest matrices: 196M parameters, 2.35 GB of weights and AdamW moments per
checkpoint), built here with random float32 weights (no hub). A step is one forward and backward of the
causal-LM loss on ``rows`` x ``seq_len`` random tokens and one AdamW step, the work of ``Trainer.step`` without
the RL loss terms. The checkpoint is ``train/checkpoint.py``'s (``model.safetensors``, ``trainer_state.pt``
with the AdamW moments, scheduler and RNG, ``hashes.json``, tmp-then-rename), ``keep=1``.

Arms, interleaved in every repeat so that a noisy neighbour on the shared machine hits all of them alike:

- ``none``: ``steps_none`` steps, no saves;
- ``sync_every{N}`` for N in ``every``: the step, then ``save_checkpoint`` after every N-th step;
- ``async_every{N}``: the step, then ``AsyncCheckpointer.save`` after every N-th step: wait for the previous
  write if it still runs, snapshot into the reused host buffers, write on a background thread. A step's time
  includes what the background write takes from it (CPU, memory bandwidth) and any wait.

- ``deferred_every{N}``: as ``async_every{N}`` with ``checkpoint_snapshot=deferred``
  (``AsyncCheckpointer(deferred=True)``): ``save`` takes references, the writer's thread copies the state into
  the host buffers beside the next step's forward and backward, and that step's optimizer step waits for the
  copy if it is not done yet. Its blocking time is ``save``'s own time plus that wait.

For N = 1 an arm times ``steps`` steps, each followed by a save (the async arm saves after an untimed warm-up
step first, so every timed step runs beside the previous step's write, as in a run that saves every step).
For N > 1 it times a window of N steps with one save, after the window's first step, so the write runs
beside the N - 1 steps that follow it, as in a run; whatever of the write is left when the window ends is
waited for untimed (``drain_s``, ~0 when the write fits in the window) and reported.

Every number is per repeat first (an arm's *mean* step time over its steps: a checkpoint's cost lands on
one step of N, and the mean is what a run pays; an overhead is that mean over the same repeat's ``none``
mean, minus 1), then the median over the repeats, with ``spread`` giving [min, max] across repeats.

- ``blocking_s_per_checkpoint``: what ``AsyncCheckpointer.save`` kept the training thread for (the snapshot,
  plus any wait for the previous write), in the ``every{max}`` arm, where the previous write is long done;
  ``blocking_s_per_checkpoint_every1`` is the same at every step, waits included.
- ``async_blocking_over_sync``: that over the same repeat's synchronous save time (``sync_save_s``);
  ``deferred_blocking_over_sync`` the same for the deferred snapshot (``deferred_blocking_s_per_checkpoint``:
  ``save`` plus the optimizer step's wait for the copy).
- ``writer_cpu_s_per_gb``: the background writer thread's CPU time per GB written; ``legacy_*``: the writer
  before issue 55 (``save_file`` and ``torch.save`` through the page cache, the files read back to hash them),
  one synchronous save per repeat on the same state, timed beside the others.

Run time: with the defaults (16 tokens, 1 thread) a step is ~2.25 s on the 2-core machine, mostly AdamW over
196M parameters and the 151,936-row head; one repeat, 34 timed steps plus the saves and the legacy write, takes
~2 minutes (load average 2.5-3.5), the default 3 repeats ~6; more under load (a step was 4-20 s at load
10-18). On a loaded machine run ``repeats=1`` a few times and ``merge`` the results, as the committed run did
(docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import os
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
from tidal.train.checkpoint import HASHED, TrainingState, capture, save_checkpoint, write_hashes

DESCRIPTION = ("checkpoints at every step and every 10 steps: step time with no saves vs synchronous vs "
               "asynchronous saves, and the asynchronous save's blocking time (0.5B shapes)")


@dataclass
class Settings:
    model: str = "qwen2.5-0.5b"
    """A key of ``benchmarks/gpu.py`` ``MODELS``."""
    num_layers: int = 4
    """Decoder layers (Qwen2.5-0.5B has 24; 24 needs ~14 GB of memory here)."""
    rows: int = 1
    seq_len: int = 16
    """Tokens per step = rows x seq_len. Few: the step is then mostly AdamW over 196M parameters and the
    151,936-row head, short enough that an every-10 window fits a run, and a checkpoint weighs more against
    it than against a longer step (the overheads are upper ends)."""
    every: list[int] = field(default_factory=lambda: [1, 10])
    """``checkpoint_every`` of the save arms."""
    kinds: list[str] = field(default_factory=lambda: ["sync", "async", "deferred"])
    """The save arms at each ``every``: ``sync``, ``async`` (snapshot at the save), ``deferred``."""
    steps: int = 2
    """Timed steps per repeat of an every-1 arm (an every-N arm times N)."""
    steps_none: int = 10
    """Timed steps per repeat of the no-save arm (as many as the every-10 window: the reference of its mean)."""
    repeats: int = 3
    warmup: int = 3
    """Untimed steps before the first repeat: the first steps after the model is built ran up to 2x slower
    here (memory first touched), which landed on the first repeat's no-save arm."""
    threads: int = 1
    """torch threads. 1: the 2-core machine this is measured on is shared, and a 2-thread step beside another
    busy process is several times slower (FACTS.md); 2 for an idle machine."""
    legacy: bool = True
    """Time the pre-issue-55 writer once per repeat (``legacy_*``)."""
    seed: int = 0
    merge: list[str] = field(default_factory=list)
    """Result files of earlier runs with the same settings: report their repeats together, measure nothing."""
    out: str = ""
    """Where the checkpoints are written (default: the benchmark's output directory); removed at the end."""


def _settings(overrides: list[str]) -> Settings:
    return apply_overrides(Settings(), overrides)


def _build(s: Settings):
    from transformers import AutoModelForCausalLM, Qwen2Config

    shapes = {**bench.load("gpu").MODELS[s.model], "num_hidden_layers": s.num_layers}
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


def legacy_write(directory: Path, model, tokenizer, contents) -> None:
    """The checkpoint writer before issue 55, without its rename: ``save_pretrained`` through safetensors'
    ``save_file``, ``torch.save`` with the zip's CRC-32, both into the page cache, then every file read back
    to hash it."""
    directory.mkdir(parents=True)
    tokenizer.save_pretrained(directory)
    model.save_pretrained(directory, safe_serialization=True, state_dict=dict(contents.model_state or {}) or None)
    torch.save({"optimizer": contents.optimizer, "scheduler": contents.scheduler, "rng": contents.rng,
                "state": contents.state}, directory / "trainer_state.pt")
    write_hashes(directory, list(HASHED))


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _spread(xs: list[float]) -> list[float] | None:
    return [min(xs), max(xs)] if xs else None


def run(overrides: list[str], out_dir: Path) -> dict:
    s = _settings(overrides)
    torch.set_num_threads(s.threads)
    if s.merge:
        return {"benchmark": "checkpoint", "description": DESCRIPTION, "settings": dataclasses.asdict(s),
                **merge(s.merge, s)}
    root = Path(s.out) if s.out else Path(out_dir) / "ckpt"
    try:
        result = measure(s, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"benchmark": "checkpoint", "description": DESCRIPTION, "settings": dataclasses.asdict(s), **result}


def measure(s: Settings, root: Path) -> dict:
    """The arms on one model, ``repeats`` times (see the module docstring)."""
    shutil.rmtree(root, ignore_errors=True)
    model, opt, sched, shapes = _build(s)
    tokenizer = tiny.build_tokenizer()  # saved with each checkpoint, as a run's is; its size is negligible
    gen = torch.Generator().manual_seed(s.seed)
    ids = torch.randint(0, shapes["vocab_size"], (s.rows, s.seq_len), generator=gen)
    writer = AsyncCheckpointer()
    deferred_writer = AsyncCheckpointer(deferred=True)
    step_no = 0

    def state() -> TrainingState:
        return TrainingState(step=step_no, version=step_no, next_group=0, extra={})

    def train_step() -> None:
        nonlocal step_no
        _step(model, opt, sched, ids)
        step_no += 1

    for _ in range(1 + s.warmup):  # the AdamW moments exist from here on
        train_step()
    start = time.perf_counter()
    writer.save(root / "async", model, tokenizer, opt, sched, state(), keep=1)  # allocates the host buffers
    first_snapshot_s = time.perf_counter() - start
    writer.wait()
    if "deferred" in s.kinds:  # its own host buffers, allocated here too (the first copy)
        deferred_writer.save(root / "deferred", model, tokenizer, opt, sched, state(), keep=1)
        train_step()
        deferred_writer.wait()
    arms = ["none", *(f"{kind}_every{n}" for n in s.every for kind in s.kinds)]
    longest = max(s.every)
    repeats = []
    for _ in range(s.repeats):
        r: dict = {"mean_step_s": {}, "sync_save_s": [], "sync_save_cpu_s": [], "blocking_s": {}, "snapshot_s": [],
                   "deferred_blocking_s": {},
                   "write_s": [], "write_cpu_s": [], "drain_s": [], "step_s": {}, "step_cpu_s": []}
        for arm in arms:
            kind, n = (arm, 0) if arm == "none" else (arm.split("_every")[0], int(arm.split("_every")[1]))
            count = s.steps_none if kind == "none" else (s.steps if n == 1 else n)
            saves_after = set(range(count)) if n == 1 else ({0} if n else set())
            blocking = r["blocking_s"].setdefault(n, []) if kind == "async" else None
            deferred_timings: list[dict] = []  # each deferred save's timings: its step's wait lands there later
            w = deferred_writer if kind == "deferred" else writer
            in_flight = False
            if kind in ("async", "deferred") and n == 1:  # a write in flight beside the first timed step
                train_step()
                w.save(root / kind, model, tokenizer, opt, sched, state(), keep=1)
                in_flight = True
            times = []
            for i in range(count):
                start, cpu = time.perf_counter(), time.process_time()
                train_step()
                if kind == "none":
                    r["step_cpu_s"].append(time.process_time() - cpu)  # every torch thread of the process
                if i in saves_after and kind == "sync":
                    saved, cpu = time.perf_counter(), time.thread_time()
                    save_checkpoint(root / "sync", model, tokenizer, opt, sched, state(), keep=1)
                    r["sync_save_s"].append(time.perf_counter() - saved)
                    r["sync_save_cpu_s"].append(time.thread_time() - cpu)
                elif i in saves_after and kind == "async":
                    # the write in flight (if any) records its times into this dict when it ends, which
                    # save() waits for before it starts a new one
                    previous = writer.timings
                    writer.save(root / "async", model, tokenizer, opt, sched, state(), keep=1)
                    blocking.append(writer.timings["wait_s"] + writer.timings["snapshot_s"])
                    r["snapshot_s"].append(writer.timings["snapshot_s"])
                    if in_flight:  # this arm's previous write
                        r["write_s"].append(previous["write_s"])
                        r["write_cpu_s"].append(previous["write_cpu_s"])
                    in_flight = True
                elif i in saves_after and kind == "deferred":
                    deferred_writer.save(root / "deferred", model, tokenizer, opt, sched, state(), keep=1)
                    deferred_timings.append(deferred_writer.timings)
                times.append(time.perf_counter() - start)
            if kind == "async":
                start = time.perf_counter()
                writer.wait()  # untimed: what is left of the last write
                r["drain_s"].append(time.perf_counter() - start)
                r["write_s"].append(writer.timings["write_s"])
                r["write_cpu_s"].append(writer.timings["write_cpu_s"])
                in_flight = False
            if kind == "deferred":
                if n == 1:
                    train_step()  # untimed: the last save's copy is waited for by a step, as in a run
                deferred_writer.wait()
                r["deferred_blocking_s"][n] = [t["wait_s"] + t["snapshot_s"] + t.get("step_wait_s", 0.0)
                                               for t in deferred_timings]
            r["step_s"][arm] = times
            r["mean_step_s"][arm] = statistics.fmean(times)
        if s.legacy:
            legacy = root / "legacy"
            shutil.rmtree(legacy, ignore_errors=True)
            contents = capture(model, opt, sched, state())
            start, cpu = time.perf_counter(), time.thread_time()
            legacy_write(legacy, model, tokenizer, contents)
            r["legacy_save_s"] = time.perf_counter() - start
            r["legacy_save_cpu_s"] = time.thread_time() - cpu
            shutil.rmtree(legacy, ignore_errors=True)
        repeats.append(r)
        means = {arm: round(t, 3) for arm, t in r["mean_step_s"].items()}
        blocked = {n: [round(t, 3) for t in b] for n, b in r["blocking_s"].items()}
        load = os.getloadavg() if hasattr(os, "getloadavg") else None
        print(f"[checkpoint] repeat {len(repeats)}/{s.repeats}: mean step s {means}, sync saves "
              f"{[round(t, 3) for t in r['sync_save_s']]} s, blocking {blocked} s, load average {load}", flush=True)
    writer.wait()
    checkpoint_bytes = sum(p.stat().st_size for p in (root / "async").rglob("*") if p.is_file())
    gb = checkpoint_bytes / 1e9

    per_repeat: dict[str, list[float]] = {}  # one number per repeat, for the medians and spreads

    def add(key: str, value: float | None) -> None:
        if value is not None:
            per_repeat.setdefault(key, []).append(value)

    for r in repeats:
        none = r["mean_step_s"]["none"]
        add("step_s_no_save", none)
        add("step_cpu_s_no_save", _median(r["step_cpu_s"]))
        for arm in arms[1:]:
            add(f"step_s_{arm}", r["mean_step_s"][arm])
            kind, n = arm.split("_every")
            add(f"{kind}_overhead_frac_every{n}", r["mean_step_s"][arm] / none - 1.0)
        sync_save = _median(r["sync_save_s"])
        add("sync_save_s", sync_save)
        add("sync_save_cpu_s", _median(r["sync_save_cpu_s"]))
        add("snapshot_s", _median(r["snapshot_s"]))
        add("blocking_s_per_checkpoint", _median(r["blocking_s"].get(longest, [])))
        if longest != 1:
            add("blocking_s_per_checkpoint_every1", _median(r["blocking_s"].get(1, [])))
        if sync_save and r["blocking_s"].get(longest):
            add("async_blocking_over_sync", _median(r["blocking_s"][longest]) / sync_save)
        if r["deferred_blocking_s"].get(longest):
            add("deferred_blocking_s_per_checkpoint", _median(r["deferred_blocking_s"][longest]))
            if sync_save:
                add("deferred_blocking_over_sync", _median(r["deferred_blocking_s"][longest]) / sync_save)
        add("writer_s", _median(r["write_s"]))
        add("writer_cpu_s", _median(r["write_cpu_s"]))
        add("writer_cpu_s_per_gb", _median([c / gb for c in r["write_cpu_s"]]))
        add("drain_s", _median(r["drain_s"]))
        if "legacy_save_s" in r:
            add("legacy_save_s", r["legacy_save_s"])
            add("legacy_writer_cpu_s_per_gb", r["legacy_save_cpu_s"] / gb)
    summary = summarize(per_repeat, arms)
    return {
        **summary,
        "model": f"{s.model} shapes with {s.num_layers} decoder layers (Qwen2.5-0.5B has 24), random float32 weights",
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": _state_bytes(model, opt),
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_gb": gb,
        "tokens_per_step": s.rows * s.seq_len,
        "threads": s.threads,
        "cpu_count": os.cpu_count(),
        "first_snapshot_s": first_snapshot_s,
        "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "step_times_s": [r["step_s"] for r in repeats],
    }


def summarize(per_repeat: dict[str, list[float]], arms: list[str]) -> dict:
    """The medians over repeats of the per-repeat numbers, their [min, max] spread, the goals and the table."""
    per_repeat = dict(per_repeat)
    longest = max(int(arm.split("_every")[1]) for arm in arms if arm != "none")
    if longest > 1 and all(k in per_repeat for k in ("blocking_s_per_checkpoint", "writer_cpu_s")):
        # what CPU accounting says async can add at most: the blocking, plus the writer's CPU were all of it
        # taken from the step, over the N steps a checkpoint is spread over; robust to a neighbour's bursts,
        # which move a mean of N loaded steps by more than the checkpoint does
        per_repeat[f"async_overhead_bound_every{longest}"] = [
            (b + c) / (longest * t) for b, c, t in zip(per_repeat["blocking_s_per_checkpoint"],
                                                       per_repeat["writer_cpu_s"], per_repeat["step_s_no_save"])]
    headline = {key: statistics.median(values) for key, values in per_repeat.items()}
    goals = {}
    if "async_blocking_over_sync" in headline:
        goals["async_blocking_over_sync <= 0.1"] = headline["async_blocking_over_sync"] <= 0.1
    if "async_overhead_frac_every10" in headline:
        goals["async_overhead_frac_every10 <= 0.05"] = headline["async_overhead_frac_every10"] <= 0.05
    if "deferred_blocking_over_sync" in headline:
        goals["deferred_blocking_over_sync <= 0.1"] = headline["deferred_blocking_over_sync"] <= 0.1
    if "deferred_overhead_frac_every10" in headline:
        goals["deferred_overhead_frac_every10 <= 0.05"] = headline["deferred_overhead_frac_every10"] <= 0.05
    key = lambda arm: "step_s_no_save" if arm == "none" else f"step_s_{arm}"  # noqa: E731
    table = [{"arm": arm, "every": 0 if arm == "none" else int(arm.split("_every")[1]),
              "mean_step_s": headline[key(arm)],
              "overhead_frac": 0.0 if arm == "none" else headline[arm.replace("_every", "_overhead_frac_every")],
              "mean_step_s_spread": _spread(per_repeat[key(arm)])} for arm in arms]
    return {**headline, "goals": goals, "repeats": len(per_repeat["step_s_no_save"]),
            "spread": {k: _spread(v) for k, v in per_repeat.items()}, "per_repeat": per_repeat, "table": table}


def merge(paths: list[str], s: Settings) -> dict:
    """Earlier runs' repeats as one result (a loaded machine's repeats split into runs of a few minutes each:
    every repeat is still its arms side by side). The runs must have measured the same thing."""
    import json

    runs = [json.loads(Path(p).read_text()) for p in paths]
    same = lambda r: {k: v for k, v in r["settings"].items() if k not in ("repeats", "out", "merge")}  # noqa: E731
    if any(same(r) != same(runs[0]) for r in runs):
        raise ValueError(f"merge: the runs' settings differ: {[same(r) for r in runs]}")
    per_repeat: dict[str, list[float]] = {}
    for r in runs:
        for k, values in r["per_repeat"].items():
            per_repeat.setdefault(k, []).extend(values)
    first = runs[0]
    arms = [row["arm"] for row in first["table"]]
    kept = ("model", "params", "state_bytes", "checkpoint_bytes", "checkpoint_gb", "tokens_per_step", "threads",
            "cpu_count", "first_snapshot_s")
    return {**summarize(per_repeat, arms), **{k: first[k] for k in kept}, "merged_from": paths,
            "settings_of_runs": first["settings"], "load_average_at_end": [r["load_average_at_end"] for r in runs],
            "step_times_s": [t for r in runs for t in r["step_times_s"]]}
