"""Agent turns with pictures reuse the kept keys and values of the turn before (``rollout/local.py``
``_prefill_after``, ``rollout/vision.py`` ``EngineImages.window_inputs``): the same tokens and log-probs as
prefilling every turn whole (fp32, CPU), log-probs equal to the trainer's, and a window that recomputes kept
tokens, image tokens among them, places the right features at the right M-RoPE positions."""

from __future__ import annotations

import copy

import pytest

from tests.vlm_support import BOARD, SEEN, ShowPictures, tiny_vlm_policy
from tidal.algo.config import AlgoConfig
from tidal.api import GenRequest
from tidal.envs.config import EnvConfig
from tidal.models import vlm
from tidal.optim import OptimConfig
from tidal.rollout.episodes import EpisodeEngine
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import Group, Prompt

from .episode_support import _Recording, generate


@pytest.fixture(scope="module")
def policy():
    return tiny_vlm_policy()


class LookTwice(ShowPictures):
    """Answers the first two turns with a picture each (``SEEN``, then ``BOARD``), ends at the third."""

    pictures = (SEEN, BOARD)


def _episodes(model, tokenizer, prompts, reuse, seed, samples=2):
    inner = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=4, dtype="fp32", reuse_turn_kv=reuse),
                        seed=seed)
    rec = _Recording(inner)
    ee = EpisodeEngine(rec, tokenizer, LookTwice, EnvConfig(renderer="chat", max_turns=4), context_len=512,
                       max_turn_tokens=4)
    return generate(ee, rec, group_requests(tokenizer, prompts, samples)), inner


def test_three_turn_image_episode_with_kept_turns_equals_whole_prefills_and_the_trainer(policy):
    model, tokenizer, processor = policy
    prompts = [Prompt("p0", "how many squares?", "3", {"images": [BOARD]}),
               Prompt("p1", "how many squares?", "2", {"images": [SEEN]})]
    # the first seed whose episodes all draw no vision marker and run their three turns (which seed depends on
    # the machine's float rounding: look for one, never name it)
    for seed in range(24):
        off, _ = _episodes(model, tokenizer, prompts, False, seed)
        if all(t.finish_reason != "vision_token" and t.episode["turns"] == 3 for t in off):
            break
    on, engine = _episodes(model, tokenizer, prompts, True, seed)
    assert engine.stats()["rollout/reused_kv_tokens"] > 0
    for a, b in zip(on, off):
        assert (a.prompt_uid, a.sample_index) == (b.prompt_uid, b.sample_index)
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.images == b.images
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        assert a.images == [a.images[0], SEEN, BOARD] and a.reward == 1.0
    groups = [Group(p, [t for t in on if t.prompt_uid == p.uid]) for p in prompts]
    batch, _ = build_train_batch(groups, AlgoConfig(skip_zero_adv_groups=False), tokenizer.pad_token_id, processor)
    trainer = Trainer(copy.deepcopy(model), AlgoConfig(), OptimConfig(lr=1e-4), TrainerConfig())
    scores = trainer._scores(trainer.model, batch)
    mask = batch.loss_mask_bt.bool()
    assert int(mask.sum()) == sum(t.num_sampled_tokens for t in on)
    assert float((scores - batch.behav_logp_bt)[mask].abs().max()) < 1e-5


def test_a_window_that_recomputes_kept_image_tokens_places_their_features(policy):
    """Two turns joined in one window whose new parts differ by more than the shorter row's kept text: that row
    recomputes kept tokens back into its prompt's picture (the window starts inside it), whose remaining features
    and positions the window must place, next to a row whose window holds a new picture."""
    model, tokenizer, processor = policy
    pad = processor.image_token_id
    prompts = [Prompt("p0", "how many squares?", "3", {"images": [BOARD]}),
               Prompt("p1", "how many squares?", "2", {"images": [SEEN]})]
    firsts = [GenRequest(p, tuple(vlm.prompt_ids(processor, p.text, p.images)), 0, episode=True) for p in prompts]
    short = list(tokenizer("ok", add_special_tokens=False).input_ids)
    long = vlm.prompt_ids(processor, "the board, again:", [BOARD])  # as long as the window must be to split a picture

    def run(reuse, seed):
        engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=4, dtype="fp32", reuse_turn_kv=reuse),
                             seed=seed)
        turn1 = engine.generate(firsts)
        seconds = [GenRequest(r.prompt, (*r.prompt_ids, *t.token_ids, *obs), 0, turn=1, episode=True, images=images)
                   for r, t, obs, images in zip(firsts, turn1, [short, long],
                                                [None, (*prompts[1].images, BOARD)])]
        return engine, turn1, seconds, engine.generate(seconds)

    for seed in range(24):  # turns that run to the length cap (kept) and sample no image token
        _, turn1, _, _ = run(False, seed)
        if all(t.finish_reason == "length" and pad not in t.token_ids for t in turn1):
            break
    off_engine, off1, seconds, off2 = run(False, seed)
    engine, on1, _, on2 = run(True, seed)
    assert [t.token_ids for t in on1] == [t.token_ids for t in off1]
    # the window: the longer new part; the first row recomputes its kept tokens back into its prompt's picture
    kept = [len(r.prompt_ids) + len(t.token_ids) - 1 for r, t in zip(firsts, on1)]
    window = max(len(s.prompt_ids) - k for s, k in zip(seconds, kept))
    start = len(seconds[0].prompt_ids) - window
    assert 0 < start and pad in seconds[0].prompt_ids[start:kept[0]]
    assert seconds[0].prompt_ids[start - 1] == seconds[0].prompt_ids[start] == pad  # a picture split by the window
    assert engine.num_reused_tokens == sum(len(s.prompt_ids) - window for s in seconds)  # one window, both rows
    assert off_engine.num_reused_tokens == 0
    for a, b in zip(on2, off2):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
