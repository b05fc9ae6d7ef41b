"""``tidal bench trl``'s harness without installing TRL: the summary on synthetic curves, the shared clock,
the TRL script's reward and prompt export, the settings both runs share, and the tidal side on a toy size.
One optional test (marked slow) runs 2 TRL steps when the benchmark's TRL environment already exists."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tidal import bench
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig

trl_bench = bench.load("trl")
grpo = trl_bench.grpo
TOY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
       "model.intermediate_size=64", "sft.steps=2", "sft.accuracy_band=null", "sft.batch_size=8", "num_eval=8",
       "rollout.prompts_per_step=2", "rollout.group_size=2", "snapshot_every_s=0.05", "report_at=[0.1]"]


# ---- the summary ------------------------------------------------------------------------------------------
def test_accuracy_at_interpolates_between_snapshots_and_stops_at_the_last():
    curve = [(0.0, 0.3), (10.0, 0.5), (20.0, 0.4)]
    assert trl_bench.accuracy_at(curve, 0.0) == 0.3
    assert trl_bench.accuracy_at(curve, 5.0) == pytest.approx(0.4)
    assert trl_bench.accuracy_at(curve, 15.0) == pytest.approx(0.45)
    assert trl_bench.accuracy_at(curve, 20.0) == 0.4
    assert trl_bench.accuracy_at(curve, 20.5) is None
    assert trl_bench.accuracy_at([(0.0, 0.3)], 0.0) == 0.3


def test_time_to_reach_is_the_first_crossing():
    curve = [(0.0, 0.3), (10.0, 0.5), (20.0, 0.4), (30.0, 0.7)]
    assert trl_bench.time_to_reach(curve, 0.2) == 0.0  # already there at the start
    assert trl_bench.time_to_reach(curve, 0.4) == pytest.approx(5.0)
    assert trl_bench.time_to_reach(curve, 0.6) == pytest.approx(20.0 + 10.0 * 2 / 3)  # after the dip
    assert trl_bench.time_to_reach(curve, 0.8) is None


def _steps(n, seconds_per_step):
    return [{"step": i, "elapsed_s": i * seconds_per_step} for i in range(1, n + 1)]


def test_summary_reports_the_speedup_and_both_goals():
    runs = {
        "trl": {"curve": [(0.0, 0.4), (150.0, 0.5), (300.0, 0.6)], "steps": _steps(600, 0.5), "samples_per_step": 256},
        "tidal": {"curve": [(0.0, 0.4), (50.0, 0.6), (100.0, 0.8), (300.0, 0.9)], "steps": _steps(1000, 0.3),
                  "samples_per_step": 256},
    }
    out = trl_bench.summarize(runs, [60.0, 300.0], 300.0)
    assert out["target_accuracy"] == 0.6 and out["tidal_time_to_target_s"] == pytest.approx(50.0)
    assert out["speedup"] == pytest.approx(6.0) and out["goal_3x_sooner"] and out["goal_higher_at_end"]
    assert out["trl_best_accuracy"] == 0.6 and out["tidal_time_to_trl_best_s"] == pytest.approx(50.0)
    assert out["trl_time_to_best_s"] == pytest.approx(300.0) and out["speedup_to_trl_best"] == pytest.approx(6.0)
    assert [r["best_accuracy"] for r in out["table"]] == [0.6, 0.9]
    assert [r["s_to_trl_best"] for r in out["table"]] == [pytest.approx(300.0), pytest.approx(50.0)]
    trl_row, tidal_row = out["table"]
    assert trl_row["framework"] == "trl" and trl_row["steps"] == 600 and trl_row["steps_per_s"] == pytest.approx(2.0)
    assert trl_row["samples_per_s"] == pytest.approx(512.0) and trl_row["base_accuracy"] == 0.4
    assert trl_row["acc_at_60s"] == pytest.approx(0.44) and tidal_row["acc_at_60s"] == pytest.approx(0.64)
    assert trl_row["acc_at_300s"] == 0.6 and tidal_row["acc_at_300s"] == 0.9
    assert trl_row["s_to_trl_300s_acc"] == pytest.approx(300.0) and tidal_row["s_to_trl_300s_acc"] == pytest.approx(50)
    assert bench.format_table(out["table"]).count("\n") == 3


def test_summary_says_when_the_goal_is_missed():
    runs = {"trl": {"curve": [(0.0, 0.4), (300.0, 0.7)], "steps": _steps(10, 30.0), "samples_per_step": 4},
            "tidal": {"curve": [(0.0, 0.4), (300.0, 0.65)], "steps": _steps(10, 30.0), "samples_per_step": 4}}
    out = trl_bench.summarize(runs, [300.0], 300.0)
    assert out["tidal_time_to_target_s"] is None and out["speedup"] is None and out["tidal_time_to_trl_best_s"] is None
    assert not out["goal_3x_sooner"] and not out["goal_higher_at_end"]


def test_late_swing_is_the_largest_drop_once_at_0_8():
    curve = [(0, 0.5), (10, 0.3), (20, 0.85), (30, 0.7), (40, 0.9), (50, 0.88)]
    assert trl_bench.late_swing(curve) == pytest.approx(0.15)
    assert trl_bench.late_swing([(0, 0.5), (10, 0.3)]) == 0.0  # never at 0.8: the early dip does not count
    assert trl_bench.late_swing([(0, 0.8), (10, 0.9)]) == 0.0


def test_across_bases_takes_medians_and_counts_goals():
    def base(speedup, higher, tidal_best):
        return {"speedup_to_trl_best": speedup, "goal_higher_at_end": higher,
                "table": [{"framework": "trl", "best_accuracy": 0.9, "acc_at_60s": 0.5, "late_swing": 0.1},
                          {"framework": "tidal", "best_accuracy": tidal_best, "acc_at_60s": 0.7, "late_swing": 0.0}]}
    out = trl_bench.across_bases([base(4.0, True, 0.95), base(None, False, 0.85), base(2.0, True, 0.92)], [60.0])
    assert out["num_bases"] == 3 and out["bases_3x_sooner_to_trl_best"] == 1 and out["bases_higher_at_end"] == 2
    assert out["median_speedup_to_trl_best"] == 2.0  # a base that never got there ranks lowest
    assert out["tidal_median_best_accuracy"] == 0.92 and out["trl_median_acc_at_60s"] == 0.5


def test_others_cores_is_machine_cpu_minus_ours():
    assert trl_bench.others_cores((100.0, 10.0, 0.0), (130.0, 25.0, 10.0)) == pytest.approx(1.5)
    start = trl_bench.cpu_clock()
    sum(i * i for i in range(3_000_000))  # ~0.2 s of CPU: well above the clock tick of 10 ms
    end = trl_bench.cpu_clock()
    assert end[1] > start[1] and end[2] > start[2]


# ---- the clock both frameworks share -------------------------------------------------------------------
def test_snapshot_clock_fires_once_per_mark_and_at_the_end():
    clock = grpo.SnapshotClock(every_s=10.0, max_time_s=30.0)
    fired = [t for t in [3.0, 9.9, 10.2, 14.0, 25.0, 29.0, 31.0] if clock.tick(t)]
    assert fired == [10.2, 25.0, 31.0]  # 25 covers the 20-s mark; 31 is the last step
    assert grpo.SnapshotClock(10.0, 30.0).tick(4.0, final=True)  # a step limit ends the run early


def test_snapshot_tracker_ignores_the_base_eval_and_snapshots_on_the_clock(small_model):
    tracker = trl_bench.SnapshotTracker(small_model, grpo.SnapshotClock(1.0, 2.0), max_steps=100)
    tracker.log(0, {"eval/accuracy": 0.5})
    for step, t in enumerate([0.4, 1.1, 1.5, 2.3], start=1):
        tracker.log(step, {"time/elapsed_s": t})
    assert [(s["step"], s["elapsed_s"]) for s in tracker.snapshots] == [(0, 0.0), (2, 1.1), (4, 2.3)]
    assert [s["step"] for s in tracker.steps] == [1, 2, 3, 4]
    weights = tracker.snapshots[0]["state_dict"]
    key = next(iter(weights))
    assert weights[key].data_ptr() != small_model.state_dict()[key].data_ptr()  # a copy, not a view


# ---- the TRL script's pieces (no TRL needed) --------------------------------------------------------------
def test_trl_reward_is_tidals_own_reward():
    from tidal.rewards import build_reward
    from tidal.types import Prompt

    completions, answers = ["052", " 052\n", "52", "0520", ""], ["052"] * 5
    got = grpo.tidal_reward("exact_match")(completions, answers, question=["07+45="] * 5, prompts=["x"] * 5)
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0]
    exact_match = build_reward("exact_match")
    assert got == [exact_match(c, Prompt("u", "07+45=", a))[0] for c, a in zip(completions, answers)]
    # conversational prompts: TRL hands each completion over as the assistant's message
    chat = grpo.tidal_reward("last_number")
    assert chat.__name__ == "last_number"  # TRL logs a reward function's mean under its name
    texts = ["22 + 13 = 35", "22+13 is 22+13.", "33, 34, 35", "The answer is 36."]
    got = chat([[{"role": "assistant", "content": t}] for t in texts], ["35"] * 4, question=["What is 22 + 13?"] * 4)
    assert got == [1.0, 0.0, 0.0, 0.0]


def test_exported_prompts_are_tidals_stream_and_tokenize_like_tidal(tmp_path, tokenizer):
    from tidal.rollout.requests import prompt_ids

    task = TASKS.get("addition")(TaskConfig())
    path = tmp_path / "prompts.jsonl"
    trl_bench.export_prompts(task, task.num_train + 3, path)  # into the reshuffled second epoch
    rows = grpo.read_rows(path)
    assert len(rows) == task.num_train + 3
    for i in (0, 1, task.num_train + 2):
        p = task.train_prompt(i)
        assert rows[i] == {"prompt": p.text, "answer": p.answer, "question": p.text}
    held_out = {p.text for p in task.eval_prompts()}
    assert not held_out & {r["prompt"] for r in rows}
    trl_rows = grpo.with_bos(rows[:2], tokenizer.bos_token)
    assert trl_rows[0]["answer"] == rows[0]["answer"] and trl_rows[0]["question"] == rows[0]["question"]
    # TRL tokenizes the prompt text with the tokenizer's defaults: it must give tidal's [bos, chars...]
    assert tokenizer(text=trl_rows[0]["prompt"])["input_ids"] == list(prompt_ids(tokenizer, task.train_prompt(0)))


def test_both_runs_read_one_resolved_config(tmp_path):
    s, cfg = trl_bench.resolve(["rollout.prompts_per_step=16", "optim.lr=3e-4", "threads=1", "max_time_s=60"])
    assert s.threads == 1 and cfg.system.num_threads == 1 and cfg.system.mode == "async"
    assert cfg.target_accuracy is None and cfg.max_time_s == 60 and cfg.rollout.group_size == 8
    got = trl_bench.trl_settings(cfg, s, tmp_path / "base", tmp_path)
    assert (got["prompts_per_step"], got["group_size"], got["lr"], got["threads"]) == (16, 8, 3e-4, 1)
    assert (got["max_new_tokens"], got["temperature"], got["top_p"]) == (cfg.rollout.max_new_tokens, 1.0, 1.0)
    assert (got["eps_low"], got["eps_high"]) == (0.2, 0.28)  # ppo_clip's own defaults (DAPO clip-higher)
    assert got["betas"] == list(cfg.optim.betas) and got["grad_clip"] == cfg.optim.grad_clip
    assert got["reward"] == {"name": "exact_match", "params": {}} and got["snapshot_dir"] is None
    cfg.trainer.temperature = 0.7  # TRL samples and scores at one temperature: a split one is refused
    with pytest.raises(ValueError, match="trainer.temperature"):
        trl_bench.trl_settings(cfg, s, tmp_path / "base", tmp_path)
    cfg.trainer.temperature = cfg.rollout.temperature
    s.trl_threads = 2
    assert trl_bench.trl_settings(cfg, s, tmp_path / "base", tmp_path)["threads"] == 2
    # the clock's max_steps is 1e8 (trl_bench.RUN), so the recipe's cosine keeps its 400 steps
    assert (cfg.optim.schedule, cfg.optim.decay_steps) == ("cosine", 400)
    got = trl_bench.trl_settings(cfg, s, tmp_path / "base", tmp_path)
    assert grpo.lr_schedule(got) == {"lr_scheduler_type": "cosine_with_min_lr", "warmup_steps": 0,
                                     "lr_scheduler_kwargs": {"min_lr_rate": cfg.optim.min_lr_ratio}}
    assert got["max_steps"] == 400  # Hugging Face's cosine decays over max_steps
    cfg.optim.schedule = "linear"  # Hugging Face's linear decays to 0, not to min_lr_ratio: refused
    with pytest.raises(ValueError, match="linear"):
        trl_bench.trl_settings(cfg, s, tmp_path / "base", tmp_path)
    with pytest.raises(Exception, match="unknown config key"):
        trl_bench.resolve(["snapshot_evry_s=3"])


# ---- where TRL runs: its interpreter, device and precision ------------------------------------------------
def test_venv_current_runs_trl_with_this_interpreter(monkeypatch):
    import importlib.machinery
    import importlib.metadata
    import sys
    import types

    if importlib.util.find_spec("trl") is None:  # tidal's own environment has no TRL: say so, clearly
        with pytest.raises(RuntimeError, match=r"venv=current: trl.* cannot be imported by .*device_wheels"):
            trl_bench.trl_python("current")
    for name in ("trl", "datasets"):  # importable (as on a GPU machine that carries the wheels)
        fake = types.ModuleType(name)
        fake.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"trl": "1.16.0"}[name])
    assert trl_bench.trl_python("current") == trl_bench.trl_python("") == (sys.executable, "1.16.0")
    monkeypatch.setattr(trl_bench.race, "ensure_venv", lambda path: Path(path) / "bin" / "python")
    assert trl_bench.trl_python("/some/venv") == ("/some/venv/bin/python", trl_bench.TRL_VERSION)


def test_trl_trains_on_tidals_device_in_tidals_precision(monkeypatch):
    _, cfg = trl_bench.resolve(["system.device=cpu"])
    assert trl_bench.device_settings(cfg) == {"device": "cpu", "bf16": False}  # auto precision: fp32 on a CPU
    assert grpo.device_args({"device": "cpu", "bf16": False}) == {"use_cpu": True, "bf16": False, "fp16": False}
    cfg.trainer.precision = "bf16"
    assert trl_bench.device_settings(cfg) == {"device": "cpu", "bf16": True}
    monkeypatch.setattr(trl_bench.race, "resolve_device", lambda spec: torch.device("cuda", 0))  # as on a GPU machine
    cfg.trainer.precision = "auto"
    assert trl_bench.device_settings(cfg) == {"device": "cuda", "bf16": True}  # auto precision: bf16 on CUDA
    assert grpo.device_args({"device": "cuda", "bf16": True}) == {"use_cpu": False, "bf16": True, "fp16": False}
    assert grpo.device_args({}) == {"use_cpu": True, "bf16": False, "fp16": False}  # configs written before


def test_the_documented_gpu_command_resolves():
    """docs/benchmarks.md's command for a GPU machine without network names real keys with the meant values."""
    import re
    import shlex

    doc = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    (line,) = re.findall(r"^tidal bench trl .*venv=current.*$", doc, flags=re.M)
    args = shlex.split(line)[3:]
    s, cfg = trl_bench.resolve([args[i + 1] for i, a in enumerate(args) if a == "--set"])
    assert (s.venv, cfg.system.device, cfg.max_time_s, s.seeds, s.report_at) == ("current", "cuda", 60, [0], [30, 60])
    assert "--set venv=current --set system.device=cuda --set max_time_s=60" in " ".join(trl_bench.__doc__.split())


# ---- the harness end to end, toy size ---------------------------------------------------------------------
def test_run_on_a_toy_size_writes_the_table_curves_and_plot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the warm start caches under ./.tidal_cache

    def fake_trl(cfg, s, task, model_dir, work):  # TRL's side replaced by the base model, twice
        from tidal.models import tiny

        weights = grpo.clone_state(tiny.load(model_dir)[0])
        snaps = [{"elapsed_s": 0.0, "step": 0, "state_dict": weights}, {"elapsed_s": 0.2, "step": 2,
                                                                          "state_dict": weights}]
        return snaps, [{"step": 1, "elapsed_s": 0.1}, {"step": 2, "elapsed_s": 0.2}], {
            "lr": cfg.optim.lr, "threads": 1, "trl_version": "fake", "device": "cpu"}

    monkeypatch.setattr(trl_bench, "run_trl", fake_trl)
    result = trl_bench.run([*TOY, "max_time_s=0.2", "seeds=[0,1]"], tmp_path / "results" / "trl")
    assert result["num_bases"] == 2 and [b["seed"] for b in result["bases"]] == [0, 1]
    assert [(r["base_seed"], r["framework"]) for r in result["table"]] == [
        (0, "trl"), (0, "tidal"), (1, "trl"), (1, "tidal")]
    for seed in (0, 1):
        trl_row, tidal_row = (r for r in result["table"] if r["base_seed"] == seed)
        assert tidal_row["steps"] >= 1 and tidal_row["train_s"] >= 0.2 and "others_cpu_cores" in tidal_row
        curves = result["curves"][f"seed{seed}/tidal"]
        assert curves["elapsed_s"][0] == 0.0 and curves["elapsed_s"][-1] == tidal_row["train_s"]
        assert curves["step"][0] == 0 and curves["step"][-1] == tidal_row["steps"]
        assert trl_row["base_accuracy"] == tidal_row["base_accuracy"]  # same base, same evaluator
        base = next(b for b in result["bases"] if b["seed"] == seed)
        assert base["target_accuracy"] == trl_row["base_accuracy"] and "speedup_to_trl_best" in base
    assert "trl_median_acc_at_0.1s" in result and "tidal_median_late_swing" in result
    assert "median_speedup_to_trl_best" in result and "bases_3x_sooner_to_trl_best" in result
    assert Path(result["plot"]) == tmp_path / "results" / "trl.png" and Path(result["plot"]).stat().st_size > 0
    json.dumps(result)  # the JSON tidal bench writes


@pytest.mark.slow
def test_two_trl_steps(tmp_path, monkeypatch):
    """Runs TRL for real: needs the benchmark's environment (``tidal bench trl`` creates it once)."""
    s, _ = trl_bench.resolve([])
    if not (Path(s.venv) / "tidal-bench.json").exists():
        pytest.skip(f"no TRL environment at {s.venv}: run `tidal bench trl` once")
    venv = Path(s.venv).absolute()
    monkeypatch.chdir(tmp_path)
    # a toy TRL step can take under TOY's 0.05 s: snapshot on a finer clock so every step gets one
    result = trl_bench.run([*TOY, "frameworks=[trl]", "seeds=[0]", f"venv={venv}", "max_steps=2", "max_time_s=600",
                            "snapshot_every_s=0.0001"], tmp_path / "results" / "trl")
    (row,) = result["table"]
    assert row["steps"] == 2 and len(result["curves"]["seed0/trl"]["accuracy"]) == 3
    snapshots = torch.load(tmp_path / "results" / "trl" / "seed0" / "trl" / "snapshots.pt", weights_only=True)
    assert [s["step"] for s in snapshots] == [0, 1, 2]  # the base, then every step


@pytest.mark.slow
def test_two_trl_steps_with_this_interpreter(tmp_path, monkeypatch):
    """``venv=current`` (a GPU machine without network): TRL from this interpreter, no venv made."""
    import importlib.util

    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        pytest.skip("trl or datasets is not importable here")
    monkeypatch.chdir(tmp_path)
    result = trl_bench.run([*TOY, "frameworks=[trl]", "seeds=[0]", "venv=current", "max_steps=2", "max_time_s=600"],
                           tmp_path / "results" / "trl")
    (row,) = result["table"]
    assert row["steps"] == 2 and result["settings"]["trl_script"]["python"] == sys.executable
    assert not (tmp_path / ".tidal_cache" / "bench-trl-venv").exists()


def test_tidal_cosine_is_hugging_faces_cosine_with_min_lr():
    """The TRL run gets ``cosine_with_min_lr``: its lr must equal tidal's ``lr_factor`` step by step."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    from tidal.optim import OptimConfig, lr_factor

    cfg = OptimConfig(lr=1.0, schedule="cosine", decay_steps=400, min_lr_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf = get_cosine_with_min_lr_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=400, min_lr_rate=0.1)
    for step in range(401):  # past max_steps HF's cosine turns back up while tidal's holds; TRL stops there
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_factor(step, cfg), abs=1e-9), step
        opt.step()
        hf.step()
