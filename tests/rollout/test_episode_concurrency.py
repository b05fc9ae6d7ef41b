"""Multi-turn episodes: concurrency bounds, sampling keys and determinism, episode metrics, per-turn
rewards (``rollout/episodes.py``)."""

from __future__ import annotations

import time

import pytest

from tidal.api import EnvStep, GenRequest
from tidal.rollout.episodes import episode_metrics, simulated_latency
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests, sampling_key
from tidal.types import Prompt, Trajectory
from tidal.utils.seeding import stable_hash

from .episode_support import (
    Factory,
    Scripted,
    _bounded,
    _named,
    generate,
    make_engine,
    prompts_,
)


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
    """The slow episode's tool call blocks until the other three episodes have finished (30 s at
    most): if a waiting environment held up the engine, they never would. No timing thresholds, so
    a loaded machine cannot fail it."""
    import threading

    others_done = threading.Event()
    slow_saw_others_done: list[bool] = []

    class OneSlow(Scripted):
        def step(self, turn_text):
            if self.prompt.uid == "slow" and not self.texts:
                slow_saw_others_done.append(others_done.wait(timeout=30))
            return super().step(turn_text)

    finished: list[str] = []

    def on_done(request, traj):
        finished.append(traj.prompt_uid)
        if {"a", "b", "c"} <= set(finished):
            others_done.set()

    ee, rec, _ = make_engine(model, tokenizer, Factory(OneSlow, turns=3), max_turn_tokens=5)
    requests = group_requests(tokenizer, _named(["slow", "a", "b", "c"]), 1)
    _stream(ee, rec, requests, on_done)
    assert sorted(finished) == ["a", "b", "c", "slow"] and finished[-1] == "slow"
    assert slow_saw_others_done == [True], "the fast episodes did not finish while the slow step was running"
    assert ee.env_wait_s > 0


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
        "agent/vision_tokens": 0.0,
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
