"""Rewards: verifiers, their composition, and the worker pool that runs them (no torch here).

Every entry of ``REWARDS`` is a *factory*: ``REWARDS.get(name)(**params)`` returns a reward
function ``fn(response: str, prompt: Prompt) -> (reward: float, details: dict)`` (the
``tidal.api.RewardFn`` protocol). Parameters come from ``reward.params`` in a run config or
``--set`` in ``tidal score``. The function must be picklable (a module-level function or a
dataclass instance), because the pool ships it to worker processes. A reward of your own needs no
registering: an import path (``my_pkg.mod:fn``, ``file.py:fn``) is a reward name too (``custom.py``).

Conventions for ``details``:
- ``error``: why a reward is 0 because scoring failed (raised, timed out, killed); counted.
- ``components``: ``{name: score}`` for composed rewards; each is logged as ``reward/<name>/mean``.
- ``prompt.meta`` carries the row's extra fields (``tests`` for code, ...) and, during training,
  ``num_tokens`` / ``truncated`` of the response, for length-aware rewards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tidal.config import ConfigError
from tidal.registry import Registry

REWARDS: Registry = Registry("reward")


def _fixed(name: str, fn: Callable, **params: Any) -> Callable:
    if params:
        raise ConfigError(f"reward {name!r} takes no parameters, got {sorted(params)}")
    return fn


def register_fn(name: str) -> Callable[[Callable], Callable]:
    """Register a parameterless verifier function ``fn(response, prompt)`` under ``name``."""

    def decorator(fn: Callable) -> Callable:
        REWARDS.register(name)(functools.partial(_fixed, name, fn))
        return fn

    return decorator


def build_reward(name: str, params: dict[str, Any] | None = None) -> Callable:
    """The reward function ``name`` configured with ``params``; a bad parameter is a ConfigError.
    ``name`` is a registered reward or an import path, ``my_pkg.mod:fn`` / ``file.py:fn`` (``custom.py``)."""
    from tidal.rewards.custom import ImportedReward, is_import_path

    if is_import_path(name):
        return ImportedReward(name, params)
    factory = REWARDS.get(name)
    try:
        return factory(**(params or {}))
    except TypeError as e:
        valid = parameter_names(factory)
        unknown = sorted(set(params or {}) - set(valid))
        if unknown:
            import difflib

            close = {u: difflib.get_close_matches(u, valid, n=1) for u in unknown}
            hint = "".join(f" (did you mean {c[0]!r} for {u!r}?)" for u, c in close.items() if c)
            raise ConfigError(f"reward {name!r}: unknown parameter(s) {unknown}; "
                              f"valid: {', '.join(valid)}{hint}") from None
        raise ConfigError(f"reward {name!r}: a parameter has the wrong type ({e}); got {params}") from None


def parameter_names(factory: Callable) -> list[str]:
    """The keyword parameters a reward factory takes (a dataclass's fields, a class's ``__init__``)."""
    import inspect

    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in sig.parameters.values() if p.kind in kinds]


from tidal.rewards import code as _code  # noqa: E402,F401
from tidal.rewards import compose as _compose  # noqa: E402,F401
from tidal.rewards import exact_match as _exact_match  # noqa: E402,F401  (registers rewards)
from tidal.rewards import format as _format  # noqa: E402,F401
from tidal.rewards import judge as _judge  # noqa: E402,F401
from tidal.rewards import language as _language  # noqa: E402,F401
from tidal.rewards import last_number as _last_number  # noqa: E402,F401
from tidal.rewards import length as _length  # noqa: E402,F401
from tidal.rewards import math as _math  # noqa: E402,F401
from tidal.rewards import reasoning_gym as _reasoning_gym  # noqa: E402,F401
from tidal.rewards import rm as _rm  # noqa: E402,F401  (torch only inside its worker)
from tidal.rewards import route as _route  # noqa: E402,F401
