"""Agent episodes with pictures (``rollout/episodes.py``, ``rollout/render.py``, ``envs/zoom.py``): an observation
of content parts with an image is widened to its image tokens exactly as a prompt's is, every later turn's request
carries all the episode's pictures in token order, the trajectory carries them to the trainer, whose log-probs equal
the engine's (fp32, CPU), and a turn that samples a vision marker ends its episode, counted."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.vlm_support import BOARD, SEEN, ShowPictures, tiny_vlm_policy
from tidal.algo.config import AlgoConfig
from tidal.api import EnvStep, GenRequest
from tidal.config import ConfigError
from tidal.envs import ENVS
from tidal.envs.config import EnvConfig
from tidal.envs.zoom import zoom_quadrant
from tidal.models import vlm
from tidal.optim import OptimConfig
from tidal.rollout.episodes import EpisodeEngine
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.render import ChatRenderer, PlainRenderer
from tidal.rollout.requests import group_requests
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import Group, Prompt, Trajectory
from tidal.utils.images import load_image, to_data_url

from .episode_support import _Recording, generate


@pytest.fixture(scope="module")
def policy():
    return tiny_vlm_policy()


class Look(ShowPictures):
    """Answers the first turn with a picture (``SEEN``) whatever the text, ends at the second."""


class Scripted:
    """An inner engine whose turns are given token ids (the turn's index picks them), log-prob -1 each."""

    version = 0

    def __init__(self, turns):
        self.turns, self.requests = turns, []

    def stats(self):
        return {}

    def request_weight_update(self, state_dict, version):
        pass

    def stream(self, source, on_done, greedy=False):
        while (got := source(1, True)) is not None:
            for r in got:
                self.requests.append(r)
                ids = self.turns[r.turn]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                on_done(r, Trajectory(r.prompt.uid, r.sample_index, list(r.prompt_ids), ids, [-1.0] * len(ids),
                                      [0] * len(ids), "stop", text=text))


def _scripted(tokenizer, turns, env, **cfg):
    inner = Scripted([list(tokenizer(t, add_special_tokens=False).input_ids) if isinstance(t, str) else t
                      for t in turns])
    inner.tokenizer = tokenizer
    return EpisodeEngine(inner, tokenizer, env, EnvConfig(renderer="chat", **cfg), context_len=256), inner


def test_chat_renderer_places_pictures_as_the_prompt_rendering_does(policy):
    _, tokenizer, processor = policy
    renderer = ChatRenderer(tokenizer)
    prompt = Prompt("p", "how many squares?", "3", {"images": [BOARD]})
    ids, first, state = renderer.start(prompt, None)
    assert ids == vlm.prompt_ids(processor, prompt.text, [BOARD]) and first == [] and state.images == [BOARD]
    turn = list(tokenizer("<zoom>1</zoom>", add_special_tokens=False).input_ids)
    obs = [{"type": "text", "text": "zoom 1:"}, {"type": "image_url", "image_url": {"url": SEEN}}]
    added = renderer.observation_ids(state, "<zoom>1</zoom>", turn, obs)
    messages = [*vlm.user_message(prompt.text, 1), {"role": "assistant", "content": "<zoom>1</zoom>"},
                {"role": "tool", "content": obs}]
    whole = vlm.encode_messages(processor, messages, [BOARD])["input_ids"][0].tolist()
    assert ids + turn + added == whole  # the processor's own widening of the whole conversation
    assert added.count(processor.image_token_id) == 4 and state.images == [BOARD, SEEN]
    # a text observation on a text prompt is rendered as before: a string tool message
    text_state = renderer.start(Prompt("t", "hi", "1"), None)[2]
    assert renderer.observation_ids(text_state, "x", [], [{"type": "text", "text": "=2"}]) == \
        renderer.observation_ids(renderer.start(Prompt("t", "hi", "1"), None)[2], "x", [], "=2")
    with pytest.raises(ConfigError, match="env.renderer=plain"):
        PlainRenderer(tokenizer).start(prompt, None)
    with pytest.raises(ConfigError, match="env.renderer=chat"):
        PlainRenderer(tokenizer).observation_ids(state, "x", [], obs)


@pytest.mark.parametrize("layout", [TrainerConfig(), TrainerConfig(packing=True), TrainerConfig(share_prefixes=True)],
                         ids=["padded", "packed", "trie"])
def test_two_turn_episode_keeps_the_first_pictures_and_logprobs_match_the_trainer(policy, layout):
    model, tokenizer, processor = policy
    prompt = Prompt("p0", "how many squares?", "3", {"images": [BOARD]})
    # the first engine seed whose two episodes draw no vision marker (the untrained model samples one in about a
    # turn in three, and which seed does depends on the machine's float rounding: look for one, never name it)
    for seed in range(16):
        inner = _Recording(LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=4, dtype="fp32"), seed=seed))
        ee = EpisodeEngine(inner, tokenizer, Look, EnvConfig(renderer="chat", max_turns=4), context_len=256,
                           max_turn_tokens=4)
        trajs = generate(ee, inner, group_requests(tokenizer, [prompt], 2))
        if all(t.finish_reason != "vision_token" for t in trajs):
            break
    for t in trajs:
        assert t.finish_reason == "stop" and t.episode["turns"] == 2 and t.reward == 1.0, t.episode
        (first, turn1), (second, turn2) = inner.turns[("p0", t.sample_index)]
        assert first.images is None and first.context_images == (BOARD,)  # turn 1: the prompt's pictures
        assert second.images == (BOARD, SEEN)  # turn 2: the prompt's, then the observation's
        observation = list(second.prompt_ids[len(first.prompt_ids) + len(turn1.token_ids):])
        assert list(second.prompt_ids) == [*first.prompt_ids, *turn1.token_ids, *observation]  # token-exact
        assert observation.count(processor.image_token_id) == 4
        assert t.prompt_ids == list(first.prompt_ids) and t.images == [BOARD, SEEN]
        assert t.token_ids == [*turn1.token_ids, *observation, *turn2.token_ids]
        assert t.loss_mask == [1] * len(turn1.token_ids) + [0] * len(observation) + [1] * len(turn2.token_ids)
    batch, _ = build_train_batch([Group(prompt, trajs)], AlgoConfig(skip_zero_adv_groups=False),
                                 tokenizer.pad_token_id, processor)
    assert batch.images.image_grid_thw_n3.tolist() == [[1, 4, 4]] * 2  # the board and the seen picture, once each
    assert batch.images.row_images == [[0, 1], [0, 1]]
    assert int((batch.images.feature_index_bt >= 0).sum()) == 2 * 8  # both pictures' tokens in both rows
    trainer = Trainer(copy.deepcopy(model), AlgoConfig(), OptimConfig(lr=1e-4), layout)
    scores = trainer._scores(trainer.model, batch)
    mask = batch.loss_mask_bt.bool()
    assert int(mask.sum()) == sum(t.num_sampled_tokens for t in trajs)
    assert float((scores - batch.behav_logp_bt)[mask].abs().max()) < 1e-5


def test_a_sampled_vision_marker_ends_the_episode_counted(policy):
    _, tokenizer, processor = policy
    prompt = Prompt("p0", "how many squares?", "3", {"images": [BOARD]})
    pad = processor.image_token_id
    steps = []

    class Counting(Look):
        def step(self, turn_text):
            steps.append(turn_text)
            return super().step(turn_text)

    ee, inner = _scripted(tokenizer, [[*tokenizer("ab", add_special_tokens=False).input_ids, pad], "c"], Counting)
    (t,) = ee.generate([GenRequest(prompt, tuple(vlm.prompt_ids(processor, prompt.text, [BOARD])), 0)])
    assert t.finish_reason == "vision_token" and t.episode["vision_tokens"] == 1 and t.episode["turns"] == 1
    assert len(inner.requests) == 1 and len(steps) == 1 and not t.infra_failed
    assert t.images is None  # no observation was appended: the prompt's pictures only
    # the trainer takes the sampled <|image_pad|> as text: one image's tokens placed, the sampled one not
    batch, _ = build_train_batch([Group(prompt, [t])], AlgoConfig(skip_zero_adv_groups=False),
                                 tokenizer.pad_token_id, processor)
    assert int((batch.images.feature_index_bt >= 0).sum()) == 4
    # an environment that ends the episode on that turn ends it as usual, nothing counted
    done = type("Done", (Look,), {"step": lambda self, text: EnvStep(None, 1.0, True)})
    ee, _ = _scripted(tokenizer, [[pad]], done)
    (t,) = ee.generate([GenRequest(prompt, tuple(vlm.prompt_ids(processor, prompt.text, [BOARD])), 0)])
    assert t.finish_reason == "stop" and t.episode["vision_tokens"] == 0


def test_zoom_environment_returns_a_picture_the_next_turn_sees(policy):
    _, tokenizer, processor = policy
    board = load_image(BOARD)
    quarter = zoom_quadrant(board, 2)
    assert quarter.size == board.size
    assert quarter.getpixel((0, 0)) == board.getpixel((28, 0))
    assert quarter.getpixel((55, 55)) == board.getpixel((55, 27))
    env = ENVS.get("zoom")()
    assert env.reset(Prompt("p", "how many squares?", "3", {"images": [BOARD]})) is None
    assert env.step("<zoom>9</zoom>").info == {"malformed": True}
    assert env.step("3").reward == 1.0 and env.step(" 2 ").reward == 0.0
    with pytest.raises(ValueError, match="no picture"):
        env.reset(Prompt("q", "how many?", "1"))
    prompts = [Prompt("p0", "how many squares?", "3", {"images": [BOARD]})]
    ee, inner = _scripted(tokenizer, ["<zoom>2</zoom>", "<zoom>2</zoom>", "3"], ENVS.get("zoom"))
    trajs = ee.generate(group_requests(tokenizer, prompts, 2))
    zoomed = to_data_url(quarter)
    for t in trajs:
        assert t.finish_reason == "stop" and t.reward == 1.0 and t.episode["tool_calls"] == 2
        assert t.images == [BOARD, zoomed, zoomed]
        assert (t.prompt_ids + t.token_ids).count(processor.image_token_id) == 12
    assert [r.images for r in inner.requests if r.sample_index == 0] == [None, (BOARD, zoomed),
                                                                        (BOARD, zoomed, zoomed)]
    batch, _ = build_train_batch([Group(prompts[0], trajs)], AlgoConfig(skip_zero_adv_groups=False),
                                 tokenizer.pad_token_id, processor)
    assert batch.images.image_grid_thw_n3.shape[0] == 2  # the board and the zoomed quarter: each once
    assert batch.images.row_images == [[0, 1, 1], [0, 1, 1]]
    # positions: one mrope pass over each whole row equals the batch's
    ids = torch.tensor(trajs[0].prompt_ids + trajs[0].token_ids)
    want, _ = vlm.mrope_positions(ids, batch.images.image_grid_thw_n3[[0, 1, 1]], processor.image_token_id)
    assert torch.equal(batch.images.position_ids_3bt[:, 0, :len(ids)], want)


def test_text_episodes_carry_no_pictures(policy):
    _, tokenizer, _ = policy
    ee, inner = _scripted(tokenizer, ["a", "b"], lambda: type("T", (Look,), {
        "step": lambda s, x: EnvStep("=1") if x == "a" else EnvStep(None, 1.0, True)})())
    (t,) = ee.generate(group_requests(tokenizer, [Prompt("t", "hi", "1")], 1))
    assert t.images is None and all(r.images is None for r in inner.requests) and t.finish_reason == "stop"
