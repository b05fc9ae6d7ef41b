"""A verifiers environment's rollouts as tidal harness episodes (``env.name=verifiers``).

tidal trains an agent harness by calling ``run_episode(client, task)`` against its OpenAI-compatible
endpoint, one episode id per call (``serve/engine.py``: exact tokens, behaviour log-probs, versions,
interruption by weight updates, failures dropped from the group's baseline). A verifiers environment
fits that slot without changing a line: ``VerifiersEpisodes.run_episode`` is an ``async`` agent that

1. finds the ``vf.Task`` the prompt stands for (``tasks/verifiers_task.py``),
2. points verifiers at the episode's endpoint: a ``vf.ModelContext`` whose client config is the
   episode's base URL and the server's key, the model name the server serves, and no sampling
   overrides (the engine's temperature and ``rollout.max_new_tokens`` apply),
3. runs ``env.run_episode(task, ctx)``: the environment's own rollout (its harness program, its
   interception server, its stop conditions and tools), then its own rubric (every ``@vf.reward``,
   with its weight: ``trace.reward`` is their weighted sum),
4. returns that reward with each reward function's score and weight as components (logged as
   ``reward/<name>/mean`` and ``reward/<name>/weight/mean``).

An episode verifiers marks failed (the environment or its rubric raised, a stage timed out, the model
call failed) raises here, so tidal counts it as an infrastructure failure (``harness/crashed``) and
leaves it out of its group's baseline; a rubric that hangs past ``harness.episode_timeout_s`` is
cancelled and counted in ``harness/hung``. Environments with more than one trace per episode
(multi-agent ``vf.Env`` subclasses) are refused per episode the same way: tidal trains one policy
context per episode.

verifiers' serving resources (its interception server, shared tool servers) are started once, on
an event loop of verifiers' own, at the first episode, and live as long as the process. Every episode
makes three or four httpx clients inside verifiers; ``utils/tls.py`` lets them share one verifying TLS
context instead of parsing the CA bundle each time (~100 ms of CPU per episode).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from typing import Any

from tidal.serve.engine import Scored
from tidal.tasks.verifiers_task import VerifiersTasks, require_verifiers
from tidal.types import Prompt
from tidal.utils.tls import share_verified_contexts


class EpisodeFailed(RuntimeError):
    """verifiers reported the episode as failed; the message is its first error."""


def components(trace) -> dict[str, float]:
    """Each reward function's score and weight (``reward/<name>/mean``, ``reward/<name>/weight/mean``)."""
    out: dict[str, float] = {}
    for name, r in trace.rewards.items():
        out[name] = float(r.score)
        out[f"{name}/weight"] = float(r.weight)
    return out


def episode_outcome(episode) -> Scored:
    """The reward and components of a finished verifiers episode, or ``EpisodeFailed``."""
    if episode.errors or not episode.ok:
        first = episode.errors[0] if episode.errors else None
        for trace in episode.traces:
            if first is None and trace.errors:
                first = trace.errors[0]
        why = f"{first.type}: {first.message}" if first is not None else "not ok"
        raise EpisodeFailed(f"the verifiers episode failed: {why}"[:2000])
    if len(episode.traces) != 1:
        raise EpisodeFailed(f"the verifiers episode has {len(episode.traces)} traces; tidal trains environments "
                            "with one agent trace per episode")
    trace = episode.traces[0]
    return Scored(float(trace.reward), components(trace))


def key_variable(api_key: str) -> str:
    """An environment variable holding ``api_key``: verifiers reads a client's key from one by name."""
    name = "TIDAL_VF_KEY_" + hashlib.sha256(api_key.encode()).hexdigest()[:12].upper()
    os.environ[name] = api_key
    return name


class VerifiersEpisodes:
    """The ``run_episode`` for a verifiers environment (see module docstring).

    verifiers runs on an event loop of its own (one daemon thread, started at the first episode), not on
    the agents' loop of the ``HarnessEngine`` that calls ``run_episode``: its serving resources (the
    interception server, the MCP tool servers: Python processes that take seconds to start) are bound to
    the loop they were started on, and one process makes several HarnessEngines in turn (the warm start's
    evaluations, then RL's), each with its own loop. Cancelling ``run_episode`` (a hung episode) cancels
    the episode on verifiers' loop."""

    def __init__(self, tasks: VerifiersTasks, model_name: str = "policy"):
        self.tasks = tasks
        self.model_name = model_name
        self._serving: list[Any] = []  # the entered ``env.serving()`` contexts, kept open for the process
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start = threading.Lock()
        share_verified_contexts()

    def _vf_loop(self) -> asyncio.AbstractEventLoop:
        with self._start:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="tidal-verifiers", daemon=True).start()
                asyncio.run_coroutine_threadsafe(self._serve(), loop).result()
                self._loop = loop
        return self._loop

    async def _serve(self) -> None:
        """Enter each environment's ``serving()`` once, on verifiers' loop."""
        envs = [self.tasks.env] + ([self.tasks.eval_env] if self.tasks.eval_env is not self.tasks.env else [])
        for env in envs:
            cm = env.serving()
            await cm.__aenter__()
            self._serving.append(cm)

    def task_of(self, prompt: Prompt):
        """(environment, ``vf.Task``) for a prompt made by ``tasks/verifiers_task.py``."""
        split, index = prompt.meta["vf_split"], prompt.meta["vf_index"]
        if split == "train":
            return self.tasks.env, self.tasks.train[index]
        return self.tasks.eval_env, self.tasks.eval[index]

    async def run_episode(self, client, prompt: Prompt) -> Scored:
        """One verifiers episode of ``prompt``'s task against ``client``'s endpoint (module docstring)."""
        vf = require_verifiers()
        from verifiers.v1.configs.client import EvalClientConfig

        loop = await asyncio.to_thread(self._vf_loop)  # the first call starts the tool servers: seconds
        env, task = self.task_of(prompt)
        config = EvalClientConfig(base_url=str(client.base_url).rstrip("/"), api_key_var=key_variable(client.api_key))
        ctx = vf.ModelContext(model=self.model_name, client=config)
        future = asyncio.run_coroutine_threadsafe(self._episode(env, task, ctx), loop)
        return episode_outcome(await asyncio.wrap_future(future))

    @staticmethod
    async def _episode(env, task, ctx):
        """``env.run_episode``, then close the model client verifiers opened for it (``release_client``)."""
        try:
            return await env.run_episode(task, ctx)
        finally:
            await release_client(env, ctx.client)


async def release_client(env, config) -> int:
    """Close the client verifiers' interception server made for ``config``; how many were closed.

    The server keeps one model client per endpoint config, for reuse by every rollout under it, and closes
    them when it stops. tidal's endpoint gives each episode its own URL (``/episodes/<id>/v1``), so each
    episode is a config of its own and its client, with its open connection (a socket here and one in
    tidal's server), would stay until the run ended: two file descriptors per episode, until a long run fails
    with "Too many open files". No other episode uses that config, so it is closed as the episode ends (the
    server closes it again at its own stop, which is harmless)."""
    key = config.model_dump_json()
    closed = 0
    for server in getattr(getattr(env, "_interception", None), "servers", None) or []:
        client = getattr(server, "clients", {}).pop(key, None)
        if client is not None:
            await client.close()
            closed += 1
    return closed
