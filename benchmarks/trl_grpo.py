"""The TRL side of ``tidal bench trl``: TRL's GRPOTrainer on the exported task, snapshots on a training clock.

Not a benchmark of its own: ``benchmarks/trl.py`` runs this file as a subprocess in the benchmark's
own virtual environment (TRL is no dependency of tidal), so it imports neither tidal nor TRL at module
level. What it needs comes in one JSON file (``--config``): the base model directory, the exported
training prompts (JSONL rows ``{"prompt", "answer", "question"}`` in tidal's stream order: ``prompt`` is
the text, or a conversation ``[{"role": "user", ...}]`` that TRL renders with the tokenizer's chat
template), the ids tidal reads for the first prompt (checked against TRL's own tokenization), the
reward (tidal's, by name and parameters: TRL's venv sees tidal's packages, and ``tidal.rewards``
imports no torch) and the settings ``benchmarks/_race.py`` resolved from tidal's recipe.

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


def tidal_reward(name: str, params: dict | None = None):
    """A TRL reward function that scores with tidal's own reward ``name`` (``build_reward(name, params)``), so
    both frameworks optimize the identical verifier. TRL passes each completion (text, or ``[{"role":
    "assistant", "content": text}]`` for conversational prompts, decoded without special tokens as tidal
    decodes) and the dataset's ``answer`` and ``question`` columns."""
    from tidal.rewards import build_reward
    from tidal.types import Prompt

    reward = build_reward(name, params)

    def score(completions: list, answer: list[str], question: list[str], **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward(t, Prompt(f"trl-{i}", q, a))[0]
                for i, (t, q, a) in enumerate(zip(texts, question, answer, strict=True))]

    score.__name__ = name  # TRL logs each reward function's mean under its name
    return score


def read_rows(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def with_bos(rows: list[dict], bos_token: str) -> list[dict]:
    """TRL tokenizes a plain-text prompt with the tokenizer's defaults, and the tiny tokenizer adds no
    BOS by itself; tidal's engine prepends BOS to every prompt, so the prompt text carries it here."""
    return [{**r, "prompt": bos_token + r["prompt"]} for r in rows]


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
    """A copy of the model's weights; tensors that share storage (a tied head) are copied once and stay shared."""
    copies: dict = {}
    return {k: copies.setdefault(v.data_ptr(), v.detach().clone()) for k, v in model.state_dict().items()}


def snapshot(weights: dict, elapsed_s: float, step: int, snapshot_dir: str | Path | None) -> dict:
    """One snapshot record: ``weights`` (already a copy) kept in memory, or with ``snapshot_dir`` written to a file
    there and named by ``path`` (a 135M-parameter model's 0.5 GB per snapshot would pile up in memory)."""
    record = {"elapsed_s": elapsed_s, "step": step}
    if snapshot_dir is None:
        return {**record, "state_dict": weights}
    import torch

    path = Path(snapshot_dir) / f"step{step:08d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights, path)  # tensors sharing storage are written once
    return {**record, "path": str(path)}


def snapshot_weights(record: dict) -> dict:
    """The weights of a ``snapshot`` record, from memory or its file."""
    if "state_dict" in record:
        return record["state_dict"]
    import torch

    return torch.load(record["path"], weights_only=True, map_location="cpu")


def make_callback(clock: SnapshotClock, snapshots: list[dict], log_path: Path, snapshot_dir: str | None = None):
    """A TrainerCallback that keeps the training clock, snapshots on it, logs every step and stops TRL."""
    from transformers import TrainerCallback

    class ClockCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            snapshots.append(snapshot(clone_state(model), 0.0, 0, snapshot_dir))
            self.log = open(log_path, "w")
            self.paused = 0.0
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            now = time.perf_counter()
            elapsed = now - self.start - self.paused
            self.log.write(json.dumps({"step": state.global_step, "elapsed_s": elapsed}) + "\n")
            if clock.tick(elapsed, final=state.global_step >= state.max_steps):
                snapshots.append(snapshot(clone_state(model), elapsed, state.global_step, snapshot_dir))
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
    from transformers import AutoModelForCausalLM

    # tidal's own loader (this venv sees tidal's packages): the same tokenizer class tidal reads prompts with
    # (transformers 5's AutoTokenizer would rebuild the tiny character tokenizer as Qwen2Tokenizer and drop spaces)
    from tidal.models.tiny import load_tokenizer

    tokenizer = load_tokenizer(Path(s["model_dir"]))
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(s["model_dir"], local_files_only=True, dtype=torch.float32)
    rows = read_rows(s["prompts_path"])
    if not isinstance(rows[0]["prompt"], list):  # plain text: tidal's engine reads BOS + text
        rows = with_bos(rows, tokenizer.bos_token)
    clock = SnapshotClock(s["snapshot_every_s"], s["max_time_s"])
    snapshots: list[dict] = []
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=tidal_reward(s["reward"]["name"], s["reward"]["params"]),
        args=grpo_config(s, s["trl_out_dir"]), train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        callbacks=[make_callback(clock, snapshots, Path(s["log_path"]), s.get("snapshot_dir"))],
    )
    # the ids TRL generates from (its own tokenization: the chat template for a conversation) are tidal's
    first = list(trainer._tokenize_prompts([rows[0]["prompt"]])[0][0])
    want = s["first_prompt_ids"]
    assert first == want, f"TRL's ids of the first prompt differ from tidal's: {first} vs {want}"
    print(f"TRL {trl.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads: training "
          f"for {s['max_time_s']:.0f} s", flush=True)
    trainer.train()
    torch.save(snapshots, s["snapshots_path"])
    print(f"TRL: {len(snapshots)} snapshots, last at {snapshots[-1]['elapsed_s']:.1f} s, "
          f"step {snapshots[-1]['step']}", flush=True)


if __name__ == "__main__":
    main()
