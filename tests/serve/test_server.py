"""The OpenAI-compatible endpoint (``tidal/serve``) driven by the real ``openai`` client over loopback.

No mocks: a real uvicorn server around a real ``LocalEngine`` on a tiny model. The recorded episode
is checked in numbers: its token ids are exactly the prompt's, the sampled turns' and the added
messages' ids (never a re-tokenization), and the trainer's log-probs (``token_logprobs`` on the whole
sequence) equal the behaviour log-probs the engine recorded, token for token.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest
import torch

from tidal.models.logprobs import token_logprobs
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.serve.server import HarnessServer, ServeConfig, resolve_api_key

from .conftest import QUESTION, TOOL_CALL

CONTEXT = 512


def serve(model, tok, max_new_tokens=12, **cfg):
    engine = LocalEngine(model, tok, SamplingConfig(max_new_tokens=max_new_tokens), seed=0)
    return HarnessServer(engine, tok, CONTEXT, ServeConfig(**cfg)).start()


def client(server, episode, key="unused", cls=openai.OpenAI):
    return cls(base_url=server.base_url(episode), api_key=key, max_retries=0, timeout=60)


def tidal_extra(resp) -> dict:
    return resp.model_extra["tidal"]


def check_logprobs(model, traj, atol=1e-4):
    """Sampled tokens: trainer log-probs equal the engine's; observation tokens: 0.0 and version -1."""
    ids = torch.tensor([traj.prompt_ids + traj.token_ids])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    engine = torch.tensor(traj.logprobs)
    assert mask.any() and (~mask).any()
    diff = (logp[0, len(traj.prompt_ids):][mask] - engine[mask]).abs().max().item()
    assert diff < atol, f"trainer vs engine log-probs differ by {diff}"
    assert (engine[~mask] == 0.0).all() and (torch.tensor(traj.versions)[~mask] == -1).all()


def test_multi_turn_episode_is_token_exact_and_trainer_logprobs_match(random_model, chat_tok):
    server = serve(random_model, chat_tok)
    try:
        c = client(server, "ep-0")
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 7*6?"}]
        sampled = []
        for follow_up in ({"role": "tool", "content": "42", "tool_call_id": "x"}, {"role": "user", "content": "ok?"}):
            resp = c.chat.completions.create(model="policy", messages=messages, max_tokens=12)
            extra = tidal_extra(resp)
            assert extra["segment"] == 0 and resp.usage.completion_tokens == len(extra["token_ids"])
            sampled.append(extra["token_ids"])
            messages += [resp.choices[0].message.model_dump(exclude_none=True), follow_up]
        resp = c.chat.completions.create(model="policy", messages=messages, max_tokens=12)
        sampled.append(tidal_extra(resp)["token_ids"])
        [traj] = server.finish("ep-0", reward=1.0)
    finally:
        server.stop()
    assert traj.reward == 1.0 and traj.episode["turns"] == 3 and traj.episode["history_edits"] == 0
    # the sampled runs, in order, are exactly the tokens the three responses reported
    runs, cur = [], []
    for tok, m in zip(traj.token_ids, traj.loss_mask):
        if m:
            cur.append(tok)
        elif cur:
            runs, cur = runs + [cur], []
    assert runs + [cur] == sampled
    # the prompt is the template's rendering of the first two messages; nothing was re-rendered after it
    first = chat_tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert traj.prompt_ids == chat_tok(first, add_special_tokens=False).input_ids
    check_logprobs(random_model, traj)


def check_calculator_episode(tool_model, chat_tok, traj):
    """The recorded ``2+3`` episode: the call, the tool's ``5`` as observation tokens, the answer ``5``."""
    assert traj.episode["tool_calls"] == 1 and traj.episode["turns"] == 2
    text = chat_tok.decode(traj.token_ids)
    assert text == f"{TOOL_CALL}<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n5<|im_end|>"
    check_logprobs(tool_model, traj)


def test_tool_call_round_trip(tool_model, chat_tok):
    server = serve(tool_model, chat_tok, max_new_tokens=96)
    tools = [{"type": "function", "function": {"name": "calculator", "description": "evaluates arithmetic",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}}}}]
    try:
        c = client(server, "calc-1")
        messages = [{"role": "user", "content": QUESTION}]
        resp = c.chat.completions.create(model="policy", messages=messages, tools=tools)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "calculator"
        expression = json.loads(call.function.arguments)["expression"]
        assert expression == "2+3"
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": str(eval(expression))}]
        resp = c.chat.completions.create(model="policy", messages=messages, tools=tools)
        assert resp.choices[0].message.content == "5" and resp.choices[0].finish_reason == "stop"
        assert not tidal_extra(resp)["new_segment"]
        [traj] = server.finish("calc-1", reward=1.0)
    finally:
        server.stop()
    check_calculator_episode(tool_model, chat_tok, traj)


def assemble(stream) -> tuple[dict, str, dict, list]:
    """An assistant message from a chat stream, as a streaming agent builds it: (message, finish
    reason, the last chunk's ``tidal`` extra, the usage chunks)."""
    content, calls, finish, extra, usage = "", {}, None, None, []
    for chunk in stream:
        if chunk.usage is not None and not chunk.choices:
            usage.append(chunk.usage)
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls[call.index] = {"id": call.id, "type": "function",
                                 "function": {"name": call.function.name, "arguments": call.function.arguments}}
        finish = chunk.choices[0].finish_reason or finish
        extra = (chunk.model_extra or {}).get("tidal", extra)
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, extra, usage


def test_streamed_tool_call_round_trip_is_the_same_episode(tool_model, chat_tok):
    """``stream=true``: server-sent chunks that assemble into the same messages, and the same recorded
    episode, as the non-streaming round trip (the turn is streamed once complete)."""
    server = serve(tool_model, chat_tok, max_new_tokens=96)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    try:
        c = client(server, "calc-stream")
        messages = [{"role": "user", "content": QUESTION}]
        message, finish, extra, usage = assemble(c.chat.completions.create(
            model="policy", messages=messages, tools=tools, stream=True, stream_options={"include_usage": True}))
        assert finish == "tool_calls" and message["content"] is None and len(usage) == 1
        [call] = message["tool_calls"]
        assert json.loads(call["function"]["arguments"])["expression"] == "2+3"
        assert usage[0].completion_tokens == len(extra["token_ids"])
        messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
        message, finish, extra, usage = assemble(c.chat.completions.create(model="policy", messages=messages,
                                                                            tools=tools, stream=True))
        assert (message["content"], finish, usage) == ("5", "stop", []) and not extra["new_segment"]
        [traj] = server.finish("calc-stream", reward=1.0)
        streamed = list(client(server, "text-stream").completions.create(model="policy", prompt="1+1=", max_tokens=3,
                                                                          stream=True))
    finally:
        server.stop()
    check_calculator_episode(tool_model, chat_tok, traj)
    ids = streamed[-1].model_extra["tidal"]["token_ids"]
    assert "".join(ch.choices[0].text for ch in streamed) == chat_tok.decode(ids, skip_special_tokens=True)
    assert [ch.choices[0].finish_reason for ch in streamed] == [None, "length" if len(ids) == 3 else "stop"]


def test_edited_history_starts_a_counted_segment(random_model, chat_tok):
    server = serve(random_model, chat_tok)
    try:
        c = client(server, "ep-edit")
        messages = [{"role": "user", "content": "hi"}]
        resp = c.chat.completions.create(model="policy", messages=messages)
        edited = messages + [{"role": "assistant", "content": resp.choices[0].message.content + " (edited)"},
                             {"role": "user", "content": "again"}]
        resp2 = c.chat.completions.create(model="policy", messages=edited)
        assert tidal_extra(resp2)["new_segment"] and tidal_extra(resp2)["segment"] == 1
        assert server.stats()["harness/history_edits"] == 1
        trajs = server.finish("ep-edit", reward=0.5)
    finally:
        server.stop()
    assert [t.sample_index for t in trajs] == [0, 1] and all(t.reward == 0.5 for t in trajs)
    # the edited conversation is the new segment's prompt (re-rendered, masked out by being the prompt)
    assert all(sum(t.loss_mask) == len(t.token_ids) for t in trajs)


def test_completions_continue_from_recorded_ids(random_model, chat_tok):
    server = serve(random_model, chat_tok, max_new_tokens=6)
    try:
        c = client(server, "ep-cmpl")
        first = c.completions.create(model="policy", prompt="12+34")
        second = c.completions.create(model="policy", prompt="12+34" + first.choices[0].text + "=")
        assert not tidal_extra(second)["new_segment"]
        [traj] = server.finish("ep-cmpl", reward=0.0)
    finally:
        server.stop()
    ids1, ids2 = tidal_extra(first)["token_ids"], tidal_extra(second)["token_ids"]
    assert traj.token_ids == ids1 + chat_tok("=", add_special_tokens=False).input_ids + ids2
    assert traj.loss_mask == [1] * len(ids1) + [0] + [1] * len(ids2)
    check_logprobs(random_model, traj)


def test_concurrent_episodes_share_the_engine_and_sample_what_they_would_alone(random_model, chat_tok):
    episodes = [f"par-{i}" for i in range(6)]

    async def agent(server, episode):
        c = client(server, episode, cls=openai.AsyncOpenAI)
        messages = [{"role": "user", "content": f"task {episode}"}]
        for _ in range(2):
            resp = await c.chat.completions.create(model="policy", messages=messages, max_tokens=16)
            messages += [resp.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "content": "=1"}]
        await c.close()

    def run(parallel: bool):
        server = serve(random_model, chat_tok, max_new_tokens=16)
        try:
            async def main():
                if parallel:
                    await asyncio.gather(*(agent(server, e) for e in episodes))
                else:
                    for e in episodes:
                        await agent(server, e)
            asyncio.run(main())
            return {e: server.finish(e, 1.0)[0] for e in episodes}, server.bridge.max_in_flight
        finally:
            server.stop()

    together, max_in_flight = run(parallel=True)
    alone, _ = run(parallel=False)
    assert max_in_flight > 1, "concurrent episodes never shared a batch"
    for e in episodes:
        assert together[e].token_ids == alone[e].token_ids
        assert together[e].loss_mask == alone[e].loss_mask
        assert torch.allclose(torch.tensor(together[e].logprobs), torch.tensor(alone[e].logprobs), atol=1e-4)
        check_logprobs(random_model, together[e])


def test_bad_requests_get_openai_error_bodies(random_model, chat_tok):
    server = serve(random_model, chat_tok)
    try:
        c = client(server, "ep-bad")
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="policy", messages=[{"role": "wizard", "content": "hi"}])
        assert e.value.status_code == 400 and "messages.0.role" in e.value.message
        assert e.value.body["param"] == "messages.0.role" and e.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError, match="temperature must be the engine's"):
            c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], temperature=0.2)
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], n=2)
        with pytest.raises(openai.BadRequestError, match="context"):
            c.completions.create(model="policy", prompt="x" * (CONTEXT + 5))
        with pytest.raises(openai.NotFoundError):  # no episode in the path
            openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="k", max_retries=0).completions.create(
                model="policy", prompt="hi")
    finally:
        server.stop()


def test_auth_is_required_when_a_key_is_set_and_generated_beyond_loopback(random_model, chat_tok):
    assert resolve_api_key("127.0.0.1", None) is None
    generated = resolve_api_key("0.0.0.0", None)
    assert generated and generated != resolve_api_key("0.0.0.0", None)
    server = serve(random_model, chat_tok, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            client(server, "ep-auth", key="wrong").completions.create(model="policy", prompt="1+1")
        assert e.value.body["code"] == "invalid_api_key"
        ok = client(server, "ep-auth", key="s3cret").completions.create(model="policy", prompt="1+1")
        assert ok.choices[0].text is not None
    finally:
        server.stop()


def test_request_size_and_episode_limits(random_model, chat_tok):
    server = serve(random_model, chat_tok, max_request_bytes=2000, max_episodes=1)
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client(server, "a").completions.create(model="policy", prompt="1" * 5000)
        assert e.value.status_code == 413 and "max_request_bytes" in e.value.message
        client(server, "a").completions.create(model="policy", prompt="1+1")
        with pytest.raises(openai.RateLimitError, match="max_episodes=1"):
            client(server, "b").completions.create(model="policy", prompt="1+1")
        server.finish("a", 0.0)
        client(server, "b").completions.create(model="policy", prompt="1+1")
    finally:
        server.stop()


def test_an_idle_episode_times_out_and_is_counted(random_model, chat_tok):
    server = serve(random_model, chat_tok, episode_timeout_s=0.3)
    try:
        client(server, "hung").completions.create(model="policy", prompt="1+1")

        time.sleep(0.5)
        client(server, "fresh").completions.create(model="policy", prompt="1+1")
        assert server.stats()["harness/timed_out"] == 1
        with pytest.raises(KeyError, match="hung"):
            server.finish("hung", 1.0)
    finally:
        server.stop()


def test_run_episodes_groups_healthy_episodes_and_counts_crashed_and_hung(random_model, chat_tok):
    from tidal.serve.harness import run_episodes
    from tidal.types import Prompt

    release = threading.Event()

    def agent(client, task):  # written only against the openai client
        messages = [{"role": "user", "content": task.text}]
        resp = client.chat.completions.create(model="policy", messages=messages)
        if task.uid == "crash":
            raise RuntimeError("the agent's own bug")
        if task.uid == "hang":
            release.wait(30)
        messages += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "=3"}]
        resp = client.chat.completions.create(model="policy", messages=messages)
        return 1.0 if "3" in (resp.choices[0].message.content or "") else 0.0

    server = serve(random_model, chat_tok)
    try:
        tasks = [Prompt("ok", "1+2", "3"), Prompt("crash", "2+2", "4"), Prompt("hang", "3+3", "6")]
        report = run_episodes(server, agent, tasks, group_size=3, max_concurrent=9, episode_timeout_s=5)
        release.set()
        assert report.counts == {"finished": 3, "crashed": 3, "hung": 3}
        assert len(report.errors) == 3 and "the agent's own bug" in report.errors[0]
        [group] = report.groups
        assert group.prompt.uid == "ok" and [t.sample_index for t in group.trajectories] == [0, 1, 2]
        assert len({tuple(t.token_ids) for t in group.trajectories}) > 1, "a group's episodes sampled alike"
        for t in group.trajectories:
            assert t.prompt_uid == "ok" and t.episode["turns"] == 2
            check_logprobs(random_model, t)
        assert server.stats()["harness/dropped"] == 6 and not server.recorder.episodes
    finally:
        server.stop()


def test_an_idle_keep_alive_connection_outlives_the_clients_pool_expiry(random_model, chat_tok):
    """An agent's pooled connection idle for 6 s (a step's wait) is still open: the server keeps idle
    connections longer than the client's pool does (httpx drops them after 5 s), so a request never goes
    out on a connection the server is closing at the same moment (uvicorn's default is also 5 s: that
    race showed as ``APIConnectionError`` crashes in harness_quickstart runs)."""
    import http.client

    server = serve(random_model, chat_tok)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        for pause in (0.0, 6.0):
            time.sleep(pause)
            conn.request("GET", "/v1/models")
            resp = conn.getresponse()
            assert resp.status == 200 and json.loads(resp.read())["data"]
        conn.close()
    finally:
        server.stop()
