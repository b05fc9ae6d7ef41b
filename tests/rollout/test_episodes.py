"""Multi-turn agent episodes (``tidal/rollout/episodes.py``) on the local engine, checked in numbers.

A random tiny model rarely writes a tool call, so the environments here are scripted: they answer
every turn with a fixed observation for a number of turns, whatever the text, then end. Every run
goes through ``_bounded`` (a hung stream fails its test instead of hanging the suite), and the inner
engine is seen through ``_Recording``, which keeps every model turn's request and trajectory: the
episode's context is then rebuilt from the turns' sampled ids and the observations' ids, and the
trainer's log-probs (``token_logprobs`` on the whole sequence) are compared with the engine's.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import Counter, defaultdict

import pytest
import torch

from tidal.algo import LOSS_AGGREGATIONS, POLICY_LOSSES
from tidal.algo.aggregation import aggregation_weights
from tidal.algo.config import AlgoConfig
from tidal.api import EnvStep, GenRequest
from tidal.envs.config import EnvConfig
from tidal.models import tiny
from tidal.models.logprobs import token_logprobs
from tidal.rollout.episodes import EpisodeEngine, episode_metrics, simulated_latency
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests, sampling_key
from tidal.train.batch import build_train_batch
from tidal.types import Group, Prompt, Trajectory
from tidal.utils.seeding import stable_hash

from .bpe_fixture import build_bpe_tokenizer

TINY = tiny.ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64)
DEFAULT_TIMEOUT_OBS = "error: the tool timed out"


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny.build_model(TINY, tokenizer)


@pytest.fixture(scope="module")
def bpe():
    tok = build_bpe_tokenizer(vocab_size=240)
    return tok, tiny.build_model(TINY, tok)


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


# ---- 1. token exactness --------------------------------------------------------------------------
@pytest.mark.parametrize("greedy", [False, True])
def test_context_is_exactly_the_sampled_and_observation_ids_and_logprobs_match(model, tokenizer, greedy):
    prompts = prompts_(3)
    factory = Factory(turns=4, first="go:", step_reward=0.25, final_reward=1.0)
    ee, rec, _ = make_engine(model, tokenizer, factory, max_turn_tokens=6)
    requests = group_requests(tokenizer, prompts, 2)
    trajs = generate(ee, rec, requests, greedy=greedy)
    assert [(t.prompt_uid, t.sample_index) for t in trajs] == [(r.prompt.uid, r.sample_index) for r in requests]
    worst = 0.0
    for req, t in zip(requests, trajs):
        turns = rec.turns[(t.prompt_uid, t.sample_index)]
        assert len(turns) == 4 and t.episode["turns"] == 4
        assert t.finish_reason == "stop" and t.reward == pytest.approx(3 * 0.25 + 1.0)
        assert t.episode["tool_calls"] == 3 and t.episode["infra_failure"] is None and not t.infra_failed
        check_token_exact(t, turns, tokenizer, req.prompt, first="go:")
        worst = max(worst, check_logprobs(model, t))
        # the engine's own per-turn numbers are what the episode carries, token for token
        sampled = [i for i, m in enumerate(t.loss_mask) if m]
        assert [t.token_ids[i] for i in sampled] == [x for _, tt in turns for x in tt.token_ids]
        assert [t.logprobs[i] for i in sampled] == [x for _, tt in turns for x in tt.logprobs]
        assert t.num_sampled_tokens == sum(len(tt.token_ids) for _, tt in turns)
        assert t.text == tokenizer.decode(t.token_ids, skip_special_tokens=True)
        assert t.oldest_version == 0 and t.episode["num_versions"] == 1
    # every environment saw exactly the text of the turns it answered
    for p in prompts:
        seen = sorted(x for env in factory.envs if env.prompt.uid == p.uid for x in env.texts)
        sampled = sorted(tt.text for i in range(2) for _, tt in rec.turns[(p.uid, i)])
        assert seen == sampled
    assert worst < 1e-4


# ---- 2. weight updates mid-turn and between turns -------------------------------------------------
def _perturbed(model, seed, scale=0.05):
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return m


def test_weight_updates_mid_turn_and_between_turns_tag_versions_and_logprobs(model, tokenizer):
    models = {0: model, 1: _perturbed(model, 1), 2: _perturbed(model, 2)}
    weights = {v: {k: x.clone() for k, x in m.state_dict().items()} for v, m in models.items()}
    requester: list = []

    def update_between_turns(env, n):  # the first step anywhere: new weights before the next turn
        with lock:
            if requester:
                return
            requester.append((env.prompt.uid, env))
        ee.request_weight_update(weights[2], 2)

    lock = threading.Lock()
    factory = Factory(turns=3, on_step=update_between_turns)
    ee, rec, inner = make_engine(model, tokenizer, factory, max_turn_tokens=6)
    apply, calls = inner._apply_pending_update, []

    def interrupt_mid_turn():
        calls.append(1)
        if len(calls) == 4:  # the third decode step of the first turns (see LocalEngine.stream)
            inner.request_weight_update(weights[1], 1)
        return apply()

    inner._apply_pending_update = interrupt_mid_turn
    requests = group_requests(tokenizer, prompts_(3), 2)
    trajs = generate(ee, rec, requests)
    assert inner.version == 2 and inner.num_weight_updates == 2

    # mid-turn: some first turn was sampled partly under version 0, partly under 1
    first_turns = [turns[0][1] for turns in rec.turns.values()]
    assert any(t.versions[:2] == [0, 0] and set(t.versions[2:]) == {1} for t in first_turns)
    # between turns: the episode whose environment asked for version 2 samples its next turn wholly under it
    uid, env = requester[0]
    mine = [turns for (u, _), turns in rec.turns.items() if u == uid and [x.text for _, x in turns] == env.texts]
    assert len(mine) == 1
    assert max(mine[0][0][1].versions) <= 1 and set(mine[0][1][1].versions) == {2}

    all_versions = Counter()
    for t in trajs:
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        versions = torch.tensor(t.versions)
        sampled = versions[mask].tolist()
        assert sampled == sorted(sampled), "versions never go back along an episode"
        assert (versions[~mask] == -1).all() and (torch.tensor(t.logprobs)[~mask] == 0.0).all()
        assert t.oldest_version == min(sampled) == 0, "observation tokens (-1) do not count as oldest"
        assert t.episode["num_versions"] == len(set(sampled)) > 1
        all_versions.update(sampled)
        engine = torch.tensor(t.logprobs)
        for v, m in models.items():
            at = mask & (versions == v)
            if not at.any():
                continue
            own = recompute(m, t)
            assert (own[at] - engine[at]).abs().max().item() < 1e-4, f"version {v} tokens vs weights {v}"
            other = recompute(models[(v + 1) % 3], t)
            assert (other[at] - engine[at]).abs().max().item() > 1e-3, "the weight sets must be told apart"
    assert set(all_versions) == {0, 1, 2}


# ---- 3. observation tokens: zero loss weight, zero gradient ---------------------------------------
def test_observation_tokens_get_no_loss_weight_and_no_gradient(model, tokenizer):
    factory = Factory(turns=3, first="go:")
    ee, rec, _ = make_engine(model, tokenizer, factory, max_turn_tokens=5)
    prompts = prompts_(2)
    requests = group_requests(tokenizer, prompts, 2)
    trajs = generate(ee, rec, requests)
    groups = [Group(p, [t for t in trajs if t.prompt_uid == p.uid]) for p in prompts]
    batch, _ = build_train_batch(groups, AlgoConfig(skip_zero_adv_groups=False), tokenizer.pad_token_id)
    assert batch is not None and batch.num_sequences == 4
    obs_bt = torch.zeros_like(batch.loss_mask_bt, dtype=torch.bool)
    sampled_bt = torch.zeros_like(obs_bt)
    for r, t in enumerate(trajs):
        p, n = len(t.prompt_ids), len(t.token_ids)
        m = torch.tensor(t.loss_mask, dtype=torch.bool)
        obs_bt[r, p:p + n], sampled_bt[r, p:p + n] = ~m, m
        assert batch.input_ids_bt[r, :p + n].tolist() == t.prompt_ids + t.token_ids
        assert batch.behav_logp_bt[r, p:p + n].tolist() == pytest.approx(t.logprobs, abs=0)
    assert obs_bt.sum() >= 4 * (3 + 2 * 3), "each episode has 'go:' and two observations"
    # the loss mask is 1 exactly at sampled tokens: 0 at observations, the prompt and padding
    assert torch.equal(batch.loss_mask_bt, sampled_bt.float())
    assert (batch.versions_bt[obs_bt] == -1).all() and (batch.behav_logp_bt[obs_bt] == 0).all()
    assert batch.num_response_tokens == sum(t.num_sampled_tokens for t in trajs)

    with torch.no_grad():
        logp_bt, _ = token_logprobs(model, batch.input_ids_bt, batch.attention_mask_bt)
    # observation positions score real (finite, negative) log-probs against a behaviour log-prob of 0:
    # a loss that let them through would see ratios of e^logp there and a nonzero gradient
    assert (logp_bt[obs_bt] < -0.5).all()
    adv = torch.tensor([1.0, -0.5, 0.75, -1.0])
    width = batch.input_ids_bt.shape[1]
    for name in POLICY_LOSSES:
        loss_fn = POLICY_LOSSES[name]
        for agg in LOSS_AGGREGATIONS:
            logp = logp_bt.clone().requires_grad_(True)
            weights = aggregation_weights(batch.loss_mask_bt, agg=agg, group_ids_b=batch.group_index_b,
                                          max_gen_len=width)
            loss, _ = loss_fn(logp, batch.behav_logp_bt, adv, batch.loss_mask_bt, agg_weights_bt=weights,
                              group_ids_b=batch.group_index_b)
            (grad,) = torch.autograd.grad(loss, logp)
            assert torch.isfinite(loss) and torch.isfinite(grad).all(), (name, agg)
            assert (grad[~sampled_bt] == 0).all(), f"{name}/{agg}: gradient at observation/prompt/pad positions"
            assert (grad[sampled_bt] != 0).float().mean() > 0.5, f"{name}/{agg}: sampled tokens must get gradient"


# ---- 4. BPE: re-tokenization drift exists, and the episodes never suffer it -------------------------
def test_bpe_episodes_are_token_exact_although_retokenizing_drifts(bpe, record_property):
    tok, bpe_model = bpe
    assert len(tok) == 240 and (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)

    def obs(prompt, n):
        return f"<c>{prompt.answer}*{n}</c>={int(prompt.answer) * n} "

    prompts = [Prompt(f"b{i}", f"{12 * i + 7}+{5 * i + 30}=", str(17 * i + 37)) for i in range(8)]
    factory = Factory(turns=3, obs=obs)
    ee, rec, _ = make_engine(bpe_model, tok, factory, max_turn_tokens=6)
    requests = group_requests(tok, prompts, 2)
    trajs = generate(ee, rec, requests)

    drifted, turn_drift, example = 0, 0, None
    for req, t in zip(requests, trajs):
        turns = rec.turns[(t.prompt_uid, t.sample_index)]
        check_token_exact(t, turns, tok, req.prompt, obs=obs)
        check_logprobs(bpe_model, t)
        ids = t.prompt_ids + t.token_ids
        again = enc(tok, tok.decode(ids))
        assert tok.decode(again) == tok.decode(ids), "drift changes the ids, not the text"
        if again != ids:
            drifted += 1
        for _, tt in turns:
            if enc(tok, tok.decode(tt.token_ids)) != tt.token_ids:
                turn_drift += 1
                example = example or (tt.token_ids, tok.decode(tt.token_ids), enc(tok, tok.decode(tt.token_ids)))
    frac = drifted / len(trajs)
    num_turns = sum(len(v) for v in rec.turns.values())
    print(f"BPE drift: {drifted}/{len(trajs)} episodes ({frac:.2f}) and {turn_drift}/{num_turns} turns re-encode "
          f"to other ids; e.g. sampled {example[0]} -> {example[1]!r} -> re-encoded {example[2]}")
    record_property("bpe_drift_episode_fraction", frac)
    assert frac > 0 and example is not None, "the test needs drift to be meaningful"
    # a hand-made case of the same thing: the sampled pair "1", "2" reads as "12", one merged token
    pair = tok.convert_tokens_to_ids(["1", "2"])
    assert enc(tok, tok.decode(pair)) == [tok.convert_tokens_to_ids("12")] != pair


# ---- 5. environment failures ---------------------------------------------------------------------
class Faulty(Scripted):
    """Behaves by the prompt's uid: ``reset_raises``, ``step_raises``, ``bad_return`` (a str),
    ``returns_none``, ``hang`` (the first step outlives the timeout), ``hang_custom`` (same, with its own
    timeout observation), ``async`` (an ``async def`` step); anything else is a plain Scripted."""

    def reset(self, prompt):
        if prompt.uid == "reset_raises":
            raise RuntimeError("cannot start the sandbox")
        if prompt.uid == "async":
            self.step = self.async_step
        if prompt.uid == "hang_custom":
            self.timeout_observation = lambda: "=timeout "
        return super().reset(prompt)

    def step(self, turn_text):
        uid = self.prompt.uid
        if uid == "step_raises":
            raise ValueError("the tool crashed")
        if uid == "bad_return":
            return "not an EnvStep"
        if uid == "returns_none":
            return None
        if uid.startswith("hang") and not self.texts:
            self.texts.append(turn_text)  # count the call before hanging: the engine abandons it
            time.sleep(2.0)
            return EnvStep("late", 0.0)
        return super().step(turn_text)

    async def async_step(self, turn_text):
        await asyncio.sleep(0.01)
        return Scripted.step(self, turn_text)


def _named(names):
    return [Prompt(name, f"{i}+{i}=", str(2 * i)) for i, name in enumerate(names)]


def test_environment_failures_end_only_their_own_episode(model, tokenizer):
    names = ["ok0", "reset_raises", "step_raises", "bad_return", "hang", "hang_custom", "async", "ok1"]
    ee, rec, _ = make_engine(model, tokenizer, Factory(Faulty, turns=3), max_turn_tokens=5, step_timeout_s=0.5)
    requests = group_requests(tokenizer, _named(names), 1)
    by = {t.prompt_uid: t for t in generate(ee, rec, requests)}

    t = by["reset_raises"]
    assert t.finish_reason == "env_error" and t.infra_failed and t.token_ids == [] and t.episode["turns"] == 0
    assert t.episode["infra_failure"] == "reset raised RuntimeError: cannot start the sandbox"
    for name, why in (("step_raises", "step raised ValueError: the tool crashed"),
                      ("bad_return", "step returned str, not EnvStep")):
        t = by[name]
        assert t.finish_reason == "env_error" and t.infra_failed and t.episode["infra_failure"] == why
        (_, turn0), = rec.turns[(name, 0)]
        assert t.token_ids == turn0.token_ids and t.loss_mask == [1] * len(turn0.token_ids), "no observation added"
        assert t.episode["turns"] == 1
    assert ee.num_infra_failures == 3 and ee.stats()["agent/infra_failures_total"] == 3.0

    for name, timeout_obs in (("hang", DEFAULT_TIMEOUT_OBS), ("hang_custom", "=timeout ")):
        t = by[name]
        assert t.finish_reason == "stop" and not t.infra_failed and t.reward == 1.0
        assert t.episode["tool_timeouts"] == 1 and t.episode["turns"] == 3
        assert t.episode["tool_latency_s"] >= 0.5
        turns = rec.turns[(name, 0)]
        prompt = next(r.prompt for r in requests if r.prompt.uid == name)
        # turn 1's observation is the timeout's; turn 2's the script's (the hung call counted as its step 1)
        check_token_exact(t, turns, tokenizer, prompt,
                          obs=lambda p, n, o=timeout_obs: o if n == 1 else default_obs(p, n))
    t = by["async"]
    assert t.finish_reason == "stop" and t.episode["turns"] == 3 and t.reward == 1.0 and not t.infra_failed
    check_token_exact(t, rec.turns[("async", 0)], tokenizer, _named(names)[6])

    # the other episodes are exactly what they are in a batch of their own
    alone_ee, alone_rec, _ = make_engine(model, tokenizer, Factory(Faulty, turns=3), max_turn_tokens=5,
                                         step_timeout_s=0.5)
    alone = generate(alone_ee, alone_rec, [r for r in group_requests(tokenizer, _named(names), 1)
                                           if r.prompt.uid.startswith("ok")])
    for a in alone:
        b = by[a.prompt_uid]
        assert b.finish_reason == "stop" and not b.infra_failed and b.episode["turns"] == 3
        assert (a.token_ids, a.loss_mask, a.versions, a.reward) == (b.token_ids, b.loss_mask, b.versions, b.reward)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert alone_ee.num_infra_failures == 0


def test_step_returning_none_is_an_infra_failure_not_a_timeout(model, tokenizer):
    ee, rec, _ = make_engine(model, tokenizer, Factory(Faulty, turns=3), max_turn_tokens=5, step_timeout_s=5.0)
    (t,) = generate(ee, rec, group_requests(tokenizer, _named(["returns_none"]), 1))
    assert t.episode["tool_timeouts"] == 0, "nothing timed out: the step returned at once"
    assert t.finish_reason == "env_error" and t.infra_failed
    assert t.episode["infra_failure"] == "step returned NoneType, not EnvStep"


# ---- 6. budgets ------------------------------------------------------------------------------------
def test_max_turns_ends_the_episode_with_its_reward_so_far(model, tokenizer):
    factory = Factory(turns=100, step_reward=0.25)
    ee, rec, _ = make_engine(model, tokenizer, factory, max_turn_tokens=5, max_turns=3)
    requests = group_requests(tokenizer, prompts_(2), 2)
    for req, t in zip(requests, generate(ee, rec, requests)):
        turns = rec.turns[(t.prompt_uid, t.sample_index)]
        assert t.finish_reason == "max_turns" and t.episode["turns"] == len(turns) == 3
        assert t.reward == 0.75 and t.episode["tool_calls"] == 3
        check_token_exact(t, turns, tokenizer, req.prompt)
        assert t.loss_mask[-len(turns[-1][1].token_ids):] == [1] * len(turns[-1][1].token_ids), \
            "no observation after the last turn"


@pytest.mark.parametrize("budget", ["max_episode_tokens", "context_len"])
def test_token_budget_ends_with_length_and_caps_each_turn(model, tokenizer, budget):
    prompts = prompts_(3)
    num_prompt = len(group_requests(tokenizer, prompts[:1], 1)[0].prompt_ids)
    assert all(len(r.prompt_ids) == num_prompt for r in group_requests(tokenizer, prompts, 1))
    limit = 20
    kw = {"max_episode_tokens": limit} if budget == "max_episode_tokens" else {"context_len": num_prompt + limit}
    ee, rec, _ = make_engine(model, tokenizer, Factory(turns=100), max_turn_tokens=8, max_turns=100, **kw)
    requests = group_requests(tokenizer, prompts, 2)
    capped = 0
    for req, t in zip(requests, generate(ee, rec, requests)):
        turns = rec.turns[(t.prompt_uid, t.sample_index)]
        assert t.finish_reason == "length"
        check_token_exact(t, turns, tokenizer, req.prompt)
        for turn_req, turn in turns:
            left = limit - (len(turn_req.prompt_ids) - num_prompt)
            assert left >= 1 and turn_req.max_new_tokens == min(8, left)
            assert len(turn.token_ids) <= turn_req.max_new_tokens
            capped += turn_req.max_new_tokens < 8
        assert t.num_sampled_tokens <= limit
        assert len(t.prompt_ids) + sum(len(x.token_ids) for _, x in turns) <= num_prompt + limit
    assert capped > 0, "some turn must have been cut to the remaining budget"


def test_trajectory_never_exceeds_its_token_budget(model, tokenizer):
    prompts = prompts_(3)
    ee, rec, _ = make_engine(model, tokenizer, Factory(turns=100), max_turn_tokens=8, max_turns=100,
                             max_episode_tokens=20, context_len=40)
    trajs = generate(ee, rec, group_requests(tokenizer, prompts, 2))
    assert all(t.finish_reason == "length" for t in trajs)
    assert max(t.num_tokens for t in trajs) <= 20
    assert max(len(t.prompt_ids) + t.num_tokens for t in trajs) <= 40


def test_episode_whose_first_observation_spends_the_budget_ends_without_hanging(model, tokenizer):
    ee, rec, _ = make_engine(model, tokenizer, Factory(turns=3, first="a long first observation"),
                             max_turn_tokens=5, max_episode_tokens=4)
    (t,) = _bounded(rec, lambda: ee.generate(group_requests(tokenizer, prompts_(1), 1)), timeout_s=5.0)
    assert t.finish_reason == "length" and t.episode["turns"] == 0 and t.num_sampled_tokens == 0


# ---- 7. concurrency ------------------------------------------------------------------------------
def _stream(ee, rec, requests, on_done):
    queue = list(requests)

    def source(n, block):
        if not queue:
            return None
        taken, queue[:] = queue[:n], queue[n:]
        return taken

    _bounded(rec, lambda: ee.stream(source, on_done))


def test_max_concurrent_episodes_bounds_the_live_episodes(model, tokenizer):
    alive, peak, done = [0], [0], []

    class Counted(Scripted):
        def reset(self, prompt):
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])
            return super().reset(prompt)

        def step(self, turn_text):
            time.sleep(0.02)  # episodes wait on their environment, and others could be let in meanwhile
            return super().step(turn_text)

    def on_done(request, traj):
        alive[0] -= 1
        done.append(traj)

    ee, rec, _ = make_engine(model, tokenizer, Factory(Counted, turns=3), max_turn_tokens=4,
                             max_concurrent_episodes=2)
    requests = group_requests(tokenizer, prompts_(3), 2)
    _stream(ee, rec, requests, on_done)
    assert len(done) == 6 and all(t.finish_reason == "stop" and t.episode["turns"] == 3 for t in done)
    assert peak[0] == 2 and alive[0] == 0, f"at most 2 episodes alive (saw {peak[0]})"
    assert rec.max_in_flight <= 2


def test_a_slow_environment_step_does_not_delay_other_episodes(model, tokenizer):
    slow_returned: list[float] = []

    class OneSlow(Scripted):
        def step(self, turn_text):
            if self.prompt.uid == "slow" and not self.texts:
                time.sleep(1.5)
                slow_returned.append(time.perf_counter())
            return super().step(turn_text)

    finished: list[tuple[str, float]] = []
    ee, rec, _ = make_engine(model, tokenizer, Factory(OneSlow, turns=3), max_turn_tokens=5)
    requests = group_requests(tokenizer, _named(["slow", "a", "b", "c"]), 1)
    _stream(ee, rec, requests, lambda r, t: finished.append((t.prompt_uid, time.perf_counter())))
    order = [uid for uid, _ in finished]
    assert sorted(order) == ["a", "b", "c", "slow"] and order[-1] == "slow"
    assert all(at < slow_returned[0] for uid, at in finished if uid != "slow"), \
        "the fast episodes finished while the slow step was still running"
    assert ee.env_wait_s >= 1.5


# ---- 8. sampling keys, determinism, order ----------------------------------------------------------
def test_sampling_key_of_turn_zero_is_the_single_turn_key_and_turns_differ():
    p = Prompt("u7", "1+1=", "2")
    keys = [sampling_key(3, GenRequest(p, (1, 2, 3), 4, turn=k)) for k in range(5)]
    assert keys[0] == stable_hash(3, "u7", 4) == sampling_key(3, GenRequest(p, (1,), 4))
    assert len(set(keys)) == 5
    assert sampling_key(3, GenRequest(p, (1,), 5, turn=1)) != keys[1], "the sample index still counts"


def test_first_turn_is_the_single_turn_sample_and_later_turns_have_fresh_noise(model, tokenizer):
    requests = group_requests(tokenizer, prompts_(3), 2)
    single = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=6)).generate(requests)
    ee, rec, _ = make_engine(model, tokenizer, Factory(turns=3), max_turn_tokens=6)
    generate(ee, rec, requests)
    for r, s in zip(requests, single):
        turns = rec.turns[(r.prompt.uid, r.sample_index)]
        assert turns[0][1].token_ids == s.token_ids
        assert turns[0][1].logprobs == pytest.approx(s.logprobs, abs=1e-5)
        assert len({sampling_key(0, req) for req, _ in turns}) == len(turns) == 3


def test_episodes_are_deterministic_and_come_back_in_request_order(model, tokenizer):
    class Varied(Scripted):
        def reset(self, prompt):  # 4 turns down to 1: later requests finish first
            self.turns = 4 - int(prompt.uid[1:]) % 4
            return super().reset(prompt)

    requests = group_requests(tokenizer, prompts_(4), 2, max_new_tokens=5)
    runs = []
    for _ in range(2):
        ee, rec, _ = make_engine(model, tokenizer, Factory(Varied), max_turn_tokens=8)
        runs.append(generate(ee, rec, requests))
        assert all(req.max_new_tokens == 5 for turns in rec.turns.values() for req, _ in turns), \
            "the request's own length cap wins over max_turn_tokens"
    a, b = runs
    assert [(t.prompt_uid, t.sample_index) for t in a] == [(r.prompt.uid, r.sample_index) for r in requests]
    assert [t.episode["turns"] for t in a] == [4 - i // 2 for i in range(8)]
    for x, y in zip(a, b):
        assert (x.token_ids, x.loss_mask, x.versions, x.reward, x.finish_reason) == \
            (y.token_ids, y.loss_mask, y.versions, y.reward, y.finish_reason)
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    finished = []
    ee, rec, _ = make_engine(model, tokenizer, Factory(Varied), max_turn_tokens=8)
    _stream(ee, rec, group_requests(tokenizer, prompts_(4), 2, max_new_tokens=5),
            lambda r, t: finished.append((t.prompt_uid, t.sample_index)))
    assert sorted(finished) == sorted((r.prompt.uid, r.sample_index) for r in requests)
    assert finished != [(r.prompt.uid, r.sample_index) for r in requests], "completion order is not request order"


def test_simulated_latency_delays_steps_but_changes_no_token(model, tokenizer):
    requests = group_requests(tokenizer, prompts_(2), 2)
    ee0, rec0, _ = make_engine(model, tokenizer, Factory(turns=3), max_turn_tokens=5)
    plain = generate(ee0, rec0, requests)
    ee, rec, _ = make_engine(model, tokenizer, Factory(turns=3), max_turn_tokens=5, seed=0,
                             latency_median_s=0.02, latency_sigma=0.5)
    slow = generate(ee, rec, requests)
    for r, x, y in zip(requests, plain, slow):
        assert (x.token_ids, x.loss_mask, x.reward) == (y.token_ids, y.loss_mask, y.reward)
        waits = [simulated_latency(0, r, turn, 0.02, 0.5) for turn in (1, 2, 3)]
        assert all(w > 0 for w in waits) and simulated_latency(0, r, 1, 0.02, 0.5) == waits[0]
        assert y.episode["tool_latency_s"] >= sum(waits)


# ---- 9. episode_metrics ----------------------------------------------------------------------------
def _ep(turns, calls, errors, timeouts, malformed, latency, versions, mask):
    n = len(mask)
    return Trajectory("u", 0, [1], list(range(3, 3 + n)), [-0.1 if m else 0.0 for m in mask], versions, "stop",
                      loss_mask=mask, episode={"turns": turns, "tool_calls": calls, "tool_errors": errors,
                                               "tool_timeouts": timeouts, "malformed": malformed,
                                               "tool_latency_s": latency, "infra_failure": None,
                                               "num_versions": len({v for v in versions if v >= 0})})


def test_episode_metrics_against_hand_computed_values():
    a = _ep(3, 2, 1, 0, 0, 0.5, [0, 0, -1, 1, -1, 1], [1, 1, 0, 1, 0, 1])  # 4 sampled, two versions
    b = _ep(1, 0, 0, 0, 1, 0.1, [2, 2], [1, 1])  # 2 sampled
    c = _ep(4, 3, 0, 2, 0, 1.5, [3, -1, 3, -1, -1, 3, 3], [1, 0, 1, 0, 0, 1, 1])  # 4 sampled
    single = Trajectory("s", 0, [1], [5, 6, 7], [-1.0] * 3, [0] * 3, "stop")  # not an episode: ignored
    m = episode_metrics([a, single, b, c])
    assert m == pytest.approx({
        "agent/turns_mean": (3 + 1 + 4) / 3,
        "agent/turns_max": 4.0,
        "agent/tool_calls_mean": (2 + 0 + 3) / 3,
        "agent/tool_errors": 1.0,
        "agent/tool_timeouts": 2.0,
        "agent/malformed": 1.0,
        "agent/not_append_only": 0.0,
        "agent/tool_latency_s_mean": (0.5 + 0.1 + 1.5) / 8,  # per environment step (= turn)
        "agent/multi_version_frac": 1 / 3,
        "agent/sampled_tokens_mean": (4 + 2 + 4) / 3,
    }, abs=1e-12)
    assert episode_metrics([single]) == {} and episode_metrics([]) == {}
    assert episode_metrics([b])["agent/tool_latency_s_mean"] == pytest.approx(0.1), "one step, no calls"


# ---- per-turn rewards --------------------------------------------------------------------------------
class PerTurnReward:
    """Rewards every step: -0.1 per call (a cost on tool use), 1.0 for the final step."""

    stop: list[str] = []

    def reset(self, prompt):
        self.n = 0

    def step(self, turn_text):
        self.n += 1
        if self.n == 3:
            return EnvStep(None, 1.0, done=True)
        return EnvStep("=1 ", reward=-0.1, info={"tool_call": True})


def test_per_turn_rewards_sum_into_the_episode_return(model, tokenizer):
    ee, rec, _ = make_engine(model, tokenizer, Factory(PerTurnReward))
    trajs = generate(ee, rec, group_requests(tokenizer, prompts_(2), 2))
    for t in trajs:
        assert t.episode["turns"] == 3 and t.reward == pytest.approx(1.0 - 0.1 - 0.1)
        assert t.reward_details["env_reward"] == t.reward


def test_kept_turn_kv_changes_no_token_and_matches_the_trainer(model, tokenizer):
    """The local engine keeps each finished turn's keys and values (``reuse_turn_kv``, on by default),
    so a later turn computes only the observation's tokens: the same tokens as re-reading the whole
    context, log-probs equal within float noise, and equal to the trainer's."""
    prompts = prompts_(4)
    runs = {}
    for reuse in (True, False):
        inner = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=6, reuse_turn_kv=reuse), seed=0)
        rec = _Recording(inner)
        ee = EpisodeEngine(rec, tokenizer, Factory(turns=4, first="go:"), EnvConfig(), context_len=128, seed=0,
                           max_turn_tokens=6)
        runs[reuse] = (generate(ee, rec, group_requests(tokenizer, prompts, 2)), inner)
    (on, engine_on), (off, engine_off) = runs[True], runs[False]
    assert engine_on.num_reused_tokens > 0 and engine_off.num_reused_tokens == 0
    assert engine_on.stats()["rollout/reused_kv_tokens"] == engine_on.num_reused_tokens
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        check_logprobs(model, a)


def test_kept_turns_are_bounded_by_count_and_positions_oldest_out():
    from tidal.rollout.local import _TurnKV, _TurnStore

    store = _TurnStore()
    kv = lambda n: _TurnKV(tuple(range(n)), [], [], 0)  # noqa: E731
    for i in range(3):
        store.put(("p", i), kv(10), max_turns=2, max_tokens=100)
    assert store.take(("p", 0)) is None and store.tokens == 20  # the oldest went first
    store.put(("p", 3), kv(85), max_turns=8, max_tokens=100)  # 20 + 85 > 100: drops the oldest again
    assert store.take(("p", 1)) is None and store.take(("p", 2)) is not None and store.tokens == 85
    store.clear()
    assert not store and store.tokens == 0
