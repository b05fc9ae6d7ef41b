"""The vLLM engine with pictures (issue 54), on a fake ``vllm`` (vLLM is not installed here): a request whose
context shows pictures goes in as vLLM's ``{"prompt_token_ids", "multi_modal_data": {"image": [...]}}`` with the
ids already widened, as transformers' processor writes them (vLLM's multimodal processor then finds its
placeholders and does not widen them again); a segment after a weight update sends the same pictures; a text
request is token ids only, as before."""

from __future__ import annotations

import sys

import pytest

from tests.rollout.test_vllm_moe import fake_vllm
from tidal.models import vlm
from tidal.rollout.local import SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.rollout.vllm_engine import VllmDriver, VllmEngine
from tidal.tasks.visual import render_squares
from tidal.types import Prompt
from tidal.utils.images import to_data_url


@pytest.fixture
def vision_dir(tmp_path):
    processor = vlm.build_processor(vlm.VLMConfig())
    vlm.save(vlm.build_vlm(vlm.VLMConfig(), processor), processor, tmp_path / "vlm")
    return tmp_path / "vlm", vlm.attach_processor(processor.tokenizer, processor)


def test_pictures_reach_vllm_as_multi_modal_data(monkeypatch, vision_dir):
    folder, tokenizer = vision_dir
    fake = fake_vllm(with_routes=False)
    seen = []
    monkeypatch.setitem(sys.modules, "vllm", fake)
    driver = VllmDriver(folder, SamplingConfig(max_batch_size=8))
    add = driver.engine.add_request
    driver.engine.add_request = lambda rid, prompt, params: (seen.append(prompt), add(rid, prompt, params))
    picture = render_squares(((1, 2), (4, 0)), (0, 2))
    prompts = [Prompt("p", "how many squares?", "2", {"images": [to_data_url(picture)]}), Prompt("t", "hi", "0")]
    engine = VllmEngine(driver, tokenizer, SamplingConfig(max_new_tokens=4, max_batch_size=8))
    requests = group_requests(tokenizer, prompts, 2)
    engine.generate(requests)
    assert len(seen) == 4
    for request, sent in zip(requests, seen):
        assert sent["prompt_token_ids"] == list(request.prompt_ids)
        if request.prompt.uid == "t":
            assert "multi_modal_data" not in sent  # text: ids only, as before
            continue
        (image,) = sent["multi_modal_data"]["image"]
        assert image.size == (56, 56) and image.tobytes() == picture.tobytes()
        assert sent["prompt_token_ids"].count(tokenizer.convert_tokens_to_ids(vlm.IMAGE_PAD)) == 4  # widened


def test_a_segment_after_a_weight_update_sends_the_same_pictures(monkeypatch, vision_dir):
    from tidal.rollout.vllm_engine import engine_inputs

    _, tokenizer = vision_dir
    picture = render_squares(((0, 0),), (1,))
    request = group_requests(tokenizer, [Prompt("p", "how many squares?", "1", {"images": [picture]})], 1)[0]
    later = engine_inputs(request, [*request.prompt_ids, 5, 6])  # prompt + tokens so far
    assert later["prompt_token_ids"][-2:] == [5, 6]
    assert later["multi_modal_data"]["image"][0].tobytes() == picture.tobytes()
