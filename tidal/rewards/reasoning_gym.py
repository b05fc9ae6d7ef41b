"""``reasoning_gym`` reward: score a response with its reasoning-gym dataset's own ``score_answer``.

The prompt carries the entry's ``metadata`` (``prompt.meta["metadata"]``, a dict or its JSON text;
the ``reasoning_gym`` task puts it there, and ``tidal score`` rows carry it as a ``metadata``
field). ``metadata["source_dataset"]`` picks the scorer, built once per worker process with the
dataset's default config (reasoning-gym's ``get_score_answer_fn``).

The answer is taken from the response by ``extract``: ``auto`` (default) uses the last
``<answer>...</answer>`` block if there is one, else the whole response, stripped; ``tag`` requires
the block (none: reward 0, reason ``no <answer> tag``); ``none`` scores the whole response.

reasoning-gym's scorers give partial credit to wrong answers (0.01-0.2 for a well-formed wrong
answer, 0.05 for a wrong ARC grid), which would reward noise in RL. So the reward is binary by
default: 1.0 when the score reaches ``threshold`` (1.0), else 0.0. ``partial_credit=true`` returns
the raw score (clipped to [0, 1]) instead. ``details`` always holds the raw ``score``.

A raw score above 1 is not correct: it is float drift in a scorer that sums per-character credit
(measured: spell_backward gives 1.0000000000000002 to a wrong answer that extends the right one),
while every correct reference answer we checked (30 per dataset, all 105 plain datasets) scores
exactly 1.0.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tidal.config import ConfigError
from tidal.rewards import REWARDS
from tidal.types import Prompt

EXTRACT_MODES = ("auto", "tag", "none")
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
# Datasets whose scorers compare against tuple-of-tuples grids in the metadata: JSON turns those into
# lists (measured: a correct arc_agi/rearc answer scores 0.05 after a JSON round trip, 1.0 with tuples).
_TUPLE_METADATA = {"arc_agi", "rearc"}
_SCORERS: dict[str, Any] = {}  # per worker process: building a scorer can load data (arc_agi: ~0.5 s)


def extract(response: str, mode: str) -> str | None:
    """The answer text in ``response`` (see the module docstring); None when ``tag`` finds no block."""
    if mode == "none":
        return response.strip()
    found = _ANSWER_TAG.findall(response)
    if found:
        return found[-1].strip()
    return None if mode == "tag" else response.strip()


def _tuples(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    return x


def entry_of(prompt: Prompt) -> dict[str, Any]:
    """The reasoning-gym entry ``{question, answer, metadata}`` a prompt stands for."""
    metadata = prompt.meta.get("metadata")
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    if not isinstance(metadata, dict) or "source_dataset" not in metadata:
        raise ValueError("the reasoning_gym reward needs the entry's metadata with 'source_dataset' "
                         "(prompt.meta['metadata'], the 'metadata' field of a tidal score row)")
    if metadata["source_dataset"] in _TUPLE_METADATA:
        metadata = {k: (_tuples(v) if k in ("input", "output") else v) for k, v in metadata.items()}
    question = prompt.meta.get("question", prompt.text)
    return {"question": question, "answer": prompt.answer if prompt.answer != "" else None, "metadata": metadata}


def scorer(dataset: str):
    if dataset not in _SCORERS:
        import reasoning_gym

        _SCORERS[dataset] = reasoning_gym.get_score_answer_fn(dataset)
    return _SCORERS[dataset]


@REWARDS.register("reasoning_gym")
@dataclass(frozen=True)
class ReasoningGymReward:
    """Binary (or partial-credit) reasoning-gym score; see the module docstring."""

    threshold: float = 1.0
    """Reward 1 when the raw score is at least this (binary mode)."""
    partial_credit: bool = False
    """Return the raw score (with reasoning-gym's credit for wrong answers) instead of 0/1."""
    extract: str = "auto"
    """How the answer is read from the response: ``auto``, ``tag`` or ``none``."""

    def __post_init__(self) -> None:
        if self.extract not in EXTRACT_MODES:
            raise ConfigError(f"reward reasoning_gym: extract={self.extract!r} is not one of {EXTRACT_MODES}")
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"reward reasoning_gym: threshold={self.threshold} must be in (0, 1]")

    def __call__(self, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
        entry = entry_of(prompt)
        dataset = entry["metadata"]["source_dataset"]
        answer = extract(response, self.extract)
        if answer is None:
            return 0.0, {"score": 0.0, "correct": False, "dataset": dataset, "reason": "no <answer> tag"}
        score = float(scorer(dataset)(answer, entry))
        correct = self.threshold <= score <= 1.0
        reward = min(max(score, 0.0), 1.0) if self.partial_credit else float(correct)
        return reward, {"score": score, "correct": correct, "dataset": dataset, "extracted": answer[:200]}
