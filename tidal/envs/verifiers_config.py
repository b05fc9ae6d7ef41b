"""``env.verifiers``: which verifiers environment (``env.name=verifiers``) a run trains, and how.

Plain data with no verifiers import, so a run config can name it without the ``verifiers`` extra.
verifiers 0.4 (``verifiers.v1``) calls an environment a *taskset*: a package (or module) exporting
one ``vf.Taskset`` subclass through ``__all__``, whose tasks carry the prompt and whose
``@vf.reward`` methods are the rubric (docs/environments.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

INPROCESS_HARNESS = "tidal_vf_inprocess"
"""verifiers' own chat program run in tidal's process (``serve/vf_inprocess.py``)."""


@dataclass
class VerifiersConfig:
    """A verifiers environment (see module docstring)."""

    id: str | None = None
    """The taskset: an installed module (``reverse_text``, ``my_env``) or a path to one (a ``.py`` file
    or a package folder; a relative path is looked up from the working directory, then from tidal's
    source checkout), as verifiers' own ``eval`` takes ``<taskset-id>``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The taskset's config fields (what ``--env.taskset.<key>`` sets in verifiers), e.g. ``num_tasks``,
    ``split``, ``task.tolerance``: the keyword arguments its ``load`` sees through ``self.config``."""
    eval_kwargs: dict[str, Any] | None = None
    """The held-out split: the taskset loaded again with these fields over ``kwargs`` (e.g.
    ``{"split": "test"}``). None: the last ``num_eval`` tasks of the one taskset are held out and never
    trained on."""
    num_eval: int = 100
    """Held-out tasks (from the end of the taskset when ``eval_kwargs`` is None)."""
    max_tasks: int = 100_000
    """Tasks read from the taskset at most: an ``INFINITE`` taskset is cut here (verifiers' ``-n``)."""
    demos: str | None = None
    """Warm-start demonstrations for a model that starts from scratch (the tiny model): ``module:function``
    or ``path/file.py:function`` mapping a task's ``TaskData`` to the assistant's part of a correct episode
    (OpenAI messages: tool calls, tool results, the answer). tidal puts the environment's own system prompt
    and prompt in front, and the chat template renders them. None: no warm start (set ``model.path``)."""
    harness: str = INPROCESS_HARNESS
    """verifiers harness id that runs each rollout: the default runs verifiers' ``null`` chat program in
    tidal's process; ``null`` starts it as a ``uv`` subprocess per rollout, as verifiers' ``eval`` does
    (needs ``uv`` and the program's dependencies; ~1.4 s of CPU per episode)."""
    runtime: str = "subprocess"
    """verifiers runtime type for the rollout (``subprocess``: a scratch folder on this machine). The
    container and remote runtimes (``docker``, ``prime``, ``modal``) are not supported here."""
