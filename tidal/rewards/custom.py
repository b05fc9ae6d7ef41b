"""Rewards by import path: ``reward.name=my_pkg.my_module:my_fn`` or ``reward.name=path/to/file.py:my_fn``.

A reward of your own, without registering it in tidal: anywhere a reward name goes (``--set
reward.name=...``, ``tidal score --reward ...``, ``tidal audit-reward --reward ...``, a ``compose``
term or a ``by_task`` route), ``MODULE:ATTRIBUTE`` or ``FILE.py:ATTRIBUTE`` names it. The attribute is

- a reward function ``fn(response: str, prompt: Prompt) -> float | (float, dict)`` (two required
  positional parameters; it takes no ``reward.params``), or
- a factory, e.g. a class, called with ``reward.params`` as keywords, whose result is such a function.

A bare float is returned as ``(float, {})``; anything else that is not a number or a ``(number, dict)``
pair is an error the pool counts (``details["error"]``).

Why a wrapper: the reward pool runs rewards in worker processes (``forkserver``), which receive the
reward by pickling. A function defined in ``__main__`` or in a file loaded by path does not pickle by
reference into another process. So what travels is this object (the spec, the params and the
directory the spec was given from), and each worker imports the module itself when it unpickles it,
during the pool's warm-up, before any deadline counts. The spec is checked when the reward is built,
in the parent, so a missing module, file or attribute is one line naming it before anything starts.
Relative file paths are taken from the current directory then; a module is looked up on ``sys.path``
with the current directory appended (as ``python -m`` would find it).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import numbers
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal.config import ConfigError


def is_import_path(name: str) -> bool:
    """Whether a reward name is an import path (``a.b:fn``, ``x.py:fn``) rather than a registered name."""
    return ":" in name


def _split(spec: str) -> tuple[str, str]:
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise ConfigError(f"reward {spec!r}: expected MODULE:ATTRIBUTE or FILE.py:ATTRIBUTE "
                          "(e.g. my_pkg.rewards:score or rewards/mine.py:score)")
    return where, attr


def _is_file(where: str) -> bool:
    return where.endswith(".py") or os.sep in where or "/" in where


def _load_module(spec: str, where: str, base_dir: str):
    """The module ``where`` names: a file (relative to ``base_dir``) or a dotted module name."""
    if _is_file(where):
        path = Path(base_dir, where).resolve()
        if not path.is_file():
            raise ConfigError(f"reward {spec!r}: no such file {path}")
        # One module name per file, so loading it twice in a process reuses the module.
        name = "tidal_reward_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise ConfigError(f"reward {spec!r}: importing {path} raised {type(e).__name__}: {e}") from None
        return module
    if base_dir not in sys.path:
        sys.path.append(base_dir)
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise ConfigError(f"reward {spec!r}: no module named {e.name!r} (looked on sys.path and in {base_dir})"
                          ) from None
    except Exception as e:
        raise ConfigError(f"reward {spec!r}: importing {where} raised {type(e).__name__}: {e}") from None


def _is_reward_fn(obj: Any) -> bool:
    """A plain function with two required positional parameters (response, prompt), not a factory."""
    if inspect.isclass(obj) or not callable(obj):
        return False
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is p.empty for p in params) >= 2


def resolve(spec: str, params: dict[str, Any], base_dir: str) -> Callable:
    """The reward function ``spec`` names, built with ``params`` (see the module docstring)."""
    where, attr = _split(spec)
    module = _load_module(spec, where, base_dir)
    if not hasattr(module, attr):
        raise ConfigError(f"reward {spec!r}: {where} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if not callable(obj):
        raise ConfigError(f"reward {spec!r}: {where}.{attr} is a {type(obj).__name__}, not a function or class")
    if _is_reward_fn(obj):
        if params:
            raise ConfigError(f"reward {spec!r} is a function (response, prompt) and takes no parameters, "
                              f"got {sorted(params)}")
        return obj
    try:
        fn = obj(**params)
    except TypeError as e:
        raise ConfigError(f"reward {spec!r}: building it with {params} failed ({e})") from None
    if not callable(fn):
        raise ConfigError(f"reward {spec!r}: {attr}(**params) returned a {type(fn).__name__}, not a reward function")
    return fn


class ImportedReward:
    """A reward loaded by import path, picklable by its spec (see the module docstring)."""

    def __init__(self, spec: str, params: dict[str, Any] | None = None, base_dir: str | None = None):
        self.spec, self.params = spec, dict(params or {})
        self.base_dir = base_dir or os.getcwd()
        self._fn = resolve(self.spec, self.params, self.base_dir)  # fails here, in the parent, with one line

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec, "params": self.params, "base_dir": self.base_dir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fn = resolve(self.spec, self.params, self.base_dir)  # the import happens in the worker

    def warm_up(self) -> None:
        if hasattr(self._fn, "warm_up"):
            self._fn.warm_up()

    def __call__(self, response: str, prompt) -> tuple[float, dict[str, Any]]:
        out = self._fn(response, prompt)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            reward, details = out
        else:
            reward, details = out, {}
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            raise TypeError(f"reward {self.spec} returned {out!r:.80}; expected a float or (float, dict)")
        return float(reward), details

    def __repr__(self) -> str:
        return f"ImportedReward({self.spec!r}, {self.params!r})"
