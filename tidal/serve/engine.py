"""Train an agent harness: a RolloutEngine whose trajectories are episodes of the user's own agent.

The user's agent is a function ``run_episode(client, task) -> reward`` written against a real
``openai.OpenAI`` client (docs/harness.md). ``HarnessEngine`` wraps the run's engine (local, vLLM,
Ray) behind a ``HarnessServer`` and is a RolloutEngine itself, so the controller trains agent
episodes exactly as it trains built-in ones, in ``sync`` and ``async`` mode, with no branch on what
produced them:

- ``stream(source, on_done)``: each request the controller admits (one sample of one task) becomes
  one episode: an id (``<task uid>.<sample index>``), the episode opened on the server with its task,
  and the agent started on its own thread with a client whose base URL carries that id. The agents'
  completion requests share the inner engine's continuous batch through the server's engine thread.
  When the agent returns, its recorded episode (exact token ids, behaviour log-probs, versions) is
  handed to ``on_done`` as one Trajectory with the reward it returned.
- ``request_weight_update`` goes to the inner engine, which interrupts the turns it is decoding and
  resumes them under the new weights (every token keeps the version that sampled it), so the
  staleness bound is the controller's, counted from each episode's oldest sampled token.
- The reward is the number the agent returns, or with ``harness.reward=task`` the run's task reward on
  the episode's final answer (the last reply's content), scored by the reward pool like a single-turn
  sample (``Trajectory.score_text``), so an agent needs no grading code of its own.
- An agent that raises, returns something that is not a number (with ``harness.reward=agent``), makes
  no completion request, or does not return within ``harness.episode_timeout_s`` has its episode
  dropped on the server (its later requests get 409) and reported as an infrastructure failure: the
  controller leaves it out of its group's baseline (as for a built-in environment that fails) and
  ``harness/*`` counts it. A hung agent's thread cannot be killed; it is abandoned (daemon) and
  counted in ``harness/hung``.
- ``async def run_episode(client, task)`` is an asyncio agent: it gets an ``openai.AsyncOpenAI`` client,
  and all episodes run as tasks on one event-loop thread instead of a thread each; a hung one is
  cancelled rather than abandoned.
- An episode whose agent edited its history has several segments (``recorder.py``); a trajectory is
  one context, so the episode trains on its last segment (the one that led to the reward) and the
  earlier ones are counted in ``harness/dropped_segments``, never merged into wrong contexts.

Held-out evaluation (``generate(..., greedy=True)``) runs the same agent against a second server whose
engine decodes greedily; its episodes are never trained on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib
import importlib.util
import inspect
import itertools
import math
import queue
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tidal.api import GenRequest, RolloutEngine
from tidal.config import ConfigError
from tidal.rollout.requests import generate_by_stream
from tidal.serve.config import HarnessConfig
from tidal.serve.server import HarnessServer
from tidal.types import Trajectory
from tidal.utils.seeding import stable_hash

MAX_PRINTED_FAILURES = 5
COUNTERS = ("started", "finished", "crashed", "hung", "no_completion", "dropped_segments")


def load_function(spec: str, roots: Sequence[Path] = ()) -> Callable[[Any, Any], Any]:
    """The callable ``spec`` names: ``path/to/file.py:name`` (relative paths are looked up under the
    working directory, then under ``roots``) or ``package.module:name``. A ``ConfigError`` naming
    ``harness.function`` when it cannot be found, imported, or called with ``(client, task)``."""
    where = f"harness.function={spec!r}"
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"{where} must be 'path/to/file.py:function' or 'package.module:function'")
    if target.endswith(".py") or "/" in target:
        candidates = [Path(target)] if Path(target).is_absolute() else [Path.cwd() / target,
                                                                        *(Path(r) / target for r in roots)]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise ConfigError(f"{where}: no file {target} (looked in {', '.join(str(p.parent) for p in candidates)})")
        module_name = f"tidal_harness_{stable_hash(str(path.resolve())):016x}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look their module up here
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # the user's file failed to import: one line naming it
            del sys.modules[module_name]
            raise ConfigError(f"{where}: importing {path} raised {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ConfigError(f"{where}: cannot import module {target!r} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(f"{where}: {target} has no function {name!r} (callables there: {', '.join(found) or 'none'})")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ConfigError(f"{where}: {name}{inspect.signature(fn)} cannot be called as {name}(client, task)") from None
    except ValueError:  # a builtin without a signature: let the call decide
        pass
    return fn


@dataclasses.dataclass(frozen=True)
class Scored:
    """What an agent may return instead of a bare number: the reward and the named parts it was made
    of (a verifiers rubric's reward functions, ``serve/verifiers_bridge.py``). The parts go to the
    trajectory's ``reward_details["components"]``, which the controller logs as ``reward/<name>/mean``."""

    reward: float
    components: Mapping[str, float]


def as_reward(value: Any) -> float:
    """The agent's return value as a reward: a finite number (bools count as 0/1), else TypeError."""
    if isinstance(value, Scored):
        value = value.reward
    if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
        return float(value)
    raise TypeError(f"run_episode must return the episode's reward as a finite number, got {value!r}")


class HarnessEngine:
    """A RolloutEngine whose trajectories are episodes of a user's agent function (see module docstring)."""

    def __init__(self, engine: RolloutEngine, tokenizer, run_episode: Callable[[Any, Any], Any],
                 cfg: HarnessConfig, context_len: int, max_tokens: int):
        self.engine = engine
        self.tokenizer = tokenizer
        self.run_episode = run_episode
        self.cfg = cfg
        self.context_len = context_len
        # A key per run unless one is set: the agents' clients carry it, and no other local process can
        # add turns to a live episode (its id, ``<task uid>.<sample index>``, is predictable) or open
        # episodes up to ``max_episodes``.
        self.serve_cfg = dataclasses.replace(cfg.serve, max_tokens=max_tokens,
                                             api_key=cfg.serve.api_key or "tidal-" + secrets.token_urlsafe(24))
        self._servers: dict[bool, HarnessServer] = {}
        self._clients: dict[bool, Any] = {}
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.errors: deque[str] = deque(maxlen=20)  # the latest agents' failures, one line each
        self.episode_s = 0.0  # wall seconds of the agents' episodes, summed
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.is_async = inspect.iscoroutinefunction(run_episode)
        self._loop: asyncio.AbstractEventLoop | None = None  # async agents: one event loop thread runs them all
        self._async_clients: dict[bool, Any] = {}

    # ---- the RolloutEngine protocol: weights go to the engine behind the server -----------------
    @property
    def version(self) -> int:
        return self.engine.version

    def request_weight_update(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.engine.request_weight_update(state_dict, version)

    def stats(self) -> dict[str, float]:
        out = dict(self.engine.stats())
        out.update({f"harness/{k}": float(v) for k, v in self.counts.items()})
        done = self.counts["finished"]
        out["harness/episode_s_mean"] = self.episode_s / done if done else 0.0
        server = self._servers.get(False)
        if server is not None:
            s = server.stats()
            for key in ("history_edits", "not_append_only", "vision_tokens", "timed_out", "undelivered",
                        "max_in_flight"):
                out[f"harness/{key}"] = s.get(f"harness/{key}", 0.0)
            out["harness/requests"] = float(server.bridge.num_requests)
        return out

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        if self._loop is not None:
            for client in self._async_clients.values():
                asyncio.run_coroutine_threadsafe(client.close(), self._loop).result(timeout=10)
            self._async_clients.clear()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def generate(self, requests: Sequence[GenRequest], greedy: bool = False) -> list[Trajectory]:
        return generate_by_stream(self.stream, requests, greedy)

    def server(self, greedy: bool = False) -> HarnessServer:
        """The endpoint for training (sampling) or evaluation (greedy) episodes, started on first use."""
        if greedy not in self._servers:
            import openai  # the harness extra: tidal[harness]

            server = HarnessServer(self.engine, self.tokenizer, self.context_len, self.serve_cfg, greedy=greedy)
            self._servers[greedy] = server.start()
            # One client (one connection pool) per server; each episode gets a copy with its own base URL
            # (``with_options`` shares the pool: ~50 us, against ~20 ms for a new client).
            self._clients[greedy] = openai.OpenAI(base_url=server.base_url("_"), api_key=server.api_key or "none",
                                                  max_retries=0, timeout=self.cfg.episode_timeout_s)
            if self.is_async:
                self._async_clients[greedy] = self._on_loop(self._async_client(server)).result()
        return self._servers[greedy]

    async def _async_client(self, server: HarnessServer):
        """An ``openai.AsyncOpenAI`` client made on the agents' loop, which its connection pool belongs to."""
        import openai

        return openai.AsyncOpenAI(base_url=server.base_url("_"), api_key=server.api_key or "none",
                                  max_retries=0, timeout=self.cfg.episode_timeout_s)

    def _on_loop(self, coro) -> concurrent.futures.Future:
        """Run ``coro`` on the agents' event loop (started on first use, one daemon thread)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="tidal-agents", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # ---- episodes -----------------------------------------------------------------------------
    def stream(self, source: Callable[[int, bool], list[GenRequest] | None],
               on_done: Callable[[GenRequest, Trajectory], None], greedy: bool = False) -> None:
        """Run one agent episode per request ``source`` gives (at most ``max_concurrent_episodes`` at
        once); each finished (or failed) episode goes to ``on_done`` as one Trajectory, on this thread."""
        server = self.server(greedy)
        client = (self._async_clients if self.is_async else self._clients)[greedy]
        finished: queue.Queue = queue.Queue()  # (episode id, reward or None, error or None, seconds, details)
        live: dict[str, tuple[GenRequest, float]] = {}  # episode id -> (request, start time)
        tasks: dict[str, concurrent.futures.Future] = {}  # async agents' episodes, cancelled when hung
        exhausted = False
        timeout = self.cfg.episode_timeout_s
        while True:
            server.bridge.check()  # the engine failed: stop the run rather than crash every episode
            room = self.cfg.max_concurrent_episodes - len(live)
            if room > 0 and not exhausted:
                got = source(room, not live)
                if got is None:
                    exhausted = True
                else:
                    for request in got:
                        episode_id = self._start(server, client, request, finished, tasks)
                        live[episode_id] = (request, time.monotonic())
            if exhausted and not live:
                return
            if not live:
                continue
            deadline = min(start for _, start in live.values()) + timeout
            try:
                item = finished.get(timeout=max(0.0, min(0.05, deadline - time.monotonic())))
            except queue.Empty:
                item = None
            while item is not None:
                server.bridge.check()  # an agent that failed on a failed engine is not the agent's failure
                episode_id, reward, error, seconds, details = item
                if episode_id in live:  # else: already reported as hung; its late result is ignored
                    request, _ = live.pop(episode_id)
                    tasks.pop(episode_id, None)
                    on_done(request, self._collect(server, request, episode_id, reward, error, seconds, details))
                try:
                    item = finished.get_nowait()
                except queue.Empty:
                    item = None
            now = time.monotonic()
            for episode_id in [e for e, (_, start) in live.items() if now - start > timeout]:
                request, _ = live.pop(episode_id)
                task = tasks.pop(episode_id, None)
                if task is not None:  # an async agent is cancelled, not abandoned
                    task.cancel()
                server.drop(episode_id, "hung")
                self._count("hung", f"episode {episode_id}: the agent did not return within "
                                    f"harness.episode_timeout_s={timeout}")
                on_done(request, self._failed(request, episode_id, "hung"))

    def _start(self, server: HarnessServer, client, request: GenRequest, finished: queue.Queue,
               tasks: dict[str, concurrent.futures.Future]) -> str:
        """Open the episode on the server and start its agent thread; the episode id."""
        episode_id = f"{request.prompt.uid}.{request.sample_index}"
        if server.recorder.known(episode_id):  # the same task again (held-out evaluations): a fresh id
            episode_id = f"{episode_id}.{next(self._ids)}"
        server.recorder.open(episode_id, request.prompt)
        episode_client = client.with_options(base_url=server.base_url(episode_id))
        self.counts["started"] += 1

        def report(returned: Any, error: str | None, start: float) -> None:
            reward = None
            if error is None:
                try:
                    reward = 0.0 if self.cfg.reward == "task" else as_reward(returned)
                except TypeError as e:
                    error = f"TypeError: {e}"
            details = {"components": dict(returned.components)} if isinstance(returned, Scored) else None
            finished.put((episode_id, reward, error, time.perf_counter() - start, details))

        def run() -> None:
            start = time.perf_counter()
            try:
                returned, error = self.run_episode(episode_client, request.prompt), None
            except BaseException as e:  # noqa: BLE001  (the agent's failure: reported, never kills the run)
                returned, error = None, f"{type(e).__name__}: {e}"
            report(returned, error, start)

        async def run_async() -> None:
            start = time.perf_counter()
            try:
                returned, error = await self.run_episode(episode_client, request.prompt), None
            except asyncio.CancelledError:  # hung: stream() already reported it
                return
            except Exception as e:  # noqa: BLE001
                returned, error = None, f"{type(e).__name__}: {e}"
            report(returned, error, start)

        if self.is_async:
            tasks[episode_id] = self._on_loop(run_async())
        else:
            threading.Thread(target=run, name=f"tidal-agent-{episode_id}", daemon=True).start()
        return episode_id

    def _collect(self, server: HarnessServer, request: GenRequest, episode_id: str, reward: float | None,
                 error: str | None, seconds: float, details: dict | None = None) -> Trajectory:
        if error is not None:
            server.drop(episode_id, "crashed")
            self._count("crashed", f"episode {episode_id}: {error}")
            return self._failed(request, episode_id, f"the agent raised {error}")
        try:
            segments = server.finish(episode_id, reward)
        except KeyError:  # the server dropped it as idle (episode_timeout_s of harness.serve)
            self._count("hung", f"episode {episode_id}: dropped by the server as idle")
            return self._failed(request, episode_id, "the server dropped the episode as idle")
        if not segments:
            self._count("no_completion", f"episode {episode_id}: the agent returned without a completion")
            return self._failed(request, episode_id, "the agent made no completion request")
        with self._lock:
            self.counts["finished"] += 1
            self.counts["dropped_segments"] += len(segments) - 1
            self.episode_s += seconds
        traj = segments[-1]
        info = traj.episode
        info.update(tool_errors=0, tool_timeouts=0, malformed=info["malformed_tool_calls"],
                    tool_latency_s=0.0, episode_s=seconds, episode_id=episode_id)
        if self.cfg.reward == "task":  # the controller's reward pool scores it (Trajectory.score_text)
            info["final_answer"] = info["last_answer"]
        if details is not None and self.cfg.reward == "agent":
            traj.reward_details = details
        return dataclasses.replace(traj, prompt_uid=request.prompt.uid, sample_index=request.sample_index)

    def _count(self, key: str, line: str) -> None:
        with self._lock:
            self.counts[key] += 1
            self.errors.append(line)
            failures = sum(self.counts[k] for k in ("crashed", "hung", "no_completion"))
        if failures <= MAX_PRINTED_FAILURES:  # say why, once per kind of trouble, without flooding a long run
            print(f"harness: {key}: {line}" + (" (further failures are only counted)" if failures ==
                                               MAX_PRINTED_FAILURES else ""), file=sys.stderr, flush=True)

    @staticmethod
    def _failed(request: GenRequest, episode_id: str, why: str) -> Trajectory:
        """An episode that produced nothing to train on: an infrastructure failure (module docstring)."""
        info = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "malformed": 0,
                "tool_latency_s": 0.0, "num_versions": 0, "infra_failure": why, "episode_id": episode_id}
        return Trajectory(prompt_uid=request.prompt.uid, sample_index=request.sample_index,
                          prompt_ids=list(request.prompt_ids), token_ids=[], logprobs=[], versions=[],
                          finish_reason="agent_error", text="", reward=0.0, loss_mask=[], episode=info)
