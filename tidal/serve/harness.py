"""Run a user's agent function over many concurrent episodes against the endpoint; collect groups.

The user writes ``run_episode(client, task) -> reward`` with a real ``openai.OpenAI`` client (no
tidal imports needed in the agent); ``run_episodes`` gives each episode its own client whose base URL
carries the episode id, runs ``group_size`` episodes per task on a thread pool (the agents' HTTP
calls then share the engine's continuous batching through the server), and turns each finished
episode into Trajectories carrying the reward the function returned.

What can go wrong, and what happens: the agent raises (crashes) -> the episode is dropped and counted
in ``crashed``; it does not finish within ``episode_timeout_s`` -> dropped and counted in ``hung``
(its thread cannot be killed; its later requests get 409 ``episode_closed``); it returns a reward
that is not a number -> crashed. A group keeps its healthy episodes; a task whose episodes all
failed yields no group.
"""

from __future__ import annotations

import concurrent.futures as cf
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.serve.server import HarnessServer
from tidal.types import Group, Prompt


@dataclass
class EpisodeReport:
    groups: list[Group]
    counts: dict[str, int] = field(default_factory=lambda: {"finished": 0, "crashed": 0, "hung": 0})
    errors: list[str] = field(default_factory=list)  # one line per crashed episode


def run_episodes(server: HarnessServer, run_episode: Callable[[Any, Prompt], float], tasks: Sequence[Prompt],
                 group_size: int = 1, max_concurrent: int = 16, episode_timeout_s: float = 600.0) -> EpisodeReport:
    """Run ``group_size`` episodes of ``run_episode`` per task, ``max_concurrent`` at a time."""
    import openai  # the harness extra: tidal[harness]

    report = EpisodeReport([])
    by_task: dict[str, list] = {t.uid: [] for t in tasks}
    pool = cf.ThreadPoolExecutor(max_concurrent, thread_name_prefix="tidal-agent")
    futures = {}
    for task in tasks:
        for j in range(group_size):
            episode_id = f"{task.uid}.{j}.{uuid.uuid4().hex[:8]}"
            server.recorder.open(episode_id, task)
            client = openai.OpenAI(base_url=server.base_url(episode_id), api_key=server.api_key or "none",
                                   max_retries=0, timeout=episode_timeout_s)
            futures[pool.submit(run_episode, client, task)] = (task, episode_id)
    done, hung = cf.wait(futures, timeout=episode_timeout_s)
    for future in hung:
        task, episode_id = futures[future]
        server.drop(episode_id, "hung")
        report.counts["hung"] += 1
    for future in done:
        task, episode_id = futures[future]
        try:
            reward = float(future.result())
        except Exception as e:  # noqa: BLE001  (the agent's failure: counted, never kills the run)
            server.drop(episode_id, "crashed")
            report.counts["crashed"] += 1
            report.errors.append(f"episode {episode_id}: {type(e).__name__}: {e}")
            continue
        by_task[task.uid] += server.finish(episode_id, reward)
        report.counts["finished"] += 1
    pool.shutdown(wait=False, cancel_futures=True)
    for task in tasks:
        trajs = by_task[task.uid]
        for i, t in enumerate(trajs):  # one sample index per trajectory of the group
            t.sample_index = i
        if trajs:
            report.groups.append(Group(task, trajs))
    return report
