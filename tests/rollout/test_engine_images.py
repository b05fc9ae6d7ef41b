"""The local engine with images (``rollout/vision.py``): prefill with pictures, one vision pass per prompt, M-RoPE
positions equal to transformers' and to the trainer's, images kept across interruption."""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image

from tidal.algo.config import AlgoConfig
from tidal.config import ConfigError
from tidal.models import prompts, tiny, vlm
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.tasks.visual import render_squares
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import Group, Prompt
from tidal.utils.images import to_data_url

PICTURES = [render_squares(((1, 1),), (0,)), render_squares(((1, 1), (3, 3)), (0, 1)),
            render_squares(((0, 0), (2, 4), (5, 5)), (2, 3, 1))]


@pytest.fixture(scope="module", params=vlm.FAMILIES)
def policy(request):
    """The tiny Qwen2-VL, and the tiny Qwen2.5-VL (window attention in its vision tower; same language side)."""
    processor = vlm.build_processor(vlm.VLMConfig())
    model = vlm.build_vlm(vlm.VLMConfig(family=request.param), processor)
    return model, vlm.attach_processor(processor.tokenizer, processor), processor


def _prompts() -> list[Prompt]:
    """Two prompts with the same words over different pictures, one with a picture of its own, one text-only."""
    return [Prompt("a", "how many?", "1", {"images": [to_data_url(PICTURES[0])]}),
            Prompt("b", "how many?", "2", {"images": [to_data_url(PICTURES[1])]}),
            Prompt("c", "count them", "3", {"images": [PICTURES[2]]}),  # a PIL image, as datasets decodes one
            Prompt("d", "hi", "2", {})]


def _engine(model, tokenizer, **sampling) -> LocalEngine:
    return LocalEngine(model, tokenizer, SamplingConfig(**{"max_new_tokens": 6, "dtype": "fp32", **sampling}), seed=3)


def _trainer_scores(model, processor, ps, trajs, cfg: TrainerConfig) -> tuple[torch.Tensor, object]:
    groups = [Group(p, [t for t in trajs if t.prompt_uid == p.uid]) for p in ps]
    batch, _ = build_train_batch(groups, AlgoConfig(skip_zero_adv_groups=False), processor.tokenizer.pad_token_id,
                                 processor)
    trainer = Trainer(model, AlgoConfig(), OptimConfig(lr=1e-4), cfg)
    return trainer._scores(trainer.model, batch), batch


def test_prompt_ids_widen_each_picture_to_its_tokens(policy):
    model, tokenizer, processor = policy
    ids = group_requests(tokenizer, _prompts()[:1], 1)[0].prompt_ids
    assert ids == tuple(vlm.encode_prompt(processor, "how many?", [PICTURES[0]])["input_ids"][0].tolist())
    assert ids.count(processor.image_token_id) == 4  # a 56x56 picture: (56/14)^2 / 2^2 tokens
    pictures = [Image.new("RGB", (200, 90)), Image.new("RGB", (30, 300))]  # resized to multiples of 28 each its way
    system = [{"role": "system", "content": "be brief"}]
    assert vlm.prompt_ids(processor, "how many?", pictures, "be brief") == vlm.encode_messages(
        processor, [*system, *vlm.user_message("how many?", 2)], pictures)["input_ids"][0].tolist()


@pytest.mark.parametrize("layout", [TrainerConfig(), TrainerConfig(packing=True), TrainerConfig(share_prefixes=True)],
                         ids=["padded", "packed", "trie"])
def test_engine_logprobs_equal_the_trainers(policy, layout):
    """fp32 on CPU: the engine's log-probs of its samples (pictures placed, M-RoPE positions, decode at index +
    delta) equal the trainer's in each layout, for prompts with and without images in one batch."""
    model, tokenizer, processor = policy
    ps = _prompts()
    trajs = _engine(model, tokenizer).generate(group_requests(tokenizer, ps, 3))
    scores, batch = _trainer_scores(copy.deepcopy(model), processor, ps, trajs, layout)
    mask = batch.loss_mask_bt.bool()
    assert mask.sum() == sum(t.num_tokens for t in trajs)
    assert float((scores - batch.behav_logp_bt)[mask].abs().max()) < 1e-5


def test_one_vision_pass_per_prompt_even_when_its_group_is_admitted_in_pieces(policy):
    """Three slots for groups of 4: a group's samples reach prefill in separate admissions, and still the tower
    embeds each prompt's picture once (kept features), and a weight update embeds them again."""
    model, tokenizer, _ = policy
    engine = _engine(model, tokenizer, max_batch_size=3)
    calls = []
    hook = engine.model.model.visual.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[0]))
    try:
        engine.generate(group_requests(tokenizer, _prompts(), 4))
        assert engine.stats()["rollout/vision_images"] == 3.0
        assert engine.stats()["rollout/vision_images_reused"] > 0
        assert sum(calls) == 3 * 16  # three pictures' 16 patches each, whatever the admissions
        engine.request_weight_update(copy.deepcopy(engine.model.state_dict()), version=1)
        engine.generate(group_requests(tokenizer, _prompts()[:1], 2))
        assert sum(calls) == 4 * 16  # new weights: the picture is embedded again, once
    finally:
        hook.remove()


def test_same_words_over_different_pictures_are_not_shared(policy):
    """"how many?" over two pictures renders the same tokens; the engine must not share their prefill or their
    identical-row decodes (the first token's distribution differs)."""
    model, tokenizer, _ = policy
    ps = _prompts()[:2]
    trajs = _engine(model, tokenizer, share_identical_rows=True).generate(group_requests(tokenizer, ps, 1))
    assert trajs[0].prompt_ids == trajs[1].prompt_ids
    alone = [_engine(model, tokenizer).generate(group_requests(tokenizer, [p], 1))[0] for p in ps]
    for shared, single in zip(trajs, alone):
        assert shared.token_ids == single.token_ids
        assert max(abs(x - y) for x, y in zip(shared.logprobs, single.logprobs)) < 1e-5


def test_greedy_decoding_equals_transformers_generate(policy):
    """M-RoPE at decode time: the engine's greedy tokens equal transformers' ``generate`` with pixel inputs (its
    own ``get_rope_index`` and cached position deltas)."""
    model, tokenizer, processor = policy
    ps = _prompts()[:3]
    ours = _engine(model, tokenizer, max_new_tokens=8).generate(group_requests(tokenizer, ps, 1), greedy=True)
    for p, traj in zip(ps, ours):
        enc = vlm.encode_prompt(processor, p.text, p.images)
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert traj.token_ids == out[0, enc["input_ids"].shape[1]:].tolist()[: traj.num_tokens]


def test_interruption_keeps_the_pictures(policy):
    """New weights mid-generation: every running row is prefilled again with its picture, so the tokens sampled
    after the switch score under the new weights exactly as the trainer scores them."""
    model, tokenizer, processor = policy
    ps = _prompts()
    engine = _engine(model, tokenizer, max_new_tokens=10)
    gen = torch.Generator().manual_seed(0)
    new_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    new = copy.deepcopy(new_model.state_dict())
    apply, calls = engine._apply_pending_update, []

    def interrupt():
        calls.append(1)
        if len(calls) == 4:  # a few tokens in
            engine.request_weight_update(new, version=7)
        return apply()

    engine._apply_pending_update = interrupt
    trajs = engine.generate(group_requests(tokenizer, ps, 2))
    assert engine.num_interruptions == 1
    scores, batch = _trainer_scores(new_model, processor, ps, trajs, TrainerConfig())
    after = batch.loss_mask_bt.bool() & (batch.versions_bt == 7)
    assert after.sum() > 10
    assert float((scores - batch.behav_logp_bt)[after].abs().max()) < 1e-5


def test_images_need_a_vision_language_model_and_a_chat_rendering(policy):
    _, tokenizer, _ = policy
    text_tokenizer = tiny.build_tokenizer()
    with pytest.raises(ConfigError, match="prompt a has 1 image.*reads text only"):
        group_requests(text_tokenizer, _prompts()[:1], 1)
    plain = prompts.attach(copy.copy(tokenizer), prompts.PromptFormat("plain"))
    with pytest.raises(ConfigError, match="prompt a has images.*model.prompt_format=plain"):
        group_requests(plain, _prompts()[:1], 1)


def test_a_prompt_is_checked_with_its_pictures_tokens(policy):
    """The run's context check renders a prompt with images whole (pictures widened), and refuses a text model
    naming the row."""
    from tidal.rollout.requests import check_prompts_fit

    _, tokenizer, _ = policy
    prompt = _prompts()[0]
    length = len(group_requests(tokenizer, [prompt], 1)[0].prompt_ids)
    assert check_prompts_fit(tokenizer, [("train row 0", prompt)], length + 2, 2) == 1
    with pytest.raises(ConfigError, match=f"train row 0: the prompt is {length} tokens with its 1 image"):
        check_prompts_fit(tokenizer, [("train row 0", prompt)], length + 1, 2)
    with pytest.raises(ConfigError, match="train row 0: prompt a has 1 image.*reads text only"):
        check_prompts_fit(tiny.build_tokenizer(), [("train row 0", prompt)], 128, 2)


@pytest.mark.parametrize("settings", [dict(decode_attention="gqa"), dict(decode_attention="fold"),
                                      dict(cuda_graphs="on", graph_widths="buckets"), dict(host_reads="late")],
                         ids=["gqa", "fold", "static-buckets", "late-reads"])
def test_the_engine_paths_decode_pictures_alike(policy, settings):
    """Decode attention modes, static (graph-shaped) decode steps with width buckets and late host reads take the
    M-RoPE position from the slot cache as plain decoding does: the same samples (the vision tower, switched to
    the engine's attention with the decoder, too)."""
    model, tokenizer, _ = policy
    plain = _engine(model, tokenizer).generate(group_requests(tokenizer, _prompts(), 2))
    other = _engine(model, tokenizer, **settings).generate(group_requests(tokenizer, _prompts(), 2))
    for x, y in zip(plain, other):
        assert x.token_ids == y.token_ids
        assert max(abs(a - b) for a, b in zip(x.logprobs, y.logprobs)) < 1e-5
