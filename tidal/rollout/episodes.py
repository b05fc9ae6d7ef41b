"""Multi-turn agent episodes on any engine: token in, token out, with the environment off the decode path.

``EpisodeEngine`` wraps a ``RolloutEngine`` (local, vLLM, Ray) and is one itself: a request for a
prompt comes back as one Trajectory covering the whole episode. Inside, an episode alternates:

1. a **model turn**: a request whose ``prompt_ids`` are the episode's context so far, as token ids
   (never a re-tokenization of decoded text: that drift is the classic agentic-RL bug), ``turn``
   keying its sampling noise; it ends at EOS, at the environment's stop string (the close of a tool
   call) or at its length budget. Its tokens keep their behaviour log-probs and versions (a weight
   update mid-turn interrupts and resumes it inside the engine, as for single-turn samples);
2. an **environment step** on a worker thread, with a timeout, so a slow tool never blocks decoding
   and the waiting episode holds no engine slot; its observation is tokenized once (``render.py``)
   and appended to the context with loss mask 0, log-prob 0.0 and version -1.

An MoE policy's routes (``Trajectory.routes``) come with every turn and cover its whole context; the
episode keeps the route each token had when first read (``routes.merge_turn``: the one the tokens sampled
then were computed with) and fills the rest from later turns; the tokens no turn fed (the last sampled
one, a final observation) have ``NO_ROUTE``.

**Images** (a vision-language policy, ``env.renderer=chat``): an observation may be a list of OpenAI content
parts with pictures (``render.py``); the renderer widens each to its token count and keeps the episode's
pictures in token order (``RenderState.images``: the prompt's, then each observation's), so each later turn's
request carries all of them (``GenRequest.images``) and the trajectory too (``Trajectory.images``, which the
trainer places: ``train/vision.py``). A turn that samples a vision marker (``<|image_pad|>``,
``<|vision_start|>``, ``<|vision_end|>``) would make the next context's image tokens disagree with its
pictures, so the episode ends there (finish reason ``vision_token``, counted in ``episode["vision_tokens"]``)
unless the environment ended it anyway.

An episode ends when the environment says done, at ``max_turns``, when its token budget (the model's
context) is spent, or when the environment raises: an infrastructure failure, kept out of its
group's baseline by the controller rather than scored 0. A tool timeout becomes an observation.

Callbacks to the caller (``on_done``) and to the inner engine's ``source`` all run on the engine's
thread; worker threads only hand results over through a queue.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.api import Environment, EnvStep, GenRequest, RolloutEngine
from tidal.envs.config import EnvConfig
from tidal.models import vlm
from tidal.rollout.render import NotAppendOnly, RenderState, build_renderer
from tidal.rollout.requests import generate_by_stream
from tidal.rollout.routes import merge_turn, padded
from tidal.types import Trajectory
from tidal.utils.seeding import stable_hash


@dataclass
class _Episode:
    request: GenRequest  # the caller's request (turn 0): the trajectory is reported against it
    env: Environment
    context: list[int]
    num_prompt: int
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    counts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    infra_failure: str | None = None
    finish_reason: str | None = None
    render: RenderState = field(default_factory=RenderState)
    last_turn: list[int] = field(default_factory=list)
    routes: torch.Tensor | None = None  # MoE: expert ids of the context so far (``routes.merge_turn``)

    def append(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], sampled: bool) -> None:
        self.context += ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [int(sampled)] * len(ids)


COUNTERS = ("tool_calls", "tool_errors", "tool_timeouts", "malformed", "tool_latency_s", "not_append_only",
            "vision_tokens")


class EpisodeEngine:
    """A RolloutEngine whose trajectories are whole agent episodes (see module docstring)."""

    def __init__(self, engine: RolloutEngine, tokenizer, make_env: Callable[[], Environment], cfg: EnvConfig,
                 context_len: int, seed: int = 0, max_turn_tokens: int = 8):
        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer = build_renderer(cfg.renderer, tokenizer)
        self.vision_ids = vlm.vision_token_ids(tokenizer)  # empty for a text policy
        self.make_env = make_env
        self.cfg = cfg
        self.seed = seed
        self.max_turn_tokens = max_turn_tokens
        self.context_len = context_len
        self.num_episodes = 0
        self.num_infra_failures = 0
        self.env_wait_s = 0.0  # seconds episodes spent in their environment, summed

    # ---- the RolloutEngine protocol: weights and stats go to the wrapped engine -----------------
    @property
    def version(self) -> int:
        return self.engine.version

    def request_weight_update(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.engine.request_weight_update(state_dict, version)

    def stats(self) -> dict[str, float]:
        return {**self.engine.stats(), "agent/infra_failures_total": float(self.num_infra_failures)}

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def generate(self, requests: Sequence[GenRequest], greedy: bool = False) -> list[Trajectory]:
        return generate_by_stream(self.stream, requests, greedy)

    # ---- episodes -----------------------------------------------------------------------------
    def stream(self, source: Callable[[int, bool], list[GenRequest] | None],
               on_done: Callable[[GenRequest, Trajectory], None], greedy: bool = False) -> None:
        """Run episodes for the requests ``source`` gives (the inner engine's contract, one level up):
        each finished episode goes to ``on_done`` as one Trajectory."""
        lock = threading.Condition()
        ready: deque[GenRequest] = deque()  # continuation turns whose observation is in the context
        finished: deque[_Episode] = deque()  # episodes to hand to on_done (on this thread)
        live: dict[tuple[str, int], _Episode] = {}
        outer_done = False
        cap = self.cfg.max_concurrent_episodes
        pool = ThreadPoolExecutor(self.cfg.num_workers, thread_name_prefix="tidal-env")

        def deliver() -> None:
            while True:
                with lock:
                    if not finished:
                        return
                    ep = finished.popleft()
                    del live[(ep.request.prompt.uid, ep.request.sample_index)]
                on_done(ep.request, self._trajectory(ep))

        def finish(ep: _Episode, reason: str) -> None:
            ep.finish_reason = reason
            with lock:
                finished.append(ep)
                lock.notify_all()

        def start(request: GenRequest) -> GenRequest | None:
            """Open an episode; its first turn's request (None if its environment failed to start)."""
            ep = _Episode(request, None, list(request.prompt_ids), len(request.prompt_ids))  # type: ignore[arg-type]
            with lock:
                live[(request.prompt.uid, request.sample_index)] = ep
            self.num_episodes += 1
            try:
                ep.env = self.make_env()
                first = ep.env.reset(request.prompt)
            except Exception as e:  # noqa: BLE001  (the environment's failure, not the policy's)
                self._infra_failure(ep, f"reset raised {type(e).__name__}: {e}")
                finish(ep, "env_error")
                return None
            ids, first_ids, ep.render = self.renderer.start(request.prompt, first)
            ep.context, ep.num_prompt = ids, len(ids)
            ep.append(first_ids, [0.0] * len(first_ids), [-1] * len(first_ids), sampled=False)
            request = self._turn_request(ep)
            if request is None:  # the prompt and first observation already spend the budget
                finish(ep, "length")
            return request

        def env_step(ep: _Episode, text: str, delay: float) -> None:
            try:
                reason = self._env_step(ep, text, delay)
            except BaseException as e:  # noqa: BLE001  (a bug here must not hang the episode)
                self._infra_failure(ep, f"episode runner raised {type(e).__name__}: {e}")
                reason = "env_error"
            if reason is not None:
                finish(ep, reason)
                return
            request = self._turn_request(ep)
            if request is None:
                finish(ep, "length")
                return
            with lock:
                ready.append(request)
                lock.notify_all()

        def submit_later(ep: _Episode, text: str, delay: float) -> None:
            try:
                pool.submit(env_step, ep, text, delay)
            except RuntimeError:  # the stream ended (the run stopped) while this tool call waited
                pass

        def inner_on_done(request: GenRequest, traj: Trajectory) -> None:
            ep = live[(request.prompt.uid, request.sample_index)]
            ep.append(traj.token_ids, traj.logprobs, traj.versions, sampled=True)
            if traj.routes is not None:  # the turn's routes cover the whole context now
                ep.routes = merge_turn(ep.routes, traj.routes)
            ep.last_turn = traj.token_ids
            ep.turns += 1
            delay = 0.0
            if self.cfg.latency_median_s > 0:  # a remote tool's wait: a timer, not a busy worker thread
                delay = simulated_latency(self.seed, ep.request, ep.turns, self.cfg.latency_median_s,
                                          self.cfg.latency_sigma)
            if delay > 0:
                timer = threading.Timer(delay, submit_later, (ep, traj.text, delay))
                timer.daemon = True  # a stopped run does not wait for tools it no longer needs
                timer.start()
            else:
                pool.submit(env_step, ep, traj.text, 0.0)
            deliver()

        def inner_source(n: int, block: bool) -> list[GenRequest] | None:
            nonlocal outer_done
            deliver()
            with lock:
                out = [ready.popleft() for _ in range(min(n, len(ready)))]
            room = n - len(out)
            if cap is not None:
                room = min(room, cap - len(live))
            if room > 0 and not outer_done:
                # Block on the caller only when no episode is alive: else a continuation may become
                # ready while we wait (and the caller's admission may be waiting on those episodes).
                got = source(room, block and not out and not live)
                if got is None:
                    outer_done = True
                else:
                    out += [r for r in map(start, got) if r is not None]
                    deliver()  # episodes whose environment failed to start
            if out:
                return out
            if outer_done and not live:
                return None
            if block:
                with lock:
                    if not ready and not finished:
                        lock.wait(0.02)
            return []

        try:
            self.engine.stream(inner_source, inner_on_done, greedy=greedy)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _budget(self, ep: _Episode) -> int:
        """Tokens ``ep`` may still add: the model's context and ``env.max_episode_tokens``, whichever is less."""
        budget = self.context_len - len(ep.context)
        if self.cfg.max_episode_tokens is not None:
            budget = min(budget, self.cfg.max_episode_tokens - (len(ep.context) - ep.num_prompt))
        return budget

    def _turn_request(self, ep: _Episode) -> GenRequest | None:
        """The next model turn of ``ep`` (None if its token budget leaves no room for one token)."""
        budget = self._budget(ep)
        if budget < 1:
            return None
        r = ep.request
        images = _own_images(ep)
        return GenRequest(r.prompt, tuple(ep.context), r.sample_index,
                          min(r.max_new_tokens or self.max_turn_tokens, budget), turn=ep.turns, episode=True,
                          images=None if images is None else tuple(images))

    def _env_step(self, ep: _Episode, text: str, delay: float = 0.0) -> str | None:
        """Run one environment step for ``ep`` on this worker thread (``delay``: simulated latency it
        already waited); a finish reason, or None to go on."""
        t0 = time.perf_counter()
        outcome = _call_with_timeout(ep.env.step, text, self.cfg.step_timeout_s)
        spent = time.perf_counter() - t0 + delay
        ep.counts["tool_latency_s"] += spent
        self.env_wait_s += spent
        if isinstance(outcome, BaseException):
            self._infra_failure(ep, f"step raised {type(outcome).__name__}: {outcome}")
            return "env_error"
        if outcome is _TIMED_OUT:
            ep.counts["tool_timeouts"] += 1
            observation = getattr(ep.env, "timeout_observation", lambda: "error: the tool timed out")()
            step = EnvStep(observation)
        else:
            step = outcome
            if not isinstance(step, EnvStep):
                self._infra_failure(ep, f"step returned {type(step).__name__}, not EnvStep")
                return "env_error"
        for key, counter in (("tool_call", "tool_calls"), ("tool_error", "tool_errors"), ("malformed", "malformed")):
            ep.counts[counter] += bool(step.info.get(key))
        ep.reward += step.reward
        if step.done:
            return "stop"
        if ep.turns >= self.cfg.max_turns:
            return "max_turns"
        if self.vision_ids and not self.vision_ids.isdisjoint(ep.last_turn):
            ep.counts["vision_tokens"] += 1  # the next context's image tokens would not match its pictures
            return "vision_token"
        if step.observation:
            try:
                ids = self.renderer.observation_ids(ep.render, text, ep.last_turn, step.observation)
            except NotAppendOnly:
                ep.counts["not_append_only"] += 1
                return "not_append_only"
            if len(ids) >= self._budget(ep):  # no room left for a turn after it: end here, within budget
                return "length"
            ep.append(ids, [0.0] * len(ids), [-1] * len(ids), sampled=False)
        return None

    def _infra_failure(self, ep: _Episode, why: str) -> None:
        ep.infra_failure = why
        self.num_infra_failures += 1

    def _trajectory(self, ep: _Episode) -> Trajectory:
        ids = ep.context[ep.num_prompt :]
        info: dict[str, Any] = {"turns": ep.turns, **ep.counts, "infra_failure": ep.infra_failure,
                                "num_versions": len({v for v in ep.versions if v >= 0})}
        return Trajectory(
            prompt_uid=ep.request.prompt.uid, sample_index=ep.request.sample_index,
            prompt_ids=list(ep.context[: ep.num_prompt]), token_ids=ids, logprobs=ep.logprobs,
            versions=ep.versions, finish_reason=ep.finish_reason or "length",
            text=self.tokenizer.decode(ids, skip_special_tokens=True), reward=ep.reward,
            reward_details={"env_reward": ep.reward}, loss_mask=ep.mask, episode=info,
            routes=None if ep.routes is None else padded(ep.routes, len(ep.context)),  # last observation: unread
            images=_own_images(ep))


def _own_images(ep: _Episode) -> list | None:
    """The pictures of ``ep``'s context when they are not just its prompt's (observations added some), else None:
    a text episode, or one whose only pictures are the prompt's, stays as a single-turn sample is."""
    images = ep.render.images
    return None if images == ep.request.prompt.images else list(images)


_TIMED_OUT = object()


def _call_with_timeout(fn: Callable[[str], Any], arg: str, timeout_s: float) -> Any:
    """``fn(arg)`` on a daemon thread (a hung tool is abandoned, never joined): its result, the
    exception it raised, or ``_TIMED_OUT``. An ``async def`` step is run to completion there."""
    box: list[Any] = []

    def run() -> None:
        try:
            out = fn(arg)
            box.append(asyncio.run(out) if inspect.isawaitable(out) else out)
        except BaseException as e:  # noqa: BLE001  (reported to the caller, which decides)
            box.append(e)

    thread = threading.Thread(target=run, name="tidal-env-step", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return box[0] if box else _TIMED_OUT


def simulated_latency(seed: int, request: GenRequest, turn: int, median_s: float, sigma: float) -> float:
    """A lognormal latency (median ``median_s``) drawn from a hash of (seed, episode, turn): the same
    episode waits the same in every mode and run."""
    u = (stable_hash(seed, "latency", request.prompt.uid, request.sample_index, turn) % (2**53) + 0.5) / 2**53
    z = math.sqrt(2) * _erfinv(2 * u - 1)
    return median_s * math.exp(sigma * z)


def _erfinv(y: float) -> float:
    """Inverse error function by Newton's method on ``math.erf`` (stdlib has no erfinv)."""
    x = 0.0
    for _ in range(60):
        err = math.erf(x) - y
        if abs(err) < 1e-12:
            break
        x -= err / (2 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


def episode_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Per-step agent metrics over the episodes among ``trajs`` (empty if there are none)."""
    eps = [t.episode for t in trajs if t.episode is not None]
    if not eps:
        return {}
    n = len(eps)
    mean = lambda key: sum(e[key] for e in eps) / n  # noqa: E731
    return {
        "agent/turns_mean": mean("turns"),
        "agent/turns_max": float(max(e["turns"] for e in eps)),
        "agent/tool_calls_mean": mean("tool_calls"),
        "agent/tool_errors": float(sum(e["tool_errors"] for e in eps)),
        "agent/tool_timeouts": float(sum(e["tool_timeouts"] for e in eps)),
        "agent/malformed": float(sum(e["malformed"] for e in eps)),
        "agent/not_append_only": float(sum(e.get("not_append_only", 0) for e in eps)),
        "agent/vision_tokens": float(sum(e.get("vision_tokens", 0) for e in eps)),
        "agent/tool_latency_s_mean": sum(e["tool_latency_s"] for e in eps) / max(sum(e["turns"] for e in eps), 1),
        "agent/multi_version_frac": sum(e["num_versions"] > 1 for e in eps) / n,
        "agent/sampled_tokens_mean": sum(t.num_sampled_tokens for t in trajs if t.episode is not None) / n,
    }
