"""Task mixtures: one training stream drawn from several tasks, with weights scheduled over steps.

MiniMax-M1 (arXiv 2506.13585, sec. 5) starts RL on rule-verified reasoning tasks and mixes general
tasks in gradually, so the skills learned first are not forgotten; a mixture is how tidal expresses
that. Each component is a full task (any ``TASKS`` entry, with its own ``task`` settings) plus the
reward that scores it (``rewards/route.py`` routes each prompt to its component's reward by
``Prompt.meta["task"]``).

The stream is a pure function of the group index i, so a resumed run (which restores only the
data cursor) continues the mixture exactly where it stopped:

- the *nominal step* of index i is ``i // groups_per_step`` (the training step that consumes it
  when every drawn group is trained; under dynamic sampling the stream runs ahead of the step by
  the draw ratio, and the schedule moves with the stream, not the optimizer);
- the component of index i is drawn with a uniform ``u = hash(seed, i)`` against the weights at that
  step (so changing a weight changes only the draws it must);
- within its component, index i takes the next prompt of that component's own stream (its
  position = how many earlier indices drew the same component), so each component still walks its
  epochs in order and every component prompt is seen before any is repeated.

A weight is a number (constant) or ``[[step, weight], ...]``: with ``schedule: linear`` it is
interpolated linearly between the points (a ramp) and held flat outside them; with ``stages`` each
value holds from its step until the next point. Weights are relative: they are normalised over the
components at each step (a step where all are 0 is an error naming the step). With ``schedule:
aioli`` the weights are Aioli's (``tasks/aioli.py``): the components' numbers are its prior and the
proportions move by measured learning progress; ``dynamic`` holds that schedule.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.config import ConfigError, apply_mapping
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig
from tidal.types import Prompt
from tidal.utils.seeding import stable_hash

COMPONENT_KEYS = {"name", "task", "reward", "weight"}
SCHEDULES = ("linear", "stages", "aioli")


@dataclass
class Component:
    """One task of a mixture."""

    name: str
    """Label of the component: ``Prompt.meta["task"]`` and the ``<task>`` of ``reward/<task>/mean``."""
    task: TaskConfig
    """The component's task settings (any ``TASKS`` entry)."""
    reward: dict[str, Any]
    """``{name, params}`` of the reward that scores this component's prompts."""
    points: list[tuple[int, float]] = field(default_factory=list)
    """The weight schedule as ``(step, weight)`` points, sorted by step."""


def parse_components(items: Sequence[Any], seed: int, default_reward: dict[str, Any]) -> list[Component]:
    """``curriculum.mixture`` entries as Components; a bad entry is a ConfigError naming its index and key."""
    if not items:
        raise ConfigError("curriculum.mixture: needs at least one component")
    out, names = [], set()
    for i, item in enumerate(items):
        where = f"curriculum.mixture[{i}]"
        if not isinstance(item, dict) or "name" not in item or "task" not in item:
            raise ConfigError(f"{where}: must be a mapping with 'name' and 'task' keys, got {item!r}")
        unknown = set(item) - COMPONENT_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(COMPONENT_KEYS)})")
        name = str(item["name"])
        if "/" in name or not name:
            raise ConfigError(f"{where}.name={name!r}: must be non-empty and without '/' (it is a metric key part)")
        if name in names:
            raise ConfigError(f"{where}.name={name!r}: two components share this name")
        names.add(name)
        if not isinstance(item["task"], dict):
            raise ConfigError(f"{where}.task: expected a mapping of task keys, got {item['task']!r}")
        task_cfg = TaskConfig(seed=seed)
        try:
            apply_mapping(task_cfg, item["task"])
        except ConfigError as e:
            raise ConfigError(f"{where}.task: {e}") from None
        reward = item.get("reward", default_reward)
        if isinstance(reward, str):
            reward = {"name": reward}
        if not isinstance(reward, dict) or "name" not in reward or set(reward) - {"name", "params"}:
            raise ConfigError(f"{where}.reward: expected {{name, params}}, got {reward!r}")
        out.append(Component(name, task_cfg, {"name": reward["name"], "params": dict(reward.get("params") or {})},
                             weight_points(item.get("weight", 1.0), f"{where}.weight")))
    return out


def weight_points(weight: Any, where: str) -> list[tuple[int, float]]:
    """A weight (number, or ``[[step, weight], ...]``) as sorted ``(step, weight)`` points."""
    def number(v: Any, what: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:  # nan fails too
            raise ConfigError(f"{where}: {what} must be a finite number >= 0, got {v!r}")
        return float(v)

    if not isinstance(weight, (list, tuple)):
        return [(0, number(weight, "the weight"))]
    if not weight:
        raise ConfigError(f"{where}: an empty schedule; give a number or [[step, weight], ...]")
    points = []
    for j, point in enumerate(weight):
        if not isinstance(point, (list, tuple)) or len(point) != 2 or isinstance(point[0], bool) \
                or not isinstance(point[0], int) or point[0] < 0:
            raise ConfigError(f"{where}[{j}]: expected [step, weight] with an integer step >= 0, got {point!r}")
        points.append((point[0], number(point[1], f"[{j}] weight")))
    steps = [s for s, _ in points]
    if len(set(steps)) != len(steps):
        raise ConfigError(f"{where}: two points at the same step ({sorted(steps)})")
    return sorted(points)


def weight_at(points: Sequence[tuple[int, float]], step: int, schedule: str) -> float:
    """The weight at ``step``: linear interpolation between points (``linear``) or the last point at or
    before ``step`` (``stages``); flat before the first point and after the last."""
    if step <= points[0][0]:
        return points[0][1]
    if step >= points[-1][0]:
        return points[-1][1]
    k = bisect.bisect_right([s for s, _ in points], step)  # points[k-1].step <= step < points[k].step
    (s0, w0), (s1, w1) = points[k - 1], points[k]
    if schedule == "stages":
        return w0
    return w0 + (w1 - w0) * (step - s0) / (s1 - s0)


def mixture_weights(components: Sequence[Component], step: int, schedule: str) -> list[float]:
    """The components' normalised weights at ``step``."""
    raw = [weight_at(c.points, step, schedule) for c in components]
    total = sum(raw)
    if total <= 0:
        raise ConfigError(f"curriculum.mixture: every component's weight is 0 at step {step}")
    return [w / total for w in raw]


class MixtureTask:
    """A Task over several component tasks (see the module docstring)."""

    name = "mixture"

    def __init__(self, components: list[Component], schedule: str, groups_per_step: int, seed: int):
        if schedule not in SCHEDULES:
            raise ConfigError(f"curriculum.mixture_schedule={schedule!r}: use one of {SCHEDULES}")
        self.components = components
        self.tasks = [TASKS.get(c.task.name)(c.task) for c in components]
        self.schedule, self.groups_per_step, self.seed = schedule, groups_per_step, seed
        self._choice = array("b")  # component of each index drawn so far (computed in order)
        self._position = array("q")  # its position in that component's stream
        self._next = [0] * len(components)  # next position of each component's stream
        self._cdf_step, self._cdf = -1, [1.0]
        self.dynamic = None
        if schedule == "aioli":
            for i, c in enumerate(components):
                if len(c.points) > 1:
                    raise ConfigError(f"curriculum.mixture[{i}].weight: with mixture_schedule=aioli a weight is "
                                      f"one number (Aioli's prior), not a schedule")

    def weights_at(self, step: int) -> list[float]:
        """The components' normalised weights at ``step`` (the schedule's, or Aioli's)."""
        if self.dynamic is not None:
            return self.dynamic.weights_at(step)
        return mixture_weights(self.components, step, self.schedule)

    def fork(self) -> MixtureTask:
        """The same mixture with a stream of its own, no index drawn yet: an adaptive schedule's RL stream
        must not inherit choices other readers (the warm start's random indices) fixed with older weights."""
        other = copy.copy(self)
        other._choice, other._position, other._next = array("b"), array("q"), [0] * len(self.components)
        other._cdf_step, other._cdf = -1, [1.0]
        return other

    @property
    def first_free_step(self) -> int:
        """The first step none of whose indices has been drawn yet."""
        return -(-len(self._choice) // self.groups_per_step)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.components]

    @property
    def num_train(self) -> int:
        return sum(t.num_train for t in self.tasks)

    def _cdf_at(self, step: int) -> list[float]:
        if step != self._cdf_step:
            acc, cdf = 0.0, []
            for w in self.weights_at(step):
                acc += w
                cdf.append(acc)
            self._cdf_step, self._cdf = step, cdf
        return self._cdf

    def locate(self, index: int) -> tuple[int, int]:
        """(component, position in its stream) of group ``index``."""
        while len(self._choice) <= index:
            i = len(self._choice)
            u = stable_hash(self.seed, "mixture", i) / 2**63
            cdf = self._cdf_at(i // self.groups_per_step)
            k = min(bisect.bisect_right(cdf, u), len(cdf) - 1)
            self._choice.append(k)
            self._position.append(self._next[k])
            self._next[k] += 1
        return self._choice[index], self._position[index]

    def tag(self, prompt: Prompt, k: int, uid: str) -> Prompt:
        return dataclasses.replace(prompt, uid=uid, meta={**prompt.meta, "task": self.components[k].name})

    def train_prompt(self, index: int) -> Prompt:
        k, position = self.locate(index)
        return self.tag(self.tasks[k].train_prompt(position), k, f"train-{index}")

    def pool_prompt(self, k: int, position: int, uid: str) -> Prompt:
        """Component ``k``'s ``position``-th prompt under ``uid`` (online difficulty picks positions)."""
        return self.tag(self.tasks[k].train_prompt(position), k, uid)

    def eval_prompts(self) -> list[Prompt]:
        """Every component's held-out prompts, interleaved (so ``num_eval`` keeps every component)."""
        per = [t.eval_prompts() for t in self.tasks]
        out = []
        for j in range(max(map(len, per))):
            for k, prompts in enumerate(per):
                if j < len(prompts):
                    out.append(self.tag(prompts[j], k, f"eval-{self.components[k].name}-{j}"))
        return out

    def sft_example(self, prompt: Prompt) -> str:
        return self.tasks[self.names.index(prompt.meta["task"])].sft_example(prompt)
