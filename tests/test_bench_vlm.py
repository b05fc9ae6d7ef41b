"""``tidal bench vlm`` at toy sizes: every arm runs, the headline keys are there, and the counts are exact (one
picture embedded per prompt by the engine and the trainer, one per sample when the group's uids differ). Timings
are not checked; the full-size numbers are in benchmarks/results/vlm.json."""

import pytest

from tidal.bench import load

HEADLINE = ("image_over_text_samples_per_s", "image_over_text_train_step", "vision_passes_saved_frac",
            "shared_over_unshared_samples_per_s", "device", "threads", "settings")


def test_vlm_bench_reports_the_cost_of_vision_and_the_passes_saved(tmp_path):
    prompts, group = 4, 3
    out = load("vlm").run([f"prompts={prompts}", f"group_size={group}", "repeats=2", "warmup=0",
                           "long_new_tokens=3"], tmp_path / "vlm")
    for key in HEADLINE:
        assert key in out, key
    assert out["device"].startswith("cpu") and out["threads"] == 1
    assert out["settings"]["group_size"] == group
    assert [r["arm"] for r in out["table"]] == ["image", "text", "image_unshared", "image_long", "text_long"]
    samples = prompts * group
    assert all(r["samples"] == samples for r in out["table"])
    # distinct prompts are distinct pictures: the engine embeds each once, the unshared arm once per sample
    assert out["vision_passes_saved_frac"] == pytest.approx(1 - 1 / group)
    assert out["arms"]["image"]["vision_images"] == prompts
    assert out["arms"]["image_unshared"]["vision_images"] == samples
    assert out["ratios"]["image_unshared_vision_passes_saved_frac"] == 0.0
    assert out["arms"]["text"]["vision_images"] == 0 and out["arms"]["text"]["tower_patches"] == 0
    # a 56x56 picture is 16 patches; the trainer's step embeds each distinct picture once per pass
    trainer = out["trainer"]
    assert trainer["image"]["rows"] == samples and trainer["image"]["per_row_patches"] == 16 * samples
    assert trainer["image"]["tower_patches"] == 16 * prompts * trainer["image"]["tower_calls"]
    assert out["trainer_vision_passes_saved_frac"] == pytest.approx(1 - trainer["image"]["tower_calls"] / group)
    assert trainer["text"]["tower_patches"] == 0
    assert out["prompt_tokens"]["image"]["min"] == out["prompt_tokens"]["image"]["max"] == 31
    assert out["prompt_tokens"]["text"]["min"] > 31
    for key in ("image_over_text_samples_per_s", "image_over_text_train_step", "shared_over_unshared_samples_per_s",
                "image_over_text_rl_step_samples_per_s"):
        ratio = out["ratios"][key]
        assert len(ratio["values"]) == 2 and ratio["min"] <= out[key] <= ratio["max"] and out[key] > 0
    best = out["best"]
    assert best["image_unshared_tower_s"] > 0 and best["image_s"] > 0 and best["text_s"] > 0
    assert set(out["load_average"]) >= {"before", "after"}
    assert len(out["image_processor_s"]["per_sample"]["values"]) == 2
    assert {"unshared_extra_s_in_tower_frac", "unshared_extra_s_in_image_processor_frac"} <= set(best)
