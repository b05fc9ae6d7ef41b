"""DAPO's soft overlong punishment: a length penalty that ramps in before the hard limit.

DAPO (arXiv 2503.14476, sec. 3.4, eq. 13) adds to the correctness reward, for a response of
length |y| (tokens), an expected maximum length L_max and a punishment interval L_cache:

    R_length(y) = 0                                 if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                if L_max < |y|

so the penalty grows linearly from 0 to -1 over the last L_cache tokens and a response that would
be truncated gets -1: the policy learns to finish in time rather than being cut off. DAPO's values
are L_max = 20480 and L_cache = 4096 (16,384 expected tokens plus a 4,096-token soft cache); they
are the defaults here. A tiny model generating a few dozen tokens needs small values (e.g.
``max_len=48, cache_len=16``): with the defaults it is never penalized. Magistral (arXiv 2506.10910,
sec. 2.2) uses the same penalty.

The length is ``prompt.meta["num_tokens"]`` (set for every response during training). Without it
(``tidal score`` on JSONL without a ``num_tokens`` field) the ``fallback`` unit is counted:
``words`` (whitespace-separated; roughly 0.75 of the token count for English BPE tokenizers) or
``chars`` (exact for character-level tokenizers, ~4x the token count for BPE ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidal.config import ConfigError
from tidal.rewards import REWARDS
from tidal.types import Prompt

FALLBACKS = ("words", "chars")


def overlong_penalty(length: int | float, max_len: int | float, cache_len: int | float) -> float:
    """DAPO eq. 13: 0 up to ``max_len - cache_len``, then linear down to -1 at ``max_len``, -1 after."""
    assert 0 < cache_len <= max_len, f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}"
    soft_start = max_len - cache_len
    if length <= soft_start:
        return 0.0
    if length <= max_len:
        return (soft_start - length) / cache_len
    return -1.0


@dataclass
class LengthReward:
    """``length``: DAPO's soft overlong penalty in [-1, 0] (see the module docstring)."""

    max_len: int = 20480
    """L_max: longer responses get -1 (DAPO: 20,480 tokens)."""
    cache_len: int = 4096
    """L_cache: the penalty ramps from 0 to -1 over the last ``cache_len`` units (DAPO: 4,096)."""
    fallback: str = "words"
    """Length unit when ``prompt.meta`` has no ``num_tokens``: ``words`` or ``chars``."""

    def __post_init__(self) -> None:
        if not 0 < self.cache_len <= self.max_len:
            raise ConfigError(f"length: need 0 < cache_len <= max_len, got {self.cache_len}, {self.max_len}")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"length: fallback must be one of {FALLBACKS}, got {self.fallback!r}")

    def __call__(self, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
        if prompt.meta.get("num_tokens") is not None:
            length, unit = int(prompt.meta["num_tokens"]), "tokens"
        elif self.fallback == "words":
            length, unit = len(response.split()), "words"
        else:
            length, unit = len(response), "chars"
        penalty = overlong_penalty(length, self.max_len, self.cache_len)
        return penalty, {"length": length, "unit": unit, "soft_start": self.max_len - self.cache_len}


REWARDS.register("length")(LengthReward)
