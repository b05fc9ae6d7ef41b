"""Reward composition: a weighted sum of registered rewards, behind optional gates.

    total = sum_i weight_i * score_i        if every gate passes
          = floor                           if any gate fails (default 0)

Magistral (arXiv 2506.10910, sec. 2.2) is the model: a response with the wrong format gets 0
and is not graded further; otherwise format (+0.1), correctness (+0.9), the DAPO length penalty and
language consistency (+0.1) add up. As params:

    {"terms": [{"reward": "math", "weight": 0.9},
               {"reward": "format", "weight": 0.1},
               {"reward": "length", "weight": 1.0, "params": {"max_len": 20480, "cache_len": 4096}},
               {"reward": "language", "weight": 0.1}],
     "gates": [{"reward": "format", "min": 1.0}]}

Terms and gates are built by name from ``REWARDS`` (so any registered reward composes, the code
sandbox included). A term is ``{reward, weight=1.0, params={}, name=reward}``; two terms of the
same reward need distinct ``name``s. A gate is ``{reward, min?, max?, params?, name=reward}`` and
passes when ``min <= score <= max``; a gate named like a term reuses that term's score (its reward
and params must then match). Gates are scored first; when one fails the remaining terms are not
scored at all (no judge call or sandbox run for a response that is already 0).

``details``: ``components`` ``{name: score}`` (unweighted scores of every scored term and gate,
logged per step as ``reward/<name>/mean`` and ``reward/<name>/length_corr`` by
``tidal.rewards.monitor``; a term skipped behind a failed gate is absent for that sample),
``component_details`` ``{name: details}``, ``gates`` ``{name: passed}``, ``reason``.

Errors: a component that raises or returns a non-finite score scores 0 with its error in its own
details; the rest of the composite is still computed (one flaky judge call must not zero the
verifiable part of the reward). The composite's ``details["error"]`` lists every component error,
raised or reported (``"judge: timeout after 60s"``), so the reward pool counts the sample as an
error and the failure is never silent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.config import ConfigError
from tidal.rewards import REWARDS, build_reward
from tidal.types import Prompt

TERM_KEYS = {"reward", "weight", "params", "name"}
GATE_KEYS = {"reward", "min", "max", "params", "name"}


def run_component(fn: Callable, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
    """``fn(response, prompt)`` as ``(float score, details)``; raising or a non-finite score gives 0
    with ``details["error"]``."""
    try:
        score, details = fn(response, prompt)
        score, details = float(score), dict(details)
    except Exception as e:  # one broken component must not take the others down
        return 0.0, {"error": f"{type(e).__name__}: {e}"}
    if not math.isfinite(score):
        return 0.0, {**details, "error": f"non-finite score {score}"}
    return score, details


def _check_keys(kind: str, i: int, spec: Any, allowed: set[str]) -> None:
    if not isinstance(spec, dict) or "reward" not in spec:
        raise ConfigError(f"compose: {kind}[{i}] must be a mapping with a 'reward' key, got {spec!r}")
    unknown = set(spec) - allowed
    if unknown:
        raise ConfigError(f"compose: {kind}[{i}] has unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")


def _number(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"compose: {what} must be a number, got {value!r}")
    return float(value)


@dataclass
class Composite:
    """``compose``: gated weighted sum of registered rewards (see the module docstring)."""

    terms: list[dict[str, Any]]
    """``[{reward, weight=1.0, params={}, name=reward}, ...]``: the summed rewards."""
    gates: list[dict[str, Any]] = field(default_factory=list)
    """``[{reward, min?, max?, params?, name=reward}, ...]``: all must pass or the total is ``floor``."""
    floor: float = 0.0
    """The total when a gate fails (Magistral: 0)."""

    def __post_init__(self) -> None:
        if not self.terms:
            raise ConfigError("compose: needs at least one term")
        self._terms: list[tuple[str, float, Callable]] = []
        specs: dict[str, tuple[str, dict]] = {}
        for i, spec in enumerate(self.terms):
            _check_keys("terms", i, spec, TERM_KEYS)
            name, params = spec.get("name", spec["reward"]), dict(spec.get("params") or {})
            if name in specs:
                raise ConfigError(f"compose: two terms named {name!r}; give them distinct 'name' keys")
            specs[name] = (spec["reward"], params)
            weight = _number(f"term {name!r} weight", spec.get("weight", 1.0))
            self._terms.append((name, weight, build_reward(spec["reward"], params)))
        term_fns = {name: fn for name, _, fn in self._terms}
        self._gates: list[tuple[str, float, float, Callable]] = []
        for i, spec in enumerate(self.gates):
            _check_keys("gates", i, spec, GATE_KEYS)
            name = spec.get("name", spec["reward"])
            if spec.get("min") is None and spec.get("max") is None:
                raise ConfigError(f"compose: gate {name!r} needs 'min' and/or 'max'")
            lo = _number(f"gate {name!r} min", spec.get("min", -math.inf))
            hi = _number(f"gate {name!r} max", spec.get("max", math.inf))
            if name in specs:
                params = spec.get("params", specs[name][1])
                if (spec["reward"], params) != specs[name]:
                    raise ConfigError(f"compose: gate {name!r} differs from the term of that name; rename the gate")
                fn = term_fns[name]
            else:
                fn = build_reward(spec["reward"], spec.get("params"))
            self._gates.append((name, lo, hi, fn))

    def __call__(self, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
        scores: dict[str, float] = {}
        subdetails: dict[str, dict[str, Any]] = {}

        def score(name: str, fn: Callable) -> float:
            if name not in scores:
                scores[name], subdetails[name] = run_component(fn, response, prompt)
            return scores[name]

        gates: dict[str, bool] = {}
        reason = "ok"
        for name, lo, hi, fn in self._gates:
            value = score(name, fn)
            gates[name] = lo <= value <= hi
            if not gates[name]:
                reason = f"gate {name!r} failed: {value:g} not in [{lo:g}, {hi:g}]"
                break
        if reason == "ok":
            total = sum(weight * score(name, fn) for name, weight, fn in self._terms)
        else:
            total = self.floor
        details: dict[str, Any] = {
            "components": scores,
            "component_details": subdetails,
            "gates": gates,
            "reason": reason,
        }
        errors = [f"{name}: {d['error']}" for name, d in subdetails.items() if "error" in d]
        if errors:
            details["error"] = "; ".join(errors)
        return total, details

    def scale_component(self, name: str, factor: float) -> bool:
        """Multiply term ``name``'s weight by ``factor`` (the length-bias hook lowers a judge's weight,
        ``rewards/monitor.py``); False if there is no such term. The pool pickles the reward with every
        batch, so workers score with the new weight from the next batch on."""
        found = False
        for i, (term, weight, fn) in enumerate(self._terms):
            if term == name:
                self._terms[i] = (term, weight * factor, fn)
                found = True
        return found

    def weight(self, name: str) -> float | None:
        """Term ``name``'s current weight (None: no such term)."""
        return next((w for term, w, _ in self._terms if term == name), None)


REWARDS.register("compose")(Composite)
