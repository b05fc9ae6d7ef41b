"""The TRL side of ``tidal bench trl``: TRL's GRPOTrainer on the exported task, snapshots on a training clock.

Not a benchmark of its own: ``benchmarks/trl.py`` runs this file as a subprocess in the benchmark's
own virtual environment (TRL is no dependency of tidal), so it imports neither tidal nor TRL at module
level. What it needs comes in one JSON file (``--config``): the warm-started base model directory,
the exported training prompts (JSONL rows ``{"prompt", "answer"}`` in tidal's stream order), and
the settings ``benchmarks/trl.py`` resolved from tidal's quickstart recipe.

Fairness rules shared with the tidal side (``SnapshotClock`` is used by both):

- The training clock starts when training starts (after model loading and trainer construction) and
  stops at the first step that ends at or after ``max_time_s``.
- Every ``snapshot_every_s`` of training clock, at the end of the step that crosses the mark, the
  policy weights are copied to memory; the copy's own time is taken off the clock. No evaluation
  happens during training: ``benchmarks/trl.py`` scores every snapshot afterwards with one evaluator
  (tidal's greedy accuracy on the same held-out prompts), so neither framework's eval cost counts and
  both are measured by the same code.

Usage (what ``benchmarks/trl.py`` runs): ``python trl_grpo.py --config run.json``; writes the
snapshots (``torch.save``) and a per-step JSONL log to the paths the config names.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def exact_match_reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """TRL reward function: 1.0 when the completion, stripped, equals the answer (tidal's ``exact_match``)."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]


def read_rows(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def with_bos(rows: list[dict], bos_token: str) -> list[dict]:
    """TRL tokenizes a plain-text prompt with the tokenizer's defaults, and the tiny tokenizer adds no
    BOS by itself; tidal's engine prepends BOS to every prompt, so the prompt text carries it here."""
    return [{"prompt": bos_token + r["prompt"], "answer": r["answer"]} for r in rows]


@dataclass
class SnapshotClock:
    """When to copy the weights, on a clock that excludes the copying itself.

    ``tick(elapsed_s)`` is called at the end of every training step with the training time so far and
    says whether to snapshot now: at the first step ending at or after each multiple of ``every_s``,
    and at the last step (the one ending at or after ``max_time_s``).
    """

    every_s: float
    max_time_s: float
    next_mark: float = 0.0
    marks: list[float] = field(default_factory=list)

    def __post_init__(self):
        assert self.every_s > 0, f"snapshot_every_s must be positive, got {self.every_s}"
        self.next_mark = self.every_s

    def tick(self, elapsed_s: float, final: bool = False) -> bool:
        """``final``: the run ends after this step for another reason (its step limit)."""
        if elapsed_s < self.next_mark and not (final or self.done(elapsed_s)):
            return False
        while self.next_mark <= elapsed_s:
            self.next_mark += self.every_s
        self.marks.append(elapsed_s)
        return True

    def done(self, elapsed_s: float) -> bool:
        return elapsed_s >= self.max_time_s


def clone_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_callback(clock: SnapshotClock, snapshots: list[dict], log_path: Path):
    """A TrainerCallback that keeps the training clock, snapshots on it, logs every step and stops TRL."""
    from transformers import TrainerCallback

    class ClockCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            snapshots.append({"elapsed_s": 0.0, "step": 0, "state_dict": clone_state(model)})
            self.log = open(log_path, "w")
            self.paused = 0.0
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            now = time.perf_counter()
            elapsed = now - self.start - self.paused
            self.log.write(json.dumps({"step": state.global_step, "elapsed_s": elapsed}) + "\n")
            if clock.tick(elapsed, final=state.global_step >= state.max_steps):
                snapshots.append({"elapsed_s": elapsed, "step": state.global_step, "state_dict": clone_state(model)})
            if clock.done(elapsed):
                control.should_training_stop = True
            self.paused += time.perf_counter() - now

        def on_train_end(self, args, state, control, **kwargs):
            self.log.close()

    return ClockCallback()


def lr_schedule(s: dict) -> dict:
    """tidal's ``optim.schedule`` as GRPOConfig arguments: constant, or a cosine to ``min_lr_ratio`` over
    ``max_steps`` (tidal's ``lr_factor`` and Hugging Face's ``cosine_with_min_lr`` share the formula)."""
    warmup = s.get("warmup_steps", 0)
    if s.get("schedule", "constant") == "constant":
        return {"lr_scheduler_type": "constant_with_warmup" if warmup else "constant", "warmup_steps": warmup}
    return {"lr_scheduler_type": "cosine_with_min_lr", "warmup_steps": warmup,
            "lr_scheduler_kwargs": {"min_lr_rate": s["min_lr_ratio"]}}


def device_args(s: dict) -> dict:
    """Where and in which precision TRL trains: ``device`` ``cuda`` is the first visible GPU (accelerate's
    choice), ``cpu`` the CPU; ``bf16`` (tidal's resolved ``trainer.precision``) is bf16 autocast over float32
    weights, as tidal's. FACTS.md: on CPU bf16 must be off explicitly (it defaults on, and is 10x slower)."""
    return {"use_cpu": s.get("device", "cpu") == "cpu", "bf16": s.get("bf16", False), "fp16": False}


def grpo_config(s: dict, out_dir: str):
    """GRPOConfig with every knob that differs from TRL's defaults stated (FACTS.md: gradient checkpointing
    must be off explicitly, it defaults on; ``device_args`` for the device and precision)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir, **device_args(s), gradient_checkpointing=False, use_vllm=False,
        per_device_train_batch_size=s["prompts_per_step"] * s["group_size"], gradient_accumulation_steps=1,
        num_generations=s["group_size"], num_iterations=1, max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"], top_p=s["top_p"], top_k=0,
        learning_rate=s["lr"], optim="adamw_torch", **lr_schedule(s),
        adam_beta1=s["betas"][0], adam_beta2=s["betas"][1], adam_epsilon=s["adam_eps"],
        weight_decay=s["weight_decay"], max_grad_norm=s["grad_clip"],
        loss_type="dapo", beta=0.0, epsilon=s["eps_low"], epsilon_high=s["eps_high"], scale_rewards="group",
        shuffle_dataset=False,  # the rows come in tidal's own training order
        max_steps=s["max_steps"],  # the clock stops training first (ClockCallback) unless a test sets it
        logging_steps=50, disable_tqdm=True, report_to="none", save_strategy="no", seed=s["seed"],
        dataloader_num_workers=0,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    s = json.loads(Path(parser.parse_args(argv).config).read_text())

    # This file sits next to benchmarks/trl.py, which would shadow the ``trl`` package: drop our directory.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import torch

    torch.set_num_threads(s["threads"])
    torch.manual_seed(s["seed"])
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    # not AutoTokenizer: transformers 5 would rebuild the character tokenizer as Qwen2Tokenizer and drop
    # spaces (FACTS.md; tidal's tiny.load_tokenizer does the same; the quickstart's prompts have none)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(s["model_dir"], local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(s["model_dir"], local_files_only=True, dtype=torch.float32)
    rows = with_bos(read_rows(s["prompts_path"]), tokenizer.bos_token)
    first = tokenizer(text=rows[0]["prompt"])["input_ids"]
    assert first[0] == tokenizer.bos_token_id and len(first) == len(rows[0]["prompt"]) - len(tokenizer.bos_token) + 1, (
        f"prompt tokens differ from tidal's [bos, chars...]: {first}")
    clock = SnapshotClock(s["snapshot_every_s"], s["max_time_s"])
    snapshots: list[dict] = []
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=exact_match_reward, args=grpo_config(s, s["trl_out_dir"]),
        train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        callbacks=[make_callback(clock, snapshots, Path(s["log_path"]))],
    )
    print(f"TRL {trl.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads: training "
          f"for {s['max_time_s']:.0f} s", flush=True)
    trainer.train()
    torch.save(snapshots, s["snapshots_path"])
    print(f"TRL: {len(snapshots)} snapshots, last at {snapshots[-1]['elapsed_s']:.1f} s, "
          f"step {snapshots[-1]['step']}", flush=True)


if __name__ == "__main__":
    main()
