"""Difficulty filtering by pass rate: sample k answers per problem with a policy through tidal's
rollout engine, score them with the task's reward, keep the problems in a "goldilocks" band.

Why: a problem the policy always solves or never solves gives a group whose rewards are all equal,
so its GRPO advantages are zero and it teaches nothing (DAPO's dynamic sampling drops such groups
at training time, arXiv 2503.14476 sec. 3.2; filtering them out beforehand saves the generation).
Magistral (arXiv 2506.10910, sec. 4) filtered its math problems in two stages: by the pass rate of
a weaker model first, then again with a stronger (RL-trained) one, dropping problems that were
solved every time or never. ``difficulty.model=[weak, strong]`` runs one stage per model, in order,
each reported as its own block (``difficulty:1``, ``difficulty:2``).

A problem is kept when ``min_pass_rate <= solved / samples <= max_pass_rate``; the defaults keep
anything solved at least once but not every time. ``curriculum=true`` writes the kept problems
easiest first (by the last stage's pass rate), for recipes that train in order of difficulty.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from tidal.data.io import Row
from tidal.data.pipeline import Block


@dataclass
class DifficultyConfig:
    model: list[str] | str = field(default_factory=list)
    """Policy directories (a Hugging Face model + tokenizer, e.g. a tidal checkpoint); one stage each."""
    samples: int = 16
    """Answers sampled per problem (Magistral: 16)."""
    min_pass_rate: float = 0.01
    max_pass_rate: float = 0.99
    reward: str = "math"
    """The reward that scores the answers (``reasoning_gym`` for reasoning-gym problem sets)."""
    reward_params: dict = field(default_factory=dict)
    answer_key: str = "answer"
    max_new_tokens: int = 256
    temperature: float = 1.0
    problems_per_batch: int = 64
    """Problems whose samples are generated together (continuous batching inside the engine)."""
    threads: int = 0
    """torch threads for generation; 0: every core."""
    seed: int = 0
    curriculum: bool = False
    """Write the kept rows easiest first (highest pass rate of the last stage first)."""


def problem_uid(text: str) -> str:
    return "curate-" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class Difficulty(Block):
    """One stage: pass rate of ``model_path`` on each problem. Runs in the main process (the engine
    batches a chunk's samples itself), so ``parallel`` is False."""

    parallel = False

    def __init__(self, cfg: DifficultyConfig, model_path: str, stage: int, prompt_key: str = "prompt"):
        import torch

        from tidal.models import tiny
        from tidal.rewards import build_reward
        from tidal.rollout.local import LocalEngine, SamplingConfig

        if not Path(model_path, "config.json").exists():
            from tidal.config import ConfigError

            raise ConfigError(f"difficulty.model: no Hugging Face model at {model_path} (config.json missing)")
        assert 0 <= cfg.min_pass_rate <= cfg.max_pass_rate <= 1, "need 0 <= min_pass_rate <= max_pass_rate <= 1"
        self.name = f"difficulty:{stage}"
        self.cfg, self.prompt_key, self.model_path = cfg, prompt_key, model_path
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        model, self.tokenizer = tiny.load(model_path)
        sampling = SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
        self.engine = LocalEngine(model, self.tokenizer, sampling, seed=cfg.seed + stage)
        self.reward = build_reward(cfg.reward, cfg.reward_params)
        self.pass_rates: dict[int, float] = {}  # id(row) -> pass rate, for curriculum ordering

    def _prompt(self, row: Row):
        from tidal.tasks.config import FieldMap
        from tidal.tasks.rows import BadRow, to_prompt

        try:
            prompt = to_prompt(row, FieldMap(prompt=self.prompt_key, answer=self.cfg.answer_key), None)
        except BadRow:
            return None
        # The engine keys its sampling noise by uid: one derived from the text makes a problem's
        # samples the same however the input is chunked.
        return dataclasses.replace(prompt, uid=problem_uid(prompt.text))

    def prepare_chunk(self, rows: list[Row]) -> list:
        """Each row's pass rate (None: not a usable problem), generating a batch of problems at once."""
        from tidal.rollout.requests import group_requests

        prompts = [self._prompt(row) for row in rows]
        usable = [(i, p) for i, p in enumerate(prompts) if p is not None]
        out: list = [None] * len(rows)
        k, step = self.cfg.samples, self.cfg.problems_per_batch
        for start in range(0, len(usable), step):
            part = usable[start : start + step]
            trajs = self.engine.generate(group_requests(self.tokenizer, [p for _, p in part], k))
            for j, (i, p) in enumerate(part):
                solved = sum(self.reward(t.text, p)[0] >= 1.0 for t in trajs[j * k : (j + 1) * k])
                out[i] = solved / k
        return out

    def decide(self, row: Row, rate) -> str | None:
        if rate is None:
            return f"no_{self.prompt_key}_or_{self.cfg.answer_key}"
        self.detail = {"pass_rate": rate}
        if rate < self.cfg.min_pass_rate:
            return "too_hard"
        if rate > self.cfg.max_pass_rate:
            return "too_easy"
        self.pass_rates[id(row)] = rate
        return None

    def summary(self) -> dict:
        rates = list(self.pass_rates.values())
        return {"model": self.model_path, "samples": self.cfg.samples,
                "kept_mean_pass_rate": sum(rates) / len(rates) if rates else None}


def difficulty_stages(cfg: DifficultyConfig, prompt_key: str) -> list[Difficulty]:
    paths = [cfg.model] if isinstance(cfg.model, str) else list(cfg.model)
    if not paths:
        from tidal.config import ConfigError

        raise ConfigError("difficulty needs a policy: --set difficulty.model=DIR (or [weak, strong])")
    return [Difficulty(cfg, path, i + 1, prompt_key) for i, path in enumerate(paths)]
