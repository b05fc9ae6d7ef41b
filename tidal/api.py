"""Protocols for tidal's extension points. Implementations live in the lower layers' packages
(engines in ``rollout/``, rewards in ``rewards/``, tasks in ``tasks/``); callers depend on these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from tidal.types import Prompt, Trajectory


@dataclass(frozen=True)
class GenRequest:
    """Generate one sample for ``prompt``; ``sample_index`` keys its sampling noise.
    ``max_new_tokens`` overrides the engine's length cap for this request (staged length budgets).
    ``turn`` numbers an agent episode's model turns (``prompt_ids`` is then the whole context so far)
    and keys the turn's sampling noise apart from the earlier turns'. ``episode``: the request is such
    a turn, so the episode's next turn will extend its context (an engine may keep its keys and values
    for it). ``thinking_budget``: at most this many response tokens of thinking, then the engine forces
    ``thinking_close`` (the ``</think>`` ids) unless the model closed it itself (``rollout/thinking.py``)."""

    prompt: Prompt
    prompt_ids: tuple[int, ...]
    sample_index: int
    max_new_tokens: int | None = None
    turn: int = 0
    episode: bool = False
    thinking_budget: int | None = None
    thinking_close: tuple[int, ...] = ()
    images: tuple | None = None
    """The pictures behind ``prompt_ids``' image tokens, in order (anything ``utils/images.load_image`` reads); None:
    the prompt's (``Prompt.images``). An agent episode's later turn sets it when observations added pictures."""

    @property
    def context_images(self) -> tuple:
        """The pictures this request's context shows (its own, else its prompt's)."""
        return tuple(self.prompt.images) if self.images is None else self.images


class EngineFailed(RuntimeError):
    """The rollout engine can no longer generate (the endpoint's engine failed: ``serve/bridge.py``). A run
    stops on it with this one line and a non-zero exit, keeping its checkpoints and journal, instead of
    training every later step on nothing."""


class AllFailed(EngineFailed):
    """Every sample the run drew for ``max_failed_steps`` steps in a row failed, or every episode of a held-out
    evaluation did (its environment crashed, its reward raised): nothing can be trained or measured. It takes a
    failed engine's path: one line naming the cause, a checkpoint, a non-zero exit (``system/failures.py``)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates trajectories with per-token behaviour log-probs and policy versions.

    ``request_weight_update`` may be called from another thread at any time; the engine applies the
    new weights at its next interruption point (between two decode steps), re-reads the unfinished
    sequences under the new weights and continues, tagging later tokens with the new version.
    """

    version: int

    def generate(self, requests: Sequence[GenRequest], greedy: bool = False) -> list[Trajectory]: ...

    def stream(
        self,
        source: Callable[[int, bool], list[GenRequest] | None],
        on_done: Callable[[GenRequest, Trajectory], None],
        greedy: bool = False,
    ) -> None:
        """Continuous batching: pull up to n requests from ``source(n, block)`` whenever n slots are
        free (None: no more, ever), hand each trajectory to ``on_done`` as soon as it finishes."""
        ...

    def request_weight_update(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None: ...

    def stats(self) -> dict[str, float]: ...


@runtime_checkable
class RewardFn(Protocol):
    """Scores one response. Returns (reward, details). Must be picklable (runs in worker processes)."""

    def __call__(self, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]: ...


@runtime_checkable
class Task(Protocol):
    """A source of prompts: an endless, seeded training stream and a fixed held-out eval set."""

    name: str

    @property
    def num_train(self) -> int:
        """Distinct training prompts (one epoch of the stream)."""
        ...

    def train_prompt(self, index: int) -> Prompt: ...

    def eval_prompts(self) -> list[Prompt]: ...

    def sft_example(self, prompt: Prompt) -> str:
        """The reference response text for supervised warm-starting (without EOS)."""
        ...


@dataclass
class EnvStep:
    """What an environment returns for one model turn.

    ``observation`` is the text appended to the context before the next turn (a tool's result, an
    error message, feedback), or a list of OpenAI content parts (text and ``image_url`` parts with data URLs:
    a picture for a vision-language policy, ``rollout/render.py``); None with ``done`` ends the episode.
    ``reward`` accumulates over the episode (most environments reward only the last step). ``info`` may
    carry counted facts: ``tool_call`` (a call was made), ``tool_error`` (the tool failed on the policy's
    input), ``malformed`` (the turn could not be parsed as a call or an answer), ``correct`` (an answer was
    judged right)."""

    observation: str | list[dict] | None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One agent episode's world (docs/agentic.md). A new instance per episode, made by a factory
    from the env registry; ``step`` runs on a worker thread (never on the decoding path) under a
    per-step timeout, and may be a plain or an ``async def`` function.

    An exception raised by ``reset`` or ``step`` is an infrastructure failure (the environment broke,
    not the policy): the episode is ended, counted and kept out of its group's baseline. A tool that
    fails on the policy's input should instead return an error observation with ``tool_error``."""

    stop: Sequence[str]
    """Strings that end a model turn (e.g. the close of a tool call), besides EOS."""

    def reset(self, prompt: Prompt) -> str | None:
        """Start the episode; an optional first observation appended after the prompt."""
        ...

    def step(self, turn_text: str) -> EnvStep: ...


@runtime_checkable
class Tracker(Protocol):
    """A metrics sink (JSONL, TensorBoard, W&B, ...)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...
