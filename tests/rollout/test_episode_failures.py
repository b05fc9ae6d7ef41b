"""Multi-turn episodes when environments fail, time out or run out of budget (``rollout/episodes.py``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tidal.api import EnvStep
from tidal.rollout.requests import group_requests

from .episode_support import (
    DEFAULT_TIMEOUT_OBS,
    Factory,
    Scripted,
    _bounded,
    _named,
    check_token_exact,
    default_obs,
    generate,
    make_engine,
    prompts_,
)


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
