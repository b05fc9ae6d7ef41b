"""An agent that is a separate program: one process per episode, pointed at the episode's endpoint.

``harness.command`` runs any program as the agent (any language, any framework), unmodified when it
reads the OpenAI client's standard environment variables, which the ``openai`` SDKs do by default:

- ``OPENAI_BASE_URL``: the episode's base URL (``.../episodes/<episode id>/v1``), ``OPENAI_API_KEY``:
  the server's key (or ``none`` on loopback without one);
- ``TIDAL_EPISODE_ID`` and ``TIDAL_TASK``, the task as JSON: ``{"uid", "text", "answer", "meta"}``.

The reward is the last line the process prints on stdout (``harness.reward=agent``), or the run's task
reward on its final answer (``harness.reward=task``: the process need print nothing). A non-zero exit
is the agent's failure (crashed, with the last line of its stderr); a process still running at
``harness.episode_timeout_s`` is killed, unlike an agent thread, which can only be abandoned.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

from tidal.config import ConfigError


def episode_env(client, task) -> dict[str, str]:
    """The environment an agent process gets for one episode (module docstring)."""
    base_url = str(client.base_url).rstrip("/")
    episode_id = base_url.rsplit("/episodes/", 1)[-1].removesuffix("/v1")
    task_json = json.dumps({"uid": task.uid, "text": task.text, "answer": task.answer, "meta": task.meta},
                           default=str)
    return {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": client.api_key or "none",
            "TIDAL_EPISODE_ID": episode_id, "TIDAL_TASK": task_json}


def process_agent(command: str, timeout_s: float) -> Callable[[Any, Any], float | None]:
    """``run_episode(client, task)`` that runs ``command`` (split like a shell would, not run by one) as
    the episode's agent; a ``ConfigError`` naming ``harness.command`` when it cannot be split."""
    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise ConfigError(f"harness.command={command!r} cannot be split into arguments: {e}") from None
    if not argv:
        raise ConfigError("harness.command is empty")
    if shutil.which(argv[0]) is None:
        raise ConfigError(f"harness.command={command!r}: no program {argv[0]!r} (not on PATH, not an executable)")

    def run_episode(client, task) -> float | None:
        try:
            proc = subprocess.run(argv, env=episode_env(client, task), capture_output=True, text=True,
                                  timeout=timeout_s, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise RuntimeError(f"harness.command: no program {argv[0]!r}") from None
        except subprocess.TimeoutExpired:  # killed; the engine has already counted the episode as hung
            raise RuntimeError(f"the agent process ran past {timeout_s} s and was killed") from None
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            raise RuntimeError(f"the agent process exited with {proc.returncode}: {last}")
        lines = proc.stdout.strip().splitlines()
        if not lines:
            return None
        try:
            return float(lines[-1])
        except ValueError:
            raise TypeError(f"the agent process's last stdout line must be its reward, got {lines[-1]!r}") from None

    return run_episode
