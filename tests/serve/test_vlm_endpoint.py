"""The OpenAI-compatible endpoint with pictures (``serve/``): ``image_url`` parts with data URLs on a
vision-language model, rendered as the prompt rendering widens them, passed to the engine (``GenRequest.images``),
kept token-exact across a follow-up turn that repeats the conversation; the recorded segment's trainer log-probs
equal the engine's (fp32, CPU). Bad pictures, remote URLs and pictures for a text model are clear 400s."""

from __future__ import annotations

import copy

import openai
import pytest

from tests.vlm_support import BOARD, SEEN, tiny_vlm_policy
from tidal.algo.config import AlgoConfig
from tidal.models import vlm
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.serve.server import HarnessServer, ServeConfig
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import Group, Prompt


@pytest.fixture(scope="module")
def policy():
    return tiny_vlm_policy()


class Recording:
    """The engine as the server's bridge sees it, keeping every request it was handed."""

    def __init__(self, engine):
        self.engine, self.requests = engine, []
        self.cfg = engine.cfg

    @property
    def version(self):
        return self.engine.version

    def stats(self):
        return self.engine.stats()

    def request_weight_update(self, state_dict, version):
        self.engine.request_weight_update(state_dict, version)

    def stream(self, source, on_done, greedy=False):
        def src(n, block):
            got = source(n, block)
            self.requests += got or []
            return got

        self.engine.stream(src, on_done, greedy)


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _server(model, tokenizer):
    engine = Recording(LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=5, dtype="fp32"), seed=0))
    return HarnessServer(engine, tokenizer, 512, ServeConfig()).start(), engine


def _client(server, episode):
    return openai.OpenAI(base_url=server.base_url(episode), api_key="unused", max_retries=0, timeout=60)


def _first_turn(server, tokenizer, messages, sampled_marker: bool):
    """(episode, client, reply) of the first of episodes ep-0, ep-1, ... whose first reply to ``messages`` did (or
    did not) sample a vision marker. The untrained model samples one in about a turn in three, and which episode
    does depends on the machine's float rounding, so the test looks for one rather than naming it."""
    markers = vlm.vision_token_ids(tokenizer)
    for i in range(16):
        c = _client(server, f"ep-{i}")
        reply = c.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        if bool(set(reply.model_extra["tidal"]["token_ids"]) & markers) == sampled_marker:
            return f"ep-{i}", c, reply
    raise AssertionError(f"no episode in 16 {'sampled' if sampled_marker else 'avoided'} a vision marker")


def test_image_url_parts_and_a_follow_up_turn_are_token_exact(policy):
    model, tokenizer, processor = policy
    server, engine = _server(model, tokenizer)
    try:
        messages = [{"role": "user", "content": [_image(BOARD), {"type": "text", "text": "how many squares?"}]}]
        episode, c, first = _first_turn(server, tokenizer, messages, sampled_marker=False)
        ids1 = first.model_extra["tidal"]["token_ids"]
        turn1 = engine.requests[-1]
        assert list(turn1.prompt_ids) == vlm.prompt_ids(processor, "how many squares?", [BOARD])
        assert turn1.images == (BOARD,)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": [{"type": "text", "text": "and now?"}, _image(SEEN)]}]
        second = c.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        assert second.model_extra["tidal"]["segment"] == 0 and not second.model_extra["tidal"]["new_segment"]
        turn2 = engine.requests[-1]
        assert turn2.images == (BOARD, SEEN)  # the first turn's picture, kept, then the new one
        assert list(turn2.prompt_ids[:len(turn1.prompt_ids) + len(ids1)]) == \
            [*turn1.prompt_ids, *ids1]  # continues from the recorded ids
        assert turn2.prompt_ids.count(processor.image_token_id) == 8
        (traj,) = server.finish(episode, 1.0)
    finally:
        server.stop()
    assert traj.images == [BOARD, SEEN] and traj.episode["turns"] == 2
    task = Prompt("task", "how many squares?", "3", {"images": [BOARD]})  # the agent's task: not what it rendered
    batch, _ = build_train_batch([Group(task, [traj])], AlgoConfig(skip_zero_adv_groups=False),
                                 tokenizer.pad_token_id, processor)
    assert batch.images.row_images == [[0, 1]]
    trainer = Trainer(copy.deepcopy(model), AlgoConfig(), OptimConfig(lr=1e-4), TrainerConfig())
    scores = trainer._scores(trainer.model, batch)
    mask = batch.loss_mask_bt.bool()
    assert int(mask.sum()) == traj.num_sampled_tokens
    assert float((scores - batch.behav_logp_bt)[mask].abs().max()) < 1e-5


def test_a_turn_that_sampled_a_vision_marker_is_not_continued(policy):
    """A first turn that sampled a vision marker (``<|image_pad|>`` ...): continuing its ids would put an image token
    with no picture in the next context, so the follow-up is rendered afresh, counted."""
    model, tokenizer, processor = policy
    server, engine = _server(model, tokenizer)
    try:
        messages = [{"role": "user", "content": [_image(BOARD), {"type": "text", "text": "how many squares?"}]}]
        _, c, first = _first_turn(server, tokenizer, messages, sampled_marker=True)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": [_image(SEEN)]}]
        second = c.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        assert second.model_extra["tidal"]["new_segment"] and engine.requests[-1].images == (BOARD, SEEN)
        assert engine.requests[-1].prompt_ids.count(processor.image_token_id) == 8
        assert server.recorder.totals["vision_tokens"] == 1
    finally:
        server.stop()


def test_bad_pictures_are_clear_400s(policy):
    model, tokenizer, _ = policy
    server, _ = _server(model, tokenizer)
    try:
        c = _client(server, "ep-bad")
        for part, says in ((_image("https://example.com/cat.png"), "never downloads"),
                           (_image("data:image/png;base64,aGVsbG8="), "unreadable image"),
                           ({"type": "image_url", "image_url": "data:x"}, "image_url"),
                           ({"type": "input_audio", "input_audio": {}}, "content parts must be")):
            with pytest.raises(openai.BadRequestError, match=says):
                c.chat.completions.create(model="policy", messages=[{"role": "user", "content": [part]}])
        with pytest.raises(openai.BadRequestError, match="assistant message with an image"):
            c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": [_image(BOARD)]}])
    finally:
        server.stop()


def test_a_text_model_refuses_pictures_naming_itself(random_model, chat_tok):
    engine = LocalEngine(random_model, chat_tok, SamplingConfig(max_new_tokens=3), seed=0)
    server = HarnessServer(engine, chat_tok, 512, ServeConfig(model_name="tiny-text")).start()
    try:
        c = _client(server, "ep-text")
        with pytest.raises(openai.BadRequestError, match="'tiny-text' reads text only"):
            c.chat.completions.create(model="tiny-text", messages=[{"role": "user", "content": [_image(BOARD)]}])
        out = c.chat.completions.create(model="tiny-text", messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"}]}])  # text parts: served as before
        assert out.choices[0].message.role == "assistant"
    finally:
        server.stop()
