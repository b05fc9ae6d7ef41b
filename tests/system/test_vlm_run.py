"""Vision-language runs end to end on a tiny Qwen2-VL (issue 54): ``model.vision`` builds it, the warm start and
the engine read the pictures, the trainer's batch carries them, samples.jsonl records them, a run resumes from its
checkpoint exactly, and LoRA with the vision tower frozen trains."""

import json

import pytest

from tidal.config import apply_overrides
from tidal.inspector.samples import FILE_NAME
from tidal.models import vlm
from tidal.recipes import RECIPES

from .test_controller import TINY_OVERRIDES, comparable, run, run_stopped_after

SMALL = ("model.hidden_size=32", "model.num_heads=2", "task.num_eval=16", "task.params={num_problems: 200}",
         "rollout.max_new_tokens=2", "reward.name=exact_match", "log.samples.every=1",
         "algo.skip_zero_adv_groups=false")  # a random model rarely answers with a digit: train on every group


def vlm_cfg(tmp_path, *extra):
    return apply_overrides(RECIPES.get("vlm_quickstart")(), [*TINY_OVERRIDES(tmp_path), *SMALL, *extra])


def test_a_vision_language_run_trains_on_its_pictures(tmp_path):
    # sdc.replay_every=2: the guard's shadow trainer replays a step with its pictures and must agree bit for bit
    c, result = run(vlm_cfg(tmp_path, "system.mode=sync", "sdc.replay_every=2"), tmp_path / "run")
    assert vlm.is_vlm(c.trainer.model) and vlm.processor_of(c.tokenizer) is not None
    steps = [h for h in result.history if "train/loss" in h]
    assert steps and all(h["rollout/vision_images"] > 0 for h in steps)
    assert result.history[-1]["sdc/replayed_steps"] >= 1  # and matched: a mismatch would have rolled back
    # the rollout engine embeds every prompt's picture once for its whole group: 4 steps x 4 prompts (x 4 samples)
    assert result.history[-1]["rollout/vision_images"] == 16
    records = [json.loads(line) for line in (tmp_path / "run" / FILE_NAME).read_text().splitlines()]
    assert records and all(r["prompt"]["images"][0]["url"].startswith("data:image/png") for r in records)
    model, tokenizer = vlm.load(sorted((tmp_path / "run" / "checkpoints").iterdir())[-1])
    assert vlm.processor_of(tokenizer) is None and tokenizer.image_token_id == model.config.image_token_id


def test_a_vision_language_run_resumes_like_an_uninterrupted_one(tmp_path):
    cfg = lambda: vlm_cfg(tmp_path, "system.mode=sync")  # noqa: E731
    _, whole = run(cfg(), tmp_path / "whole")
    run_stopped_after(2, cfg(), tmp_path / "split")
    _, rest = run(cfg(), tmp_path / "split", resume=True)
    assert comparable(rest.history)[-2:] == comparable(whole.history)[-2:]


@pytest.mark.parametrize("vision", ["frozen", "lora"])
def test_lora_on_a_vision_language_run(tmp_path, vision):
    c, result = run(vlm_cfg(tmp_path, "system.mode=async", "model.lora.rank=4", f"model.lora.vision={vision}"),
                    tmp_path / "run")
    assert result.steps == 4
    adapted = {n for n, p in c.trainer.model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in adapted)
    assert any(".visual." in n for n in adapted) == (vision == "lora")


def test_a_qwen2_vl_folder_as_model_path(tmp_path):
    """A Qwen2-VL folder (here a run's checkpoint) is a ``model.path``: loaded with its processor, no warm start."""
    run(vlm_cfg(tmp_path, "system.mode=sync", "max_steps=2"), tmp_path / "first")
    folder = sorted((tmp_path / "first" / "checkpoints").iterdir())[-1]
    c, result = run(vlm_cfg(tmp_path, "system.mode=sync", "max_steps=2", "model.vision=false", f"model.path={folder}"),
                    tmp_path / "second")
    assert vlm.is_vlm(c.trainer.model) and vlm.processor_of(c.tokenizer) is not None
    assert result.steps == 2 and result.history[-1]["rollout/vision_images"] == 8


@pytest.mark.parametrize("setting", ["algo.advantage=gae", "trainer.data_parallel=elastic", "system.backend=ray",
                                     "rollout.speculative.method=draft_model", "model.num_experts=4",
                                     "model.path=smollm2-135m-instruct"])
def test_what_a_vision_language_run_cannot_do_yet_is_refused_naming_the_key(tmp_path, setting):
    from tidal.config import ConfigError
    from tidal.system.validate import validate_run_config

    with pytest.raises(ConfigError, match=setting.split("=")[0].replace(".", r"\.")):
        validate_run_config(vlm_cfg(tmp_path, setting))


def test_a_qwen2_5_vl_folder_trains(tmp_path):
    """A Qwen2.5-VL folder (a tiny one saved here) is a ``model.path`` too: its own class, the processor beside it."""
    processor = vlm.build_processor(vlm.VLMConfig())
    vlm.save(vlm.build_vlm(vlm.VLMConfig(hidden_size=32, num_heads=2, mrope_section=(2, 3, 3), num_layers=1,
                                         family="qwen2_5_vl"), processor), processor, tmp_path / "qwen2_5_vl")
    c, result = run(vlm_cfg(tmp_path, "system.mode=sync", "max_steps=2", "model.vision=false",
                            f"model.path={tmp_path / 'qwen2_5_vl'}"), tmp_path / "run")
    assert type(c.trainer.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert result.steps == 2 and result.history[-1]["rollout/vision_images"] == 8
