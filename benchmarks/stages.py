"""tidal's SFT and DPO stages vs TRL's SFTTrainer and DPOTrainer: throughput and time to preference accuracy.

Same model, rows, settings and threads for both, one after the other:

- The model: the tiny model (1M parameters, character tokenizer, ``PLAIN_TEMPLATE``) after ``base_steps``
  of tidal SFT on the synthetic domain's chats (``stages/synthetic.py``), built once, off the clock.
- SFT: ``sft_steps`` steps of ``sft_batch`` chats (loss on assistant tokens) from that base. tidal packs
  (``train/packing.py``); TRL runs each of ``trl_sft_settings`` (``padding_free``, ``packing`` (bfd) and
  plain padding) and its best tokens/s is the one compared. Tokens are the rows' non-padding tokens.
- DPO: ``dpo_steps`` steps of ``dpo_batch`` pairs, sigmoid loss, ``beta``, from the same base; both compute
  the reference log-probs once before training (TRL: ``precompute_ref_log_probs=True``; tidal's only way),
  and that pass is on both clocks. Pairs/s is pairs trained over training time less evaluations. Every
  ``eval_every`` steps both measure the held-out preference accuracy (implicit reward margin > 0, TRL's
  ``rewards/accuracies``) on the domain's held-out pairs; the curve's times are wall seconds since training
  began, evaluations included. ``dpo_s_to_target`` is the first evaluation at ``target_pref_acc`` or above.

``repeats`` runs both sides' SFT and DPO that many times, alternating (TRL, then tidal, per repeat), on the same
base: on a shared machine the throughput moves by tens of percent between runs, so each repeat's ratio is
measured side by side and kept (``*_runs``), and the top-level ratio is their median.

Then (``rm_steps`` > 0) tidal's reward model from the same base on the same pairs: ``rm_pair_acc``, its held-out pair
accuracy (TRL's RewardTrainer is not run: the bench compares the stages that have a TRL twin here).

Top-level keys: ``rm_pair_acc``, ``sft_tokens_per_s_over_trl``, ``dpo_pairs_per_s_over_trl`` (medians over
repeats) and their ``*_runs`` lists, ``dpo_pref_acc`` (tidal's last evaluation), ``dpo_pref_acc_trl`` (TRL's; also
under its older name ``trl_dpo_pref_acc``), ``dpo_s_to_target``. ``runs`` holds the first repeat's details,
``repeat_runs`` each repeat's throughputs.

    tidal bench stages [--set sft_steps=40] [--set dpo_steps=200] [--set repeats=3] \
        [--set venv=.tidal_cache/bench-trl-venv]

TRL runs in ``tidal bench trl``'s venv (``venv``; created on first use, ``current``: this interpreter).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tidal import bench
from tidal.config import apply_overrides

DESCRIPTION = "tidal sft/dpo vs TRL SFTTrainer/DPOTrainer: tokens/s, pairs/s, time to held-out preference accuracy"
_SCRIPT = Path(__file__).with_name("_trl_stages.py")


@dataclass
class Settings:
    threads: int = 1
    """torch threads for both (one core each on a shared machine)."""
    seed: int = 0
    base_steps: int = 300
    """tidal SFT steps that make the shared base (off the clock)."""
    sft_steps: int = 40
    sft_batch: int = 32
    sft_lr: float = 1e-4
    dpo_steps: int = 200
    dpo_batch: int = 16
    dpo_lr: float = 1e-4
    beta: float = 0.1
    eval_every: int = 20
    target_pref_acc: float = 0.9
    num_pairs: int = 2000
    max_length: int = 128
    trl_sft_settings: list[str] = field(default_factory=lambda: ["padding_free", "packing", "padded"])
    frameworks: list[str] = field(default_factory=lambda: ["trl", "tidal"])
    venv: str = ".tidal_cache/bench-trl-venv"
    repeats: int = 1
    """Side-by-side repeats of both frameworks' SFT and DPO (the ratios' spread; the median is reported)."""
    rm_steps: int = 1500
    """tidal's reward model (``tidal rm`` from the same base, once, after the repeats): steps; 0 skips it. lr 1e-4
    (TRL RewardConfig's default) and batch 16 are the stage chain's (docs/stages.md); 1500 steps, not the chain's
    700: from this base the held-out accuracy still rose at 700 (seed 2: 0.77 at 700, 0.89-0.91 from 1000)."""
    rm_lr: float = 1e-4
    rm_batch: int = 16


def _stage_cfg(kind: str, overrides: list[str]):
    from tidal.stages import dpo, sft

    return apply_overrides(sft.SFTStageConfig() if kind == "sft" else dpo.DPOStageConfig(), overrides)


def build_base(s: Settings, files: dict, out: Path) -> Path:
    from tidal.stages import sft

    base = out / "base"
    if not (base / "model" / "config.json").exists():
        cfg = _stage_cfg("sft", [f"data.path={files['sft']}", "optim.lr=1e-3", f"run.steps={s.base_steps}",
                                 f"run.threads={s.threads}", "run.batch_size=32", f"run.eval_every={s.base_steps}",
                                 f"run.save_every={s.base_steps}", f"run.seed={s.seed}"])
        sft.train(cfg, str(base), overwrite=True, log=lambda line: None)
    return base / "model"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tidal_sft(s: Settings, files: dict, base: Path, out: Path) -> dict:
    from tidal.stages import sft

    cfg = _stage_cfg("sft", [f"model.path={base}", f"data.path={files['sft']}", f"data.eval_path={files['sft']}",
                             f"optim.lr={s.sft_lr}", f"run.steps={s.sft_steps}", f"run.batch_size={s.sft_batch}",
                             f"run.threads={s.threads}", f"run.eval_every={10**9}", f"run.save_every={10**9}",
                             f"data.max_length={s.max_length}", f"run.seed={s.seed}"])
    cfg.run.eval_every = cfg.run.save_every = s.sft_steps  # only after the last step (off the throughput)
    last = sft.train(cfg, str(out / "tidal_sft"), overwrite=True, log=lambda line: None)
    return {"tokens_per_s": last["perf/tokens_per_s"], "train_s": last["perf/train_s"]}


def tidal_dpo(s: Settings, files: dict, base: Path, out: Path) -> dict:
    from tidal.stages import dpo

    cfg = _stage_cfg("dpo", [f"model.path={base}", f"data.path={files['pairs']}",
                             f"data.eval_path={files['pairs_eval']}", f"optim.lr={s.dpo_lr}", f"beta={s.beta}",
                             f"run.steps={s.dpo_steps}", f"run.batch_size={s.dpo_batch}", f"run.threads={s.threads}",
                             f"run.eval_every={s.eval_every}", f"run.save_every={s.dpo_steps}",
                             f"data.max_length={s.max_length}", f"run.seed={s.seed}", "ref_batch_size=64"])
    last = dpo.train(cfg, str(out / "tidal_dpo"), overwrite=True, log=lambda line: None)
    curve = [{"step": m["step"], "time_s": m["perf/wall_s"], "pref_acc": m["eval/pref_acc"]}
             for m in metrics(out / "tidal_dpo") if "eval/pref_acc" in m]
    return {"pairs_per_s": s.dpo_steps * s.dpo_batch / last["perf/train_s"], "train_s": last["perf/train_s"],
            "curve": curve}


def tidal_rm(s: Settings, files: dict, base: Path, out: Path) -> dict:
    """The reward model's held-out pair accuracy (r_chosen > r_rejected on the domain's held-out questions)."""
    from tidal.stages import reward_model

    cfg = apply_overrides(reward_model.RMStageConfig(), [
        f"model.path={base}", f"data.path={files['pairs']}", f"data.eval_path={files['pairs_eval']}",
        f"optim.lr={s.rm_lr}", f"run.steps={s.rm_steps}", f"run.batch_size={s.rm_batch}", f"run.threads={s.threads}",
        f"run.eval_every={max(s.rm_steps // 7, 1)}", f"run.save_every={s.rm_steps}", f"data.max_length={s.max_length}",
        f"run.seed={s.seed}"])
    last = reward_model.train(cfg, str(out / "tidal_rm"), overwrite=True, log=lambda line: None)
    curve = [{"step": m["step"], "accuracy": m["eval/accuracy"]} for m in metrics(out / "tidal_rm")
             if "eval/accuracy" in m]
    return {"pair_acc": last["eval/accuracy"], "train_s": last["perf/train_s"], "curve": curve}


def run_trl(job: dict, python: str, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    job = {**job, "work": str(work)}
    (work / "job.json").write_text(json.dumps(job, indent=2))
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run([python, str(_SCRIPT), str(work / "job.json"), str(work / "result.json")], check=True, env=env)
    return json.loads((work / "result.json").read_text())


def trl_sft(s: Settings, files: dict, base: Path, out: Path, python: str) -> dict:
    per_setting = {}
    for setting in s.trl_sft_settings:
        r = run_trl({"kind": "sft", "setting": setting, "model_dir": str(base), "train": str(files["sft"]),
                     "steps": s.sft_steps, "batch_size": s.sft_batch, "lr": s.sft_lr, "threads": s.threads,
                     "seed": s.seed, "max_length": s.max_length}, python, out / f"trl_sft_{setting}")
        per_setting[setting] = r["num_tokens"] / r["train_s"]
    best = max(per_setting, key=per_setting.get)
    return {"tokens_per_s": per_setting[best], "setting": best, "per_setting": per_setting}


def trl_dpo(s: Settings, files: dict, base: Path, out: Path, python: str) -> dict:
    r = run_trl({"kind": "dpo", "model_dir": str(base), "train": str(files["pairs"]), "eval": str(files["pairs_eval"]),
                 "steps": s.dpo_steps, "batch_size": s.dpo_batch, "lr": s.dpo_lr, "beta": s.beta, "threads": s.threads,
                 "seed": s.seed, "max_length": s.max_length, "loss_type": "sigmoid", "eval_every": s.eval_every},
                python, out / "trl_dpo")
    return {"pairs_per_s": r["rows"] / r["train_s"], "train_s": r["train_s"], "curve": r["curve"]}


def time_to(curve: list[dict], target: float) -> float | None:
    return next((p["time_s"] for p in curve if p["pref_acc"] >= target), None)


def run(overrides: list[str], out_dir: Path) -> dict:
    from tidal.stages import synthetic

    s = apply_overrides(Settings(), overrides)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = synthetic.build(out_dir / "domain", num_pairs=s.num_pairs, seed=s.seed)
    base = build_base(s, files, out_dir)
    python, version = bench.load("trl").trl_python(s.venv) if "trl" in s.frameworks else (None, None)
    repeats: list[dict[str, dict]] = []
    for k in range(max(s.repeats, 1)):
        work = out_dir if k == 0 else out_dir / f"repeat{k}"
        res: dict[str, dict] = {}
        if "trl" in s.frameworks:
            res["trl"] = {"sft": trl_sft(s, files, base, work, python), "dpo": trl_dpo(s, files, base, work, python),
                          "version": version}
        if "tidal" in s.frameworks:
            res["tidal"] = {"sft": tidal_sft(s, files, base, work), "dpo": tidal_dpo(s, files, base, work)}
        repeats.append(res)
    res = repeats[0]
    table = []
    for name, r in res.items():
        curve = r["dpo"]["curve"]
        table.append({"framework": name, "sft_tokens_per_s": r["sft"]["tokens_per_s"],
                      "sft_setting": r["sft"].get("setting", "packed"), "dpo_pairs_per_s": r["dpo"]["pairs_per_s"],
                      "dpo_pref_acc": curve[-1]["pref_acc"] if curve else None,
                      f"s_to_pref_acc_{s.target_pref_acc:g}": time_to(curve, s.target_pref_acc)})
    result = {"table": table, "settings": asdict(s), "runs": res, "python": sys.executable,
              "repeat_runs": [{name: {"sft_tokens_per_s": r["sft"]["tokens_per_s"],
                                      "dpo_pairs_per_s": r["dpo"]["pairs_per_s"],
                                      "dpo_pref_acc": r["dpo"]["curve"][-1]["pref_acc"] if r["dpo"]["curve"] else None}
                               for name, r in rep.items()} for rep in repeats]}
    if "trl" in res and "tidal" in res:
        for key, stage, unit in (("sft_tokens_per_s_over_trl", "sft", "tokens_per_s"),
                                 ("dpo_pairs_per_s_over_trl", "dpo", "pairs_per_s")):
            ratios = [rep["tidal"][stage][unit] / rep["trl"][stage][unit] for rep in repeats]
            result[key], result[f"{key}_runs"] = statistics.median(ratios), ratios
        trl_curve = res["trl"]["dpo"]["curve"]
        result["dpo_pref_acc_trl"] = result["trl_dpo_pref_acc"] = trl_curve[-1]["pref_acc"] if trl_curve else None
        result["dpo_s_to_target"] = {name: time_to(x["dpo"]["curve"], s.target_pref_acc) for name, x in res.items()}
    if "tidal" in res:
        curve = res["tidal"]["dpo"]["curve"]
        result["dpo_pref_acc"] = curve[-1]["pref_acc"] if curve else None
        if s.rm_steps > 0:
            result["rm"] = tidal_rm(s, files, base, out_dir)
            result["rm_pair_acc"] = result["rm"]["pair_acc"]
    return result
