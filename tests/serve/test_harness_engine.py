"""``HarnessEngine``: a user's agent function as a RolloutEngine, through the real server and ``openai`` client.

No mocks: a tiny model behind a real ``LocalEngine``, a real uvicorn server on loopback, agents written
against the real client. Checked in numbers: failures become infrastructure failures with the right
counts, a weight update reaches the engine behind the server (tokens carry the new version), and the
trainer's log-probs of a harness episode equal the recorded behaviour log-probs token for token.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading

import openai
import pytest
import torch

from tidal.config import ConfigError
from tidal.models import tiny
from tidal.models.logprobs import token_logprobs
from tidal.rewards import build_reward
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.rollout.evaluate import greedy_samples
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.serve.config import HarnessConfig
from tidal.serve.engine import HarnessEngine, as_reward, load_function
from tidal.types import Prompt

TINY = tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64,
                        tokenizer="chat")
RELEASE = threading.Event()
CANCELLED = threading.Event()


def two_turn_agent(client, task):
    """Two chat turns with a tool message between them; reward 1 if the last reply holds a digit."""
    messages = [{"role": "user", "content": task.text}]
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    messages += [reply.model_dump(exclude_none=True), {"role": "tool", "content": "42"}]
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    return float(any(c.isdigit() for c in reply.content or ""))


async def async_two_turn_agent(client, task):
    """``two_turn_agent`` as an asyncio agent: an ``openai.AsyncOpenAI`` client, awaited calls."""
    assert isinstance(client, openai.AsyncOpenAI)
    messages = [{"role": "user", "content": task.text}]
    reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
    messages += [reply.model_dump(exclude_none=True), {"role": "tool", "content": "42"}]
    reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
    if task.meta.get("kind") == "hang":
        CANCELLED.clear()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            CANCELLED.set()
            raise
    if task.meta.get("kind") == "crash":
        raise RuntimeError("the async agent's own bug")
    return float(any(c.isdigit() for c in reply.content or ""))


REPLIES: dict[str, str] = {}


def talking_agent(client, task):
    """An agent with no grading code: it asks once and returns nothing (``harness.reward=task``)."""
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.text}])
    REPLIES[task.text] = reply.choices[0].message.content or ""


def misbehaving_agent(client, task):
    """Behaves according to the task: crash, hang, return a string, call nothing, or work."""
    kind = task.meta["kind"]
    if kind == "silent":
        return 1.0
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.text}])
    if kind == "crash":
        raise RuntimeError("the agent's own bug")
    if kind == "hang":
        RELEASE.wait(30)
    if kind == "string":
        return "yes"
    return 1.0


@pytest.fixture(scope="module")
def chat_model():
    tok = tiny.build_chat_tokenizer()
    return tiny.build_model(TINY, tok).eval(), tok


def harness(model, tok, agent, **cfg) -> HarnessEngine:
    engine = LocalEngine(model, tok, SamplingConfig(max_new_tokens=8), seed=0)
    return HarnessEngine(engine, tok, agent, HarnessConfig(**cfg), context_len=128, max_tokens=8)


def test_failures_are_infra_failures_counted_by_kind(chat_model):
    model, tok = chat_model
    kinds = ["ok", "crash", "hang", "string", "silent", "ok"]
    prompts = [Prompt(f"p{i}", "1*2=", "2", meta={"kind": k}) for i, k in enumerate(kinds)]
    engine = harness(model, tok, misbehaving_agent, episode_timeout_s=3.0)
    try:
        trajs = engine.generate(group_requests(tok, prompts, 1))
        RELEASE.set()
        stats = engine.stats()
    finally:
        engine.close()
    failed = {p.meta["kind"]: t.episode["infra_failure"] for p, t in zip(prompts, trajs) if t.infra_failed}
    assert set(failed) == {"crash", "hang", "string", "silent"}
    assert "the agent's own bug" in failed["crash"] and "must return the episode's reward" in failed["string"]
    assert failed["hang"] == "hung" and "no completion" in failed["silent"]
    assert {k: stats[f"harness/{k}"] for k in ("started", "finished", "crashed", "hung", "no_completion")} == {
        "started": 6, "finished": 2, "crashed": 2, "hung": 1, "no_completion": 1}
    ok = [t for p, t in zip(prompts, trajs) if p.meta["kind"] == "ok"]
    assert all(t.reward == 1.0 and t.num_sampled_tokens > 0 and t.prompt_uid.startswith("p") for t in ok)


def test_weight_update_reaches_the_engine_and_trainer_logprobs_match(chat_model):
    model, tok = chat_model
    engine = harness(model, tok, two_turn_agent)
    prompts = [Prompt(f"q{i}", f"{i}*3=", str(3 * i)) for i in range(4)]
    try:
        before = engine.generate(group_requests(tok, prompts, 2))
        new_weights = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
        engine.request_weight_update(new_weights, version=1)
        after = engine.generate(group_requests(tok, prompts, 2))
    finally:
        engine.close()
    assert [(t.prompt_uid, t.sample_index) for t in after] == [(p.uid, j) for p in prompts for j in range(2)]
    for trajs, version in ((before, 0), (after, 1)):
        for t in trajs:
            assert not t.infra_failed and t.episode["turns"] == 2
            sampled = [v for v, m in zip(t.versions, t.loss_mask) if m]
            assert sampled and set(sampled) == {version}
    # the trainer's log-probs under the new weights equal the recorded ones, token for token
    trainer_model = copy.deepcopy(model)
    trainer_model.load_state_dict(new_weights)
    t = after[0]
    ids = torch.tensor([t.prompt_ids + t.token_ids])
    with torch.no_grad():
        logp, _ = token_logprobs(trainer_model, ids, torch.ones_like(ids))
    mask = torch.tensor(t.loss_mask, dtype=torch.bool)
    assert (~mask).any(), "the tool message must be in the episode as observation tokens"
    diff = (logp[0, len(t.prompt_ids):][mask] - torch.tensor(t.logprobs)[mask]).abs().max().item()
    assert diff < 1e-4, diff


def test_held_out_tasks_repeat_with_fresh_episode_ids(chat_model):
    model, tok = chat_model
    engine = harness(model, tok, two_turn_agent)
    prompts = [Prompt("eval-0", "2*2=", "4")]
    try:
        first = engine.generate(group_requests(tok, prompts, 1), greedy=True)
        second = engine.generate(group_requests(tok, prompts, 1), greedy=True)
    finally:
        engine.close()
    assert first[0].episode["episode_id"] != second[0].episode["episode_id"]
    assert first[0].token_ids == second[0].token_ids, "greedy evaluation must be deterministic"


def test_load_function_errors_name_the_key(tmp_path):
    assert load_function("tests.serve.test_harness_engine:two_turn_agent") is two_turn_agent
    (tmp_path / "agent.py").write_text("def run_episode(client, task):\n    return 1.0\n\ndef one(x):\n    return x\n")
    assert load_function(f"{tmp_path}/agent.py:run_episode")(None, None) == 1.0
    (tmp_path / "broken.py").write_text("import no_such_module_anywhere\n")
    for spec, match in [("agent.py", "must be 'path/to/file.py:function'"),
                        (f"{tmp_path}/missing.py:run_episode", "no file"),
                        (f"{tmp_path}/agent.py:nope", "has no function 'nope'.*run_episode"),
                        (f"{tmp_path}/agent.py:one", r"cannot be called as one\(client, task\)"),
                        (f"{tmp_path}/broken.py:run_episode", "importing .*broken.py raised ModuleNotFoundError"),
                        ("no_such_pkg.mod:run_episode", "cannot import module 'no_such_pkg.mod'")]:
        with pytest.raises(ConfigError, match=match):
            load_function(spec)
    assert as_reward(True) == 1.0 and as_reward(3) == 3.0
    for bad in ("1", None, float("nan")):
        with pytest.raises(TypeError):
            as_reward(bad)


def test_closed_episode_ids_are_remembered_up_to_a_bound(chat_model):
    from tidal.serve.recorder import EpisodeClosed, EpisodeRecorder

    _, tok = chat_model
    recorder = EpisodeRecorder(tok, 128, 8, max_closed_ids=2)
    for episode_id in ("a", "b", "c"):
        recorder.open(episode_id)
        recorder.drop(episode_id) if episode_id == "b" else recorder.finish(episode_id, 1.0)
    assert list(recorder.closed_ids) == ["b", "c"] and not recorder.known("a") and recorder.known("c")
    with pytest.raises(EpisodeClosed, match="'c' was finished"):
        recorder.open("c")  # remembered: a late request gets 409 episode_closed
    fresh = recorder.open("a")  # forgotten: opened again as a new, empty episode
    assert fresh.segments == [] and recorder.totals["episodes"] == 4


def test_async_agents_run_on_one_loop_and_train_exactly(chat_model):
    """``async def run_episode``: AsyncOpenAI client, episodes as tasks; a hung one is cancelled (the
    coroutine sees CancelledError), a crashing one is counted; healthy ones equal the trainer's log-probs."""
    model, tok = chat_model
    kinds = ["ok", "hang", "crash", "ok"]
    prompts = [Prompt(f"a{i}", f"{i}*3=", str(3 * i), meta={"kind": k}) for i, k in enumerate(kinds)]
    engine = harness(model, tok, async_two_turn_agent, episode_timeout_s=3.0)
    assert engine.is_async
    try:
        trajs = engine.generate(group_requests(tok, prompts, 1))
        stats = engine.stats()
        threads = [t.name for t in threading.enumerate()]
    finally:
        engine.close()
    failed = {p.meta["kind"]: t.episode["infra_failure"] for p, t in zip(prompts, trajs) if t.infra_failed}
    assert set(failed) == {"hang", "crash"} and "the async agent's own bug" in failed["crash"]
    assert CANCELLED.wait(5), "the hung agent's task must be cancelled, not abandoned"
    assert stats["harness/hung"] == 1 and stats["harness/crashed"] == 1 and stats["harness/finished"] == 2
    assert not any(n.startswith("tidal-agent-") for n in threads), "async agents need no thread each"
    t = trajs[0]
    ids = torch.tensor([t.prompt_ids + t.token_ids])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    mask = torch.tensor(t.loss_mask, dtype=torch.bool)
    assert t.episode["turns"] == 2 and (~mask).any()
    assert (logp[0, len(t.prompt_ids):][mask] - torch.tensor(t.logprobs)[mask]).abs().max().item() < 1e-4


def test_task_reward_scores_the_final_answer(chat_model):
    """``harness.reward=task``: the agent returns None; the run's reward pool scores the content of the
    last reply the agent got, exactly as it scores a single-turn sample's text."""
    model, tok = chat_model
    prompts = [Prompt(f"t{i}", f"{i}*3=", str(3 * i)) for i in range(3)]
    pool = RewardPool(build_reward("exact_match", {}), RewardConfig(num_workers=0))
    engine = harness(model, tok, talking_agent, reward="task")
    try:
        trajs = greedy_samples(engine, tok, prompts, pool)
    finally:
        engine.close()
    for t, p in zip(trajs, prompts):
        assert not t.infra_failed and t.score_text == t.episode["final_answer"] == REPLIES[p.text]
        assert (t.reward, t.reward_details) == pool.score([(t.score_text, p)])[0]
        assert "harness_reward" not in t.reward_details, "scored by the pool, not by the agent"
    right = dataclasses.replace(trajs[0], episode={**trajs[0].episode, "final_answer": prompts[0].answer})
    assert pool.score([(right.score_text, prompts[0])])[0][0] == 1.0, "the right answer scores 1"
    # by default the agent rewards: returning None is its failure, counted
    engine = harness(model, tok, talking_agent)
    try:
        failed = engine.generate(group_requests(tok, prompts, 1))
    finally:
        engine.close()
    assert all(t.infra_failed and "must return the episode's reward" in t.episode["infra_failure"] for t in failed)
