"""Shared pieces of the episode tests: scripted environments, the recording inner engine, a
stream that cannot hang the suite, and the token-exactness and log-prob checks."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import torch

from tidal.api import EnvStep, GenRequest
from tidal.envs.config import EnvConfig
from tidal.models import tiny
from tidal.models.logprobs import token_logprobs
from tidal.rollout.episodes import EpisodeEngine
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.types import Prompt, Trajectory

TINY = tiny.ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64)
DEFAULT_TIMEOUT_OBS = "error: the tool timed out"


# ---- scripted environments ----------------------------------------------------------------------
def default_obs(prompt: Prompt, n: int) -> str:
    """The observation after a prompt's n-th turn (n >= 1): varies with both, plain characters."""
    return f" {n}{prompt.answer}="


class Scripted:
    """Answers ``turns - 1`` turns with ``obs(prompt, n)`` (``step_reward`` each), then ends with
    ``final_reward``; ``first``: an observation at reset; ``on_step(env, n)`` runs inside each step."""

    stop: list[str] = []

    def __init__(self, turns=3, first=None, step_reward=0.0, final_reward=1.0, obs=default_obs, on_step=None):
        self.turns, self.first, self.step_reward, self.final_reward = turns, first, step_reward, final_reward
        self.obs, self.on_step = obs, on_step
        self.prompt: Prompt | None = None
        self.texts: list[str] = []

    def reset(self, prompt):
        self.prompt = prompt
        return self.first

    def step(self, turn_text):
        self.texts.append(turn_text)
        n = len(self.texts)
        if self.on_step is not None:
            self.on_step(self, n)
        if n >= self.turns:
            return EnvStep(None, self.final_reward, done=True, info={"correct": True})
        return EnvStep(self.obs(self.prompt, n), self.step_reward, info={"tool_call": True})


class Factory:
    """``make_env`` for EpisodeEngine: builds ``cls(**kw)`` and keeps every environment it made."""

    def __init__(self, cls=Scripted, **kw):
        self.cls, self.kw, self.envs = cls, kw, []
        self.lock = threading.Lock()

    def __call__(self):
        env = self.cls(**self.kw)
        with self.lock:
            self.envs.append(env)
        return env


class _Stopped(Exception):
    pass


class _Recording:
    """The inner engine as EpisodeEngine sees it, recording every model turn (request, trajectory)
    and the requests in flight; ``stop`` ends a stream that hangs (its next ``source`` call raises)."""

    def __init__(self, engine: LocalEngine):
        self.engine = engine
        self.turns: dict[tuple[str, int], list[tuple[GenRequest, Trajectory]]] = defaultdict(list)
        self.stop = threading.Event()
        self.in_flight = self.max_in_flight = 0

    @property
    def version(self):
        return self.engine.version

    def request_weight_update(self, state_dict, version):
        self.engine.request_weight_update(state_dict, version)

    def stats(self):
        return self.engine.stats()

    def stream(self, source, on_done, greedy=False):
        def src(n, block):
            if self.stop.is_set():
                raise _Stopped
            got = source(n, block)
            self.in_flight += len(got or [])
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return got

        def done(request, traj):
            self.in_flight -= 1
            self.turns[(request.prompt.uid, request.sample_index)].append((request, traj))
            on_done(request, traj)

        self.engine.stream(src, done, greedy)


def make_engine(model, tokenizer, factory, context_len=128, max_turn_tokens=6, seed=0, **env):
    inner = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=max_turn_tokens), seed=seed)
    rec = _Recording(inner)
    return EpisodeEngine(rec, tokenizer, factory, EnvConfig(**env), context_len=context_len, seed=seed,
                         max_turn_tokens=max_turn_tokens), rec, inner


def _bounded(rec: _Recording, fn, timeout_s=30.0):
    """``fn()`` on a thread; a stream still running after ``timeout_s`` is stopped and the test fails."""
    box: list = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001  (re-raised on the test's thread)
            box.append(("err", e))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        rec.stop.set()
        th.join(10)
        pytest.fail(f"the episode stream hung (still running after {timeout_s}s)")
    kind, value = box[0]
    if kind == "err":
        raise value
    return value


def prompts_(n, prefix="p"):
    return [Prompt(f"{prefix}{i}", f"{i}+{2 * i + 3}=", str(3 * i + 3)) for i in range(n)]


def generate(ee, rec, requests, **kw):
    return _bounded(rec, lambda: ee.generate(requests, **kw))


# ---- checks shared by several tests ----------------------------------------------------------------
def enc(tokenizer, text):
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def check_token_exact(traj, turns, tokenizer, prompt, first=None, obs=default_obs):
    """``prompt_ids + token_ids`` is exactly the turns' sampled ids interleaved with each observation's
    ids (tokenized once); each turn was asked for with the context so far; the mask marks sampled ids.
    Returns the expected mask."""
    context = list(traj.prompt_ids)
    assert context == [tokenizer.bos_token_id, *enc(tokenizer, prompt.text)]
    mask: list[int] = []
    if first:
        ids = enc(tokenizer, first)
        context += ids
        mask += [0] * len(ids)
    full = traj.prompt_ids + traj.token_ids
    for k, (req, t) in enumerate(turns):
        assert req.turn == k and list(req.prompt_ids) == context, f"turn {k} asked with another context"
        context += t.token_ids
        mask += [1] * len(t.token_ids)
        if len(context) < len(full):  # an observation followed this turn
            ids = enc(tokenizer, obs(prompt, k + 1))
            context += ids
            mask += [0] * len(ids)
    assert context == full
    assert traj.loss_mask == mask
    return mask


def recompute(model, traj, temperature=1.0):
    ids = torch.tensor([traj.prompt_ids + traj.token_ids])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature)
    return logp[0, len(traj.prompt_ids):]


def check_logprobs(model, traj, atol=1e-4):
    """Sampled positions: the trainer's log-probs equal the engine's; observations: 0.0 and version -1."""
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    engine = torch.tensor(traj.logprobs)
    versions = torch.tensor(traj.versions)
    assert mask.any()
    diff = (recompute(model, traj)[mask] - engine[mask]).abs().max().item()
    assert diff < atol, f"trainer vs engine log-probs differ by {diff}"
    assert (engine[~mask] == 0.0).all() and (versions[~mask] == -1).all()
    assert (versions[mask] >= 0).all() and (engine[mask] < 0).all()
    return diff


def _named(names):
    """Prompts whose uids are ``names`` (scripted environments behave by uid)."""
    return [Prompt(name, f"{i}+{i}=", str(2 * i)) for i, name in enumerate(names)]
