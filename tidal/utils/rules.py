"""Range rules for config keys: one rule per key, checked before any work, one ``ConfigError`` naming the key.

A rule is ``(key, check, what the key must be)``. The same rule object serves every command that has the
key (RL's ``system/validate.py``, the stages, ``tidal curate mixture``), so one value is never refused by
one command and silently used by another: ``optim.grad_clip=-1`` was refused by ``tidal train`` while
``tidal sft`` handed it to ``clip_grad_norm_`` and trained uphill.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from tidal.config import ConfigError

Rule = tuple[str, Callable[[Any], bool], str]


def number(v: Any) -> bool:
    """A finite int or float (a bool is not a number here: ``true`` for a count is a typo)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: number(v) and v >= low


def positive(v: Any) -> bool:
    return number(v) and v > 0


def fraction(v: Any) -> bool:  # [0, 1): decays, betas
    return number(v) and 0.0 <= v < 1.0


def unit(v: Any) -> bool:  # [0, 1]
    return number(v) and 0.0 <= v <= 1.0


def optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def one_of(choices: Iterable[str]) -> tuple[Callable[[Any], bool], str]:
    """(check, requirement) for a key that names one of ``choices``."""
    names = tuple(choices)
    return (lambda v: v in names), "one of " + ", ".join(names)


COUNT, NONNEG = at_least(1), at_least(0)


def _lookup(cfg: Any, key: str) -> tuple[bool, Any]:
    """(whether ``cfg`` has the dotted ``key``, its value)."""
    for part in key.split("."):
        if not hasattr(cfg, part):
            return False, None
        cfg = getattr(cfg, part)
    return True, cfg


def check(cfg: Any, rules: Iterable[Rule], missing_ok: bool = False, where: str = "") -> None:
    """Raise a ``ConfigError`` naming the first key whose value breaks its rule (``where`` + the rule's key:
    a section checked on its own still names its full key). ``missing_ok``: skip the rules whose key this
    config does not have (a stage's ``optim`` has fewer keys than RL's)."""
    for key, ok, requirement in rules:
        found, value = _lookup(cfg, key)
        if not found:
            if missing_ok:
                continue
            raise AttributeError(f"config has no key {key!r} (a rule names a key that does not exist)")
        if not ok(value):
            raise ConfigError(f"{where}{key} must be {requirement}, got {value!r}")


def renamed(rules: Iterable[Rule], old: str, new: str) -> list[Rule]:
    """The same rules under another key prefix (``optim.`` -> ``critic.optim.``)."""
    return [(new + key.removeprefix(old) if key.startswith(old) else key, ok, requirement)
            for key, ok, requirement in rules]
