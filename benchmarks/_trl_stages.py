"""TRL's side of ``tidal bench stages``: SFTTrainer or DPOTrainer on the benchmark's model and rows.

Runs in the TRL venv (``benchmarks/stages.py`` starts it); reads a JSON job, writes a JSON result::

    python benchmarks/_trl_stages.py JOB.json OUT.json

Timing: ``trainer.train()``'s wall time plus DPO's reference pass (``precompute_ref_log_probs``, which TRL runs in
``__init__``: timed alone); evaluation time (HF's
``eval_runtime``) is subtracted for the throughput, and kept for the accuracy curve (the curve's times
are wall seconds since training began, evaluations included, as tidal's are).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]  # benchmarks/trl.py


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def conversational_pairs(rows: list[dict]) -> list[dict]:
    """String pairs as messages, so TRL renders them through the chat template, as tidal does."""
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows]


def main(job_path: str, out_path: str) -> None:
    import datasets
    import torch
    from transformers import TrainerCallback

    from tidal.models import tiny

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(job["threads"])
    torch.manual_seed(job["seed"])
    model, tok = tiny.load(job["model_dir"])
    tok.padding_side = "right"
    curve, clock = [], {}

    class Clock(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kw):
            key = "eval_rewards/accuracies"
            if metrics and key in metrics:
                curve.append({"step": state.global_step, "time_s": time.perf_counter() - clock["start"],
                              "pref_acc": metrics[key]})

    common = dict(output_dir=job["work"], per_device_train_batch_size=job["batch_size"], max_steps=job["steps"],
                  learning_rate=job["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                  max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="no", logging_steps=job["steps"],
                  dataloader_num_workers=0, seed=job["seed"], bf16=False, disable_tqdm=True)
    if job["kind"] == "sft":
        from trl import SFTConfig, SFTTrainer

        setting = job["setting"]
        # padding_free without packing refuses a max_length (it cannot enforce one); the rows fit it anyway
        max_length = None if setting == "padding_free" else job["max_length"]
        args = SFTConfig(assistant_only_loss=True, max_length=max_length,
                         padding_free=setting == "padding_free", packing=setting == "packing", **common)
        trainer = SFTTrainer(model=model, args=args, processing_class=tok, callbacks=[Clock()],
                             train_dataset=datasets.Dataset.from_list(_rows(job["train"])))
    else:
        from trl import DPOConfig, DPOTrainer

        # TRL precomputes the reference log-probs in __init__, not in train(): time that pass (and only it,
        # not the tokenization around it) and put it on the clock, as tidal's reference pass is on tidal's.
        precompute = DPOTrainer._precompute_ref_logps

        def timed(self, *a, **kw):
            t = time.perf_counter()
            try:
                return precompute(self, *a, **kw)
            finally:
                clock["ref_s"] = clock.get("ref_s", 0.0) + time.perf_counter() - t

        DPOTrainer._precompute_ref_logps = timed
        eval_every = job.get("eval_every") or 0
        args = DPOConfig(beta=job["beta"], loss_type=[job["loss_type"]], max_length=job["max_length"],
                         precompute_ref_log_probs=True, per_device_eval_batch_size=64,
                         eval_strategy="steps" if eval_every else "no", eval_steps=eval_every or None, **common)
        trainer = DPOTrainer(model=model, args=args, processing_class=tok, callbacks=[Clock()],
                             train_dataset=datasets.Dataset.from_list(conversational_pairs(_rows(job["train"]))),
                             eval_dataset=datasets.Dataset.from_list(conversational_pairs(_rows(job["eval"]))))
    clock["start"] = time.perf_counter()  # before train(): DPO's reference pass runs inside it
    out = trainer.train()
    ref_s = clock.get("ref_s", 0.0)
    wall = time.perf_counter() - clock["start"] + ref_s
    for point in curve:
        point["time_s"] += ref_s
    history = trainer.state.log_history
    eval_s = sum(h.get("eval_runtime", 0.0) for h in history)
    num_tokens = max((h.get("num_tokens", 0) for h in history), default=0)
    result = {"train_s": wall - eval_s, "wall_s": wall, "eval_s": eval_s, "ref_s": ref_s,
              "train_runtime": out.metrics["train_runtime"],
              "num_tokens": num_tokens, "rows": job["steps"] * job["batch_size"], "curve": curve}
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
