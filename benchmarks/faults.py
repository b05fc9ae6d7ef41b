"""Silent data corruption and elasticity: are injected bit flips found, where, how fast, at what cost?

Three parts (docs/faults.md):

1. *Flips.* Short sync RL runs of a small model (``tidal train quickstart`` shrunk: ``model_sets``) with
   ``num_faults`` one-bit flips at random steps (a weight at rest, an activation, a gradient, an
   optimizer state; random layer, element and bit 0-31; ``integrity/faults.py``), once per detection
   policy: ``replay_every=1`` (every step replayed: full verification) and the default-like cheap
   policy (``replay_every=0``: the at-rest check plus replay from the last checkpoint on an anomaly).
   The ``digit_match`` reward (partial credit) gives every step a learning signal, and a flip planned
   for a step that trains nothing fires at the next one that does, so every planned flip fires.
   Each detection rolls the run back to its last verified checkpoint and the run goes on. Reported:
   detection rate, localisation rate (right step, phase and layer, over detected flips), detection
   latency in steps, and whether the run ended with the fault-free run's exact weights; overall, per
   kind, and separately for result-changing and benign flips (whether the full-replay run's replay of
   the step found the state the step left changed: ``Mismatch.result_changed``).
2. *Overhead.* ``Trainer.step`` on one fixed batch of the quickstart model, with and without the
   recorder, alternated ``overhead_reps`` times: the median of the paired ratios, and the recorder's own
   timed work (``StepRecorder.seconds``) as a fraction of the plain step. A replay costs one more step
   per ``sdc.replay_every`` steps on top (1/N).
3. *Elastic.* Two torchft replicas (``parallel/elastic.py``) train ``elastic_steps`` steps; then again, with
   replica 1 killed (SIGKILL) a quarter of the way in and restarted after ``restart_after_s``; it heals
   from replica 0 and rejoins (``rejoined_at_step``: its first step with a peer). ``elastic_pairs`` such
   pairs. Reported: throughput kept (committed steps per second, faulted / fault-free: wall-clock, on a
   shared machine) and final greedy accuracy of both.

    tidal bench faults [--set num_faults=32 --set steps=40 --set elastic_steps=1500]
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.config import apply_overrides
from tidal.integrity.faults import KINDS, Fault
from tidal.integrity.sdc import StepRecorder, tracked_modules
from tidal.recipes import RECIPES
from tidal.system.run import prepare, train

DESCRIPTION = ("SDC detection (injected bit flips: detection, localisation, latency, overhead) "
               "and elastic DP (kill a replica)")


@dataclass
class Settings:
    steps: int = 40
    """RL steps of each flip run."""
    num_faults: int = 32
    """Flips per policy run, at distinct random steps (kinds round-robin: 8 of each kind by default)."""
    seed: int = 0
    policies: list[str] = field(default_factory=lambda: ["replay_every=1", "replay_every=0"])
    """``sdc.*`` setting of each flip run; ``[]`` skips the flip runs (with ``overhead_reps=0``: the elastic
    pairs only, e.g. ``tidal bench faults --set policies=[] --set overhead_reps=0 --set elastic_pairs=4
    --out benchmarks/results/faults_elastic``, kept as ``benchmarks/results/faults_elastic.json``)."""
    model_sets: list[str] = field(default_factory=lambda: [
        "model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=2",
        "model.intermediate_size=128", "sft.steps=60", "sft.accuracy_band=null", "sft.batch_size=64",
        "reward.name=digit_match", "reward.num_workers=0", "rollout.group_size=4", "rollout.prompts_per_step=16",
        "rollout.max_new_tokens=4",
        "system.mode=sync", "system.num_threads=1", "num_eval=64", "optim.lr=1e-3", "max_time_s=null",
        "target_accuracy=null", "log.progress=false", "log.tensorboard=false", "log.report=false"])
    checkpoint_every: int = 2
    overhead_reps: int = 11
    """Alternated plain / recorded steps; ``overhead_frac`` is the median of the 11 paired ratios (each pair
    ran back to back, so load from other jobs drifts less between them), ``overhead_frac_in_step`` the
    recorder's own timed share (``StepRecorder.seconds``); 0 skips the overhead arm."""
    overhead_prompts: int = 64
    """Prompts (x 8 samples) in the overhead batch, on the quickstart model (1M parameters)."""
    elastic_steps: int = 1500
    """Committed steps of each elastic run (at 600 the tiny model sits on its learning jump: 0.34-0.69
    between runs; 1500 is past it)."""
    restart_after_s: float = 2.0
    """Seconds between killing replica 1 and starting it again (its start-up, ~5 s here, comes on top)."""
    elastic_pairs: int = 2
    """Fault-free / killed pairs run one after the other (accuracy differs run to run by float summation
    order alone: one pair does not show the noise)."""
    kill_at_frac: float = 0.25
    """Replica 1 is killed when replica 0 has committed this fraction of ``elastic_steps``."""


def _cfg(s: Settings, out: Path, *extra: str):
    return apply_overrides(RECIPES.get("quickstart_grpo")(), [*s.model_sets, f"sft.cache_dir={out / 'cache'}",
                                                          f"max_steps={s.steps}", f"eval_every={s.steps}",
                                                          f"checkpoint_every={s.checkpoint_every}",
                                                          "keep_checkpoints=3", *extra])


def _faults(s: Settings, model: torch.nn.Module, seed: int) -> list[Fault]:
    rng = random.Random(seed)
    params = [n for n, _ in model.named_parameters()]
    layers = [n for n, _ in tracked_modules(model)]
    steps = sorted(rng.sample(range(1, s.steps + 1), s.num_faults))
    faults = []
    for i, step in enumerate(steps):
        kind = KINDS[i % len(KINDS)]
        target = rng.choice(layers if kind == "activation" else params)
        faults.append(Fault(kind, step, target, index=rng.randrange(1 << 20), bit=rng.randrange(32)))
    return faults


def _params(cfg, out: Path) -> dict[str, torch.Tensor]:
    controller = prepare(cfg, out, resume=True)
    try:
        return {k: v.clone() for k, v in controller.trainer.model.state_dict().items()}
    finally:
        controller.tracker.close()


def _rates(rows: list[dict]) -> dict:
    detected = [p for p in rows if p["detected"]]
    return {"injected": len(rows), "detected": len(detected), "localized": sum(p["localized"] for p in detected),
            "detection_rate": len(detected) / len(rows) if rows else None,
            "localization_rate": sum(p["localized"] for p in detected) / len(detected) if detected else None}


def flip_runs(s: Settings, root: Path) -> tuple[list[dict], dict]:
    """One faulted run per policy; a flip is *result-changing* when the full-replay run's replay of its step
    (against the fault-free recomputation of the same step) left a different state (``result_changed``)."""
    base = _cfg(s, root)
    clean_out = root / "clean"
    train(base, clean_out)
    clean = _params(base, clean_out)
    controller = prepare(base, root / "probe")
    model = controller.trainer.model
    controller.tracker.close()
    rows, faults_by_policy, changes = [], {}, {}
    for policy in s.policies:
        cfg = _cfg(s, root, f"sdc.{policy}", f"sdc.max_rollbacks={s.num_faults + 1}")
        faults = _faults(s, model, s.seed)
        out = root / policy.replace("=", "_")
        train(cfg, out, faults=faults)
        incidents = [json.loads(x) for x in (out / "sdc" / "incidents.jsonl").read_text().splitlines()] \
            if (out / "sdc" / "incidents.jsonl").exists() else []
        got = _params(cfg, out)
        per_fault = []
        for i, f in enumerate(faults):
            hit = next((x for x in incidents if x["step"] == f.fired_step), None) if f.fired else None
            if hit is not None and i not in changes:  # classified by the first policy that replayed it
                changes[i] = hit.get("result_changed", True)
            per_fault.append({
                "policy": policy, "kind": f.kind, "planned_step": f.step, "step": f.fired_step, "target": f.target,
                "bit": f.bit, "before": f.before, "after": f.after, "fired": f.fired, "detected": hit is not None,
                "localized": hit is not None and (hit["phase"], hit["layer"]) == (f.expected_phase, f.expected_layer),
                "latency_steps": hit["detected_at_step"] - f.fired_step if hit else None,
                "found": f"{hit['phase']} {hit['layer']}" if hit else None, "_i": i})
        faults_by_policy[policy] = per_fault
        fired = [p for p in per_fault if p["fired"]]
        detected = [p for p in fired if p["detected"]]
        rows.append({
            "arm": f"flips, sdc.{policy}", **_rates(fired), "planned": len(faults),
            "latency_steps_mean": statistics.mean(p["latency_steps"] for p in detected) if detected else None,
            "final_weights_equal_clean": all(torch.equal(got[k], clean[k]) for k in got),
            "false_alarms": len(incidents) - len(detected)})
    for policy, row in zip(s.policies, rows):
        for p in faults_by_policy[policy]:
            p["result_changed"] = changes.get(p.pop("_i"))
        fired = [p for p in faults_by_policy[policy] if p["fired"]]
        row["result_changing"] = _rates([p for p in fired if p["result_changed"]])
        row["benign"] = _rates([p for p in fired if p["result_changed"] is False])
        row["unclassified"] = sum(p["result_changed"] is None for p in fired)
        row["by_kind"] = {k: _rates([p for p in fired if p["kind"] == k]) for k in KINDS}
    return rows, faults_by_policy


def overhead(s: Settings) -> dict:
    """Median Trainer.step seconds with and without the recorder, on the quickstart model and a fixed batch."""
    from tidal.algo.config import AlgoConfig
    from tidal.models import tiny
    from tidal.optim import OptimConfig
    from tidal.train.config import TrainerConfig
    from tidal.train.trainer import Trainer
    from tidal.types import TrainBatch

    torch.set_num_threads(1)
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tiny.ModelConfig(), tok)
    g = torch.Generator().manual_seed(0)
    b, t, p = s.overhead_prompts * 8, 24, 8  # 8-token prompts, 16 sampled tokens: the quickstart's shape
    mask = torch.zeros(b, t)
    mask[:, p:] = 1
    batch = TrainBatch(torch.randint(3, len(tok), (b, t), generator=g), torch.ones(b, t, dtype=torch.long), mask,
                       -torch.rand(b, t, generator=g) * mask, torch.zeros(b, t, dtype=torch.long) - 1 + mask.long(),
                       torch.arange(b) // 8, (torch.rand(b, generator=g) > 0.5).float())
    plain = Trainer(copy.deepcopy(model), AlgoConfig(), OptimConfig(lr=1e-4), TrainerConfig())
    recorded = Trainer(copy.deepcopy(model), AlgoConfig(), OptimConfig(lr=1e-4), TrainerConfig())
    recorder = StepRecorder(recorded)
    times = {"plain": [], "recorded": []}
    for k in range(s.overhead_reps + 1):
        for name, trainer in (("plain", plain), ("recorded", recorded)):
            t0 = time.perf_counter()
            if trainer is recorded:
                recorder.begin_step(k + 1)
            trainer.step(batch)
            if trainer is recorded:
                recorder.end_step()
            if k:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
            else:
                recorder.seconds = 0.0
    plain_s, rec_s = statistics.median(times["plain"]), statistics.median(times["recorded"])
    paired = statistics.median(r / p for p, r in zip(times["plain"], times["recorded"])) - 1.0
    return {"arm": "recording overhead", "step_s_plain": plain_s, "step_s_recorded": rec_s,
            "overhead_frac": paired, "overhead_frac_medians": rec_s / plain_s - 1.0,
            "recorder_s_per_step": recorder.seconds / s.overhead_reps,
            "overhead_frac_in_step": recorder.seconds / s.overhead_reps / plain_s,
            "sequences": b, "params": sum(x.numel() for x in model.parameters())}


def _elastic(s: Settings, root: Path, kill: bool) -> dict:
    from tidal.parallel.diloco import start_lighthouse

    lighthouse = start_lighthouse(min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lighthouse.address()}
    outs = [root / f"{'kill' if kill else 'clean'}_{r}.json" for r in (0, 1)]
    logs = [o.with_suffix(".log") for o in outs]

    def start(r: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tidal.parallel.elastic", "--set", f"steps={s.elastic_steps}",
                                 "--set", f"out={outs[r]}"], env={**env, "REPLICA": str(r)},
                                stdout=subprocess.DEVNULL, stderr=logs[r].open("a"))  # a pipe fills up and blocks it

    def committed(r: int) -> int:
        path = Path(str(outs[r]) + ".progress")
        return len(path.read_text().splitlines()) if path.exists() else 0

    try:
        procs = [start(0), start(1)]
        killed_at = restarted_at = rejoined_at = None
        lines_before_restart = 0
        if kill:
            while committed(0) < s.elastic_steps * s.kill_at_frac:
                time.sleep(0.05)
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
            killed_at = committed(0)
            time.sleep(s.restart_after_s)
            restarted_at, lines_before_restart = committed(0), committed(1)
            procs[1] = start(1)
        for r, p in enumerate(procs):
            p.wait(timeout=1800)
            assert p.returncode == 0, f"elastic replica {r} failed: {logs[r].read_text()[-2000:]}"
        results = [json.loads(o.read_text()) for o in outs]
    finally:
        lighthouse.shutdown()
    progress = [json.loads(x) for x in Path(str(outs[0]) + ".progress").read_text().splitlines()]
    after = [json.loads(x) for x in Path(str(outs[1]) + ".progress").read_text().splitlines()][lines_before_restart:]
    if kill:  # replica 1's first step with a peer after its restart (None: it came back after replica 0 finished)
        rejoined_at = next((a["step"] for a in after if a["participants"] >= 2), None)
    return {"arm": f"elastic, {'replica 1 killed' if kill else 'fault-free'}", "steps": s.elastic_steps,
            "seconds": progress[-1]["t"], "steps_per_s": len(progress) / progress[-1]["t"],
            "accuracy": results[0]["accuracy"], "accuracy_replica1": results[1]["accuracy"],
            "replicas_identical": results[0]["param_bits"] == results[1]["param_bits"],
            "failed_attempts": results[0]["failed_attempts"], "min_participants": results[0]["min_participants"],
            "killed_at_step": killed_at, "restarted_at_step": restarted_at, "rejoined_at_step": rejoined_at,
            "steps_after_rejoin": len(after) if kill else None,
            "steps_alone": sum(p["participants"] == 1 for p in progress)}


def run(overrides: list[str], out_dir: Path) -> dict:
    s = apply_overrides(Settings(), overrides)
    torch.manual_seed(s.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        flip_rows, per_fault = flip_runs(s, root) if s.policies else ([], {})  # policies=[]: elastic only
        over = overhead(s) if s.overhead_reps else None
        elastic = []  # fault-free, killed, fault-free, killed, ...
        for i in range(s.elastic_pairs if s.elastic_steps else 0):
            (root / f"pair{i}").mkdir()
            elastic += [_elastic(s, root / f"pair{i}", kill=False), _elastic(s, root / f"pair{i}", kill=True)]
    full = flip_rows[0] if flip_rows else None
    result = {  # the goal is over the flips that change the result; every fired flip is in the table
        "detection_rate": full["result_changing"]["detection_rate"] if full else None,
        "localization_rate": full["result_changing"]["localization_rate"] if full else None,
        "overhead_frac": over["overhead_frac"] if over else None,
        "detection_latency_steps": full["latency_steps_mean"] if full else None,
        "policy": s.policies[0] if s.policies else None,
        "table": [*flip_rows, *([over] if over else []), *elastic], "faults": per_fault, "settings": s.__dict__,
    }
    if elastic:
        free, killed = elastic[0::2], elastic[1::2]
        kept = [k["steps_per_s"] / f["steps_per_s"] for f, k in zip(free, killed)]
        result["elastic"] = {"throughput_kept": statistics.median(kept), "throughput_kept_pairs": kept,
                             "accuracy_fault_free": statistics.mean(f["accuracy"] for f in free),
                             "accuracy_killed": statistics.mean(k["accuracy"] for k in killed),
                             "accuracy_fault_free_pairs": [f["accuracy"] for f in free],
                             "accuracy_killed_pairs": [k["accuracy"] for k in killed],
                             "rejoined_at_step_pairs": [k["rejoined_at_step"] for k in killed]}
    return result
