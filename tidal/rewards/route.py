"""``by_task``: score each prompt with the reward of the task it came from (task mixtures).

A mixture (``tasks/mixture.py``) tags every prompt with ``meta["task"]``; this reward looks the tag
up in ``routes`` and calls that task's reward, so an addition prompt keeps exact match while a
reasoning-gym prompt in the same batch keeps its dataset's scorer. ``details["task"]`` says which
route scored the sample. A prompt without a tag, or with a tag that has no route, is an error in
its details (scored 0 and counted by the pool), never a silent default.

    {"routes": {"add": {"name": "exact_match"},
                "gym": {"name": "reasoning_gym"}}}
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.config import ConfigError
from tidal.rewards import REWARDS, build_reward
from tidal.types import Prompt


@dataclass
class ByTask:
    """Route each prompt to ``routes[prompt.meta["task"]]`` (see the module docstring)."""

    routes: dict[str, dict[str, Any]]
    """``{task name: {name: reward, params: {...}}}``."""

    def __post_init__(self) -> None:
        if not isinstance(self.routes, dict) or not self.routes:
            raise ConfigError(f"by_task: routes must be a non-empty mapping, got {self.routes!r}")
        self._fns: dict[str, Callable] = {}
        for task, spec in self.routes.items():
            if not isinstance(spec, dict) or "name" not in spec:
                raise ConfigError(f"by_task: routes[{task!r}] must be {{name, params}}, got {spec!r}")
            self._fns[task] = build_reward(spec["name"], spec.get("params"))

    def __call__(self, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
        task = prompt.meta.get("task")
        if task not in self._fns:
            return 0.0, {"error": f"by_task: prompt {prompt.uid} has task {task!r}, which has no route "
                                  f"(routes: {sorted(self._fns)})"}
        reward, details = self._fns[task](response, prompt)
        return reward, {**details, "task": task}

    def scale_component(self, name: str, factor: float) -> bool:
        """Scale the weight of component ``name`` in every routed composite reward that has one."""
        return any([getattr(fn, "scale_component", lambda *_: False)(name, factor) for fn in self._fns.values()])


REWARDS.register("by_task")(ByTask)
