"""Teacher traces with rejection sampling: the teacher answers, the verifier keeps the correct answers.

For each of ``num_prompts`` training prompts the teacher samples ``samples_per_prompt`` responses with
the rollout engine (``LocalEngine``, the RL runs' engine) at ``temperature``; the run's reward scores
them in its worker pool, and a response is *verified* when its reward is at least ``min_reward``.
``keep=all`` keeps every verified response (a prompt the teacher solves 8 times out of 8 weighs 8
times; rejection sampling fine-tuning, RFT, as in Yuan et al., arXiv 2308.01825), ``keep=best`` one
per prompt: the highest reward, the shortest on ties, then the first sampled. Prompts with no
verified response are dropped and counted. This is how Magistral Small was built: SFT on Magistral
Medium's verified traces, then RL (arXiv 2506.10910, sec. 5).

The traces are written as JSONL (one row per kept response: prompt, response text and token ids,
reward), then the student trains on them with ``student.sft_loss``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tidal.config import ConfigError
from tidal.rewards.pool import RewardPool
from tidal.rollout.local import LocalEngine
from tidal.rollout.requests import group_requests
from tidal.types import Trajectory
from tidal.utils.progress import progress_bar


@dataclass
class TracesConfig:
    """Which teacher responses become training data (``tidal distill traces --set traces.KEY=...``)."""

    num_prompts: int = 2000
    """Training prompts the teacher answers (the first N of the task's training stream)."""
    samples_per_prompt: int = 4
    """N responses sampled per prompt (rejection sampling draws several and keeps the verified)."""
    keep: Literal["all", "best"] = "all"
    """``all``: every verified response; ``best``: one per prompt (highest reward, then shortest)."""
    min_reward: float = 1.0
    """A response is verified when its reward is at least this (1.0: fully correct for binary rewards)."""
    temperature: float = 1.0
    """The teacher's sampling temperature (1.0: its own distribution)."""
    chunk_prompts: int = 256
    """Prompts generated per engine call (progress is reported per chunk)."""

    def __post_init__(self):
        validate(self)


def validate(cfg: TracesConfig) -> None:
    for key in ("num_prompts", "samples_per_prompt", "chunk_prompts"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"traces.{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.keep not in ("all", "best"):
        raise ConfigError(f"traces.keep must be all or best, got {cfg.keep!r}")
    if cfg.temperature < 0:
        raise ConfigError(f"traces.temperature must be >= 0, got {cfg.temperature}")


def select(group: list[Trajectory], keep: str, min_reward: float) -> list[Trajectory]:
    """The verified responses of one prompt that ``keep`` retains (pure: tested on hand-made groups)."""
    verified = [t for t in group if t.reward >= min_reward]
    if keep == "all" or not verified:
        return verified
    return [min(verified, key=lambda t: (-t.reward, t.num_tokens, t.sample_index))]


def generate_traces(teacher, tokenizer, task, run_cfg, cfg: TracesConfig, pool: RewardPool, out_path: Path,
                    progress: bool = True) -> dict:
    """Sample, verify and keep; write the kept traces to ``out_path`` (JSONL) and return the counts."""
    validate(cfg)
    if cfg.num_prompts > task.num_train:
        raise ConfigError(f"traces.num_prompts={cfg.num_prompts} exceeds the task's {task.num_train} training prompts")
    sampling = dataclasses.replace(run_cfg.rollout, temperature=cfg.temperature)
    engine = LocalEngine(teacher, tokenizer, sampling, run_cfg.seed, 0)
    counts = {"prompts": 0, "samples": 0, "verified": 0, "kept": 0, "prompts_without_trace": 0}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bar = progress_bar(progress, total=cfg.num_prompts, desc="teacher traces", leave=False)
    with out_path.open("w") as f:
        for start in range(0, cfg.num_prompts, cfg.chunk_prompts):
            prompts = [task.train_prompt(i) for i in range(start, min(start + cfg.chunk_prompts, cfg.num_prompts))]
            trajs = engine.generate(group_requests(tokenizer, prompts, cfg.samples_per_prompt))
            scores = pool.score([(t.text, prompts[i // cfg.samples_per_prompt]) for i, t in enumerate(trajs)])
            for t, (reward, details) in zip(trajs, scores):
                t.reward, t.reward_details = reward, details
            for i, prompt in enumerate(prompts):
                group = trajs[i * cfg.samples_per_prompt : (i + 1) * cfg.samples_per_prompt]
                kept = select(group, cfg.keep, cfg.min_reward)
                counts["verified"] += sum(t.reward >= cfg.min_reward for t in group)
                counts["prompts_without_trace"] += not kept
                for t in kept:
                    f.write(json.dumps({"prompt_uid": prompt.uid, "prompt": prompt.text, "response": t.text,
                                        "prompt_ids": t.prompt_ids, "token_ids": t.token_ids,
                                        "reward": t.reward}) + "\n")
                counts["kept"] += len(kept)
            counts["prompts"] += len(prompts)
            counts["samples"] += len(trajs)
            bar.update(len(prompts))
            bar.set_postfix(verified=f"{counts['verified'] / counts['samples']:.2f}")
    bar.close()
    counts["teacher_sampled_accuracy"] = counts["verified"] / max(counts["samples"], 1)
    return counts


def read_traces(path: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of each kept trace; a malformed row is named by its line number."""
    seqs = []
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                seqs.append((list(map(int, row["prompt_ids"])), list(map(int, row["token_ids"]))))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ConfigError(f"{path}: line {n}: not a trace row ({type(e).__name__}: {e}); expected JSON with "
                                  "prompt_ids and token_ids") from None
    return seqs
