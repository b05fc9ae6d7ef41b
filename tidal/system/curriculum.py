"""What the run trains on while it trains: the task (or mixture), and which prompt each group gets.

``build_task`` turns the config into the run's Task: ``task`` itself, or, when
``curriculum.mixture`` is set, a ``MixtureTask`` over its components (``tasks/mixture.py``), whose
prompts are scored by their own component's reward (``run_reward`` routes them with ``by_task``).

``PromptSource`` is the controller's only way to draw a training prompt: group index -> Prompt. With
``curriculum.difficulty.enabled`` it draws by online pass-rate weights (``tasks/online.py``; one
sampler per task, or per mixture component, whose pool is that task's epoch-0 order) and learns from
every group drawn for a step, informative or dropped by dynamic sampling, when the step ends
(``observe``), before the next version is published: so in sync mode, and async with eta = 0, the
prompts drawn for step k+1 see exactly steps 0..k (with dynamic sampling too: at eta = 0 no group starts
past the step's draw limit, ``staleness.py``), and a resumed run (its counts restored by
``load_state_dict``) draws what the uninterrupted one drew. In async mode with eta > 0 a group may
be drawn before the previous step's counts arrive (as its length budget may be): the bound still
holds, only which counts it saw depends on timing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from tidal.api import Task
from tidal.tasks import TASKS
from tidal.tasks.aioli import AioliSchedule, AioliScheduleConfig
from tidal.tasks.mixture import MixtureTask, parse_components
from tidal.tasks.online import DifficultySampler, OnlineDifficultyConfig
from tidal.types import Group, Prompt


@dataclass
class CurriculumConfig:
    """Online curriculum: task mixtures and online difficulty weighting (docs/curriculum.md)."""

    mixture: list[dict[str, Any]] = field(default_factory=list)
    """Components ``[{name, task: {task keys}, reward: {name, params}, weight}, ...]``; ``weight`` is a
    number or ``[[step, weight], ...]``. Empty: train on ``task`` alone. When set, ``task`` and
    ``reward`` are only the defaults of a component's seed and reward."""
    mixture_schedule: Literal["linear", "stages", "aioli"] = "linear"
    """How ``[[step, weight], ...]`` weights move between points: ``linear`` ramps, ``stages`` steps;
    ``aioli``: weights move by each task's measured learning progress (``tasks/aioli.py``)."""
    aioli: AioliScheduleConfig = field(default_factory=AioliScheduleConfig)
    """Aioli's rounds and step size, for ``mixture_schedule: aioli``."""
    difficulty: OnlineDifficultyConfig = field(default_factory=OnlineDifficultyConfig)
    """Online difficulty weighting of the prompts (Magistral's goldilocks band, done online)."""


def build_task(cfg) -> Task:
    """The run's task: ``cfg.task``, or the mixture of ``cfg.curriculum.mixture``."""
    cur = cfg.curriculum
    if cfg.env.name == "verifiers":  # the environment's own tasks (tasks/verifiers_task.py)
        from tidal.tasks.verifiers_task import VerifiersTask

        return VerifiersTask(cfg.task, cfg.env.verifiers)
    if not cur.mixture:
        return TASKS.get(cfg.task.name)(cfg.task)
    default_reward = {"name": cfg.reward.name, "params": dict(cfg.reward.params)}
    components = parse_components(cur.mixture, cfg.task.seed, default_reward)
    task = MixtureTask(components, cur.mixture_schedule, cfg.rollout.prompts_per_step, cfg.seed)
    if cur.mixture_schedule == "aioli":
        task.dynamic = AioliSchedule(len(components), [c.points[0][1] for c in components], cur.aioli, cfg.seed)
    return task


def run_reward(cfg) -> tuple[str, dict[str, Any]]:
    """(reward name, params) for the run: ``reward``, or ``by_task`` over the mixture's rewards."""
    if not cfg.curriculum.mixture:
        return cfg.reward.name, cfg.reward.params
    default_reward = {"name": cfg.reward.name, "params": dict(cfg.reward.params)}
    components = parse_components(cfg.curriculum.mixture, cfg.task.seed, default_reward)
    return "by_task", {"routes": {c.name: c.reward for c in components}}


class PromptSource:
    """Group index -> training prompt (see the module docstring)."""

    def __init__(self, task: Task, cfg):
        self.task, self.cfg = task, cfg
        self.mixture = task if isinstance(task, MixtureTask) else None
        if self.mixture is not None and self.mixture.dynamic is not None:
            self.task = self.mixture = self.mixture.fork()  # Aioli's weights apply to the RL draws from step 0
        d = cfg.curriculum.difficulty
        self.samplers: dict[str, DifficultySampler] = {}
        if d.enabled:
            pools = ([(c.name, t.num_train) for c, t in zip(self.mixture.components, self.mixture.tasks)]
                     if self.mixture else [("", task.num_train)])
            self.samplers = {name: DifficultySampler(n, cfg.rollout.group_size, d, cfg.seed, name)
                             for name, n in pools}

    def prompt(self, index: int) -> Prompt:
        if not self.samplers:
            return self.task.train_prompt(index)
        uid = f"train-{index}"
        if self.mixture is not None:
            k, _ = self.mixture.locate(index)
            position = self.samplers[self.mixture.components[k].name].choose(index)
            prompt = self.mixture.pool_prompt(k, position, uid)
        else:
            position = self.samplers[""].choose(index)
            prompt = dataclasses.replace(self.task.train_prompt(position), uid=uid)
        return dataclasses.replace(prompt, meta={**prompt.meta, "pool_index": position})

    def observe(self, groups: list[Group]) -> None:
        """Fold the step's drawn groups (trained or dropped) into the pass-rate counts and Aioli's progress."""
        if self.mixture is not None and self.mixture.dynamic is not None:
            rewards: dict[int, list[float]] = {}
            for g in groups:
                k = self.mixture.names.index(g.prompt.meta["task"])
                rewards.setdefault(k, []).append(sum(g.rewards) / len(g.rewards))
            self.mixture.dynamic.observe(rewards, self.mixture.first_free_step)
        if not self.samplers:
            return
        threshold = self.cfg.curriculum.difficulty.pass_threshold
        for g in groups:
            sampler = self.samplers[g.prompt.meta.get("task", "")]
            sampler.observe(g.prompt.meta["pool_index"], sum(r >= threshold for r in g.rewards), len(g.rewards))

    def metrics(self, step: int, groups: list[Group]) -> dict[str, float]:
        """Per-task reward means and mixture weights, and the samplers' summaries."""
        out: dict[str, float] = {}
        if self.mixture is not None:
            for c, w in zip(self.mixture.components, self.mixture.weights_at(step)):
                out[f"curriculum/{c.name}/weight"] = w
            by_task: dict[str, list[float]] = {}
            for g in groups:
                by_task.setdefault(g.prompt.meta["task"], []).extend(g.rewards)
            for name, rewards in sorted(by_task.items()):
                if rewards:
                    out[f"reward/{name}/mean"] = sum(rewards) / len(rewards)
        for name, sampler in self.samplers.items():
            prefix = f"curriculum/{name}/" if name else "curriculum/"
            out.update({prefix + k: v for k, v in sampler.metrics().items()})
        return out

    def state_dict(self) -> dict:
        state = {name: s.state_dict() for name, s in self.samplers.items()}
        if self.mixture is not None and self.mixture.dynamic is not None:
            state["/aioli"] = self.mixture.dynamic.state_dict()  # "/" is never in a component name
        return state

    def load_state_dict(self, state: dict) -> None:
        for name, s in self.samplers.items():
            if name in state:
                s.load_state_dict(state[name])
        if "/aioli" in state and self.mixture is not None and self.mixture.dynamic is not None:
            self.mixture.dynamic.load_state_dict(state["/aioli"])
