"""The ``env`` section of a run config: which environment an agent episode runs in, and its budgets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tidal.envs.verifiers_config import VerifiersConfig


@dataclass
class EnvConfig:
    """Multi-turn agent episodes (docs/agentic.md). ``name`` None: single-turn RL (the default)."""

    name: str | None = None
    """Registered environment (``tidal.envs.ENVS``): ``calculator``, ``python_tool``, ``guess_number``, ``zoom``
    (a picture tool for a vision-language model, with ``renderer=chat``); or
    ``verifiers``: an environment written for PrimeIntellect's verifiers, named by ``env.verifiers.id``
    (docs/environments.md)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Passed to the environment's constructor: ``--set env.params.timeout_s=5``."""
    renderer: str = "plain"
    """How the prompt and observations become tokens (``rollout/render.py``): ``plain`` (BOS + text;
    observations as their own tokens: base models, the tiny model) or ``chat`` (the tokenizer's chat
    template, observations as ``tool`` messages; a template that is not append-only ends the episode,
    counted as ``agent/not_append_only``). Prompts and observations with pictures need ``chat`` and a
    vision-language model."""
    max_turns: int = 8
    """Model turns per episode; an episode still going after this many ends with finish reason
    ``max_turns`` and the reward it has so far."""
    max_episode_tokens: int | None = None
    """Tokens per episode after the prompt (sampled and observation); None: what the model's context
    leaves. An episode that runs out ends with finish reason ``length``."""
    step_timeout_s: float = 10.0
    """Seconds one environment step may take; past it the turn gets a timeout observation (counted
    as ``agent/tool_timeouts``) and the hung call is abandoned on its own daemon thread."""
    max_concurrent_episodes: int | None = None
    """Episodes in flight at once (in the engine or waiting on their environment); None: bounded only
    by the staleness bound and the engine's batch size."""
    num_workers: int = 64
    """Threads that run environment steps, off the decoding path."""
    latency_median_s: float = 0.0
    """Simulated tool latency added to every step (benchmarks): lognormal with this median (0: none),
    drawn from a hash of (seed, episode, turn) so sync and async runs wait the same."""
    latency_sigma: float = 1.3
    """Log-space spread of the simulated latency: 1.3 puts p99 at ~20x the median (median 100 ms ->
    p99 ~2 s, like sandboxes and search APIs)."""
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
    """``env.name=verifiers``: which verifiers environment, its taskset fields, its held-out split."""
