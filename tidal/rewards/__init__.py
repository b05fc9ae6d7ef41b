"""Rewards: verifiers and the worker pool that runs them off the trainer's path (no torch here)."""

from tidal.registry import Registry

REWARDS: Registry = Registry("reward")

from tidal.rewards import exact_match as _exact_match  # noqa: E402,F401  (registers rewards)
