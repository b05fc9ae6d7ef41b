"""The warm start stops in an accuracy band: checks, the replay of an interval that jumps over the
band (it must reproduce the straight run exactly), the clear failures, and the cache's safety."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from tidal.models.tiny import ModelConfig
from tidal.stages.warm_start import SFTConfig, WarmStartError, cache_path, warm_start
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig

MODEL = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32)
TASK_CFG = TaskConfig(num_eval=50)


def _task():
    return TASKS.get("addition")(TASK_CFG)


def _fingerprint(model) -> float:
    return round(sum(float(p.detach().double().sum()) for p in model.parameters()), 9)


def _straight_run_steps(tmp_path, steps):
    """Train ``steps`` steps checking every step, recording each step's parameter fingerprint."""
    seen = {}

    def record(model, tokenizer):
        seen[_fingerprint(model)] = len(seen) + 1
        return 0.0

    sft = SFTConfig(steps=steps, accuracy_band=[0.99, 1.0], check_every=1, batch_size=8, cache_dir=str(tmp_path))
    with pytest.raises(WarmStartError, match="never entered"):
        warm_start(MODEL, _task(), TASK_CFG, sft, evaluate=record, progress=False)
    assert len(seen) == steps
    return seen


def scripted(step_of, accuracy_at_step, calls):
    """An evaluator that reads the step from the weights (so a non-reproducible replay fails) and
    returns a scripted accuracy for it; weights the straight run never had (a step retaken at a lower
    learning rate) read as step None."""
    def evaluate(model, tokenizer):
        step = step_of.get(_fingerprint(model))
        calls.append(step)
        return accuracy_at_step(step)
    return evaluate


def test_stops_at_the_first_check_in_the_band(tmp_path):
    step_of = _straight_run_steps(tmp_path / "rec", 30)
    calls = []
    sft = SFTConfig(steps=30, accuracy_band=[0.3, 0.45], check_every=5, batch_size=8, cache_dir=str(tmp_path))
    out = warm_start(MODEL, _task(), TASK_CFG, sft, scripted(step_of, lambda s: s / 40, calls), progress=False)
    assert calls == [5, 10, 15]  # 0.125, 0.25, 0.375: in the band at step 15
    saved = json.loads((out / "tidal_sft.json").read_text())
    assert saved["steps"] == 15 and saved["accuracy"] == pytest.approx(0.375)
    assert saved["checks"] == [[5, 0.125], [10, 0.25], [15, 0.375]]


def test_a_jump_over_the_band_is_replayed_step_by_step_from_the_last_check(tmp_path):
    step_of = _straight_run_steps(tmp_path / "rec", 30)
    calls = []
    jump = {**{s: 0.1 for s in range(1, 13)}, 13: 0.4, **{s: 0.9 for s in range(14, 31)}}
    sft = SFTConfig(steps=30, accuracy_band=[0.3, 0.45], check_every=10, batch_size=8, cache_dir=str(tmp_path))
    out = warm_start(MODEL, _task(), TASK_CFG, sft, scripted(step_of, jump.get, calls), progress=False)
    # step 20 overshoots; rewound to step 10's state, the replay reproduces steps 11..13 exactly
    assert calls == [10, 20, 11, 12, 13]
    assert json.loads((out / "tidal_sft.json").read_text())["steps"] == 13


def test_a_step_that_jumps_over_the_band_is_retaken_at_half_the_learning_rate(tmp_path):
    step_of = _straight_run_steps(tmp_path / "rec", 12)
    seen = {}

    def evaluate(model, tokenizer):  # 0.1 on the straight run's first 5 steps, 0.9 after; 0.42 off it
        fp = _fingerprint(model)
        seen[step_of.get(fp)] = [p.detach().clone() for p in model.parameters()]
        step = step_of.get(fp)
        return 0.42 if step is None else 0.1 if step < 6 else 0.9

    sft = SFTConfig(steps=12, accuracy_band=[0.4, 0.46], check_every=4, batch_size=8, cache_dir=str(tmp_path))
    out = warm_start(MODEL, _task(), TASK_CFG, sft, evaluate, progress=False)
    saved = json.loads((out / "tidal_sft.json").read_text())
    assert saved["steps"] == 6 and saved["lr_halvings"] == 1 and saved["accuracy"] == pytest.approx(0.42)
    assert [s for s, _ in saved["checks"]] == [4, 8, 5, 6, 6]
    # the retaken step is step 6's batch from step 5's state, at half the rate: with the same gradient and
    # Adam moments, AdamW (no weight decay) moves every weight exactly half as far
    for before, full, half in zip(seen[5], seen[6], seen[None]):
        assert torch.allclose(half - before, (full - before) / 2, atol=1e-6)


def test_failures_name_the_band_and_what_to_change(tmp_path):
    step_of = _straight_run_steps(tmp_path / "rec", 12)
    sft = SFTConfig(steps=12, accuracy_band=[0.3, 0.45], check_every=4, batch_size=8, cache_dir=str(tmp_path))
    with pytest.raises(WarmStartError, match=r"never entered sft.accuracy_band=\[0.3, 0.45\].*best 0.200"):
        warm_start(MODEL, _task(), TASK_CFG, sft, scripted(step_of, lambda s: 0.2, []), progress=False)
    jump = lambda s: 0.1 if s is not None and s < 6 else 0.9  # noqa: E731  (over the band at every lr)
    calls = []
    with pytest.raises(WarmStartError, match="jumped over sft.accuracy_band"):
        warm_start(MODEL, _task(), TASK_CFG, sft, scripted(step_of, jump, calls), progress=False)
    assert calls == [4, 8, 5, 6, None, None, None]  # step 6 retaken at lr/2, lr/4, lr/8, then it gives up
    # the jump is at the replay's first step: "from" is the step before it (4), not the overshooting check (8)
    at_once = lambda s: 0.1 if s is not None and s < 5 else 0.9  # noqa: E731
    with pytest.raises(WarmStartError, match=r"from 0.100 to 0.900 at step 5, also at sft.lr/8\)"):
        warm_start(MODEL, _task(), TASK_CFG, sft, scripted(step_of, at_once, []), progress=False)
    every_step = SFTConfig(steps=12, accuracy_band=[0.3, 0.45], check_every=1, batch_size=8, cache_dir=str(tmp_path))
    with pytest.raises(WarmStartError, match="from nan to 0.900 at step 1"):  # over the band at the first check
        warm_start(MODEL, _task(), TASK_CFG, every_step, scripted(step_of, lambda s: 0.9, []), progress=False)
    assert not any(p.name.startswith("base-") for p in tmp_path.iterdir())  # nothing cached on failure


@pytest.mark.parametrize("key,value", [("steps", 0), ("check_every", 0), ("accuracy_band", [0.5, 0.2]),
                                       ("accuracy_band", [0.5]), ("lr", 0.0), ("batch_size", 0)])
def test_bad_settings_name_the_key(key, value):
    with pytest.raises(WarmStartError, match=f"sft.{key}"):
        SFTConfig(**{key: value})


def test_concurrent_cold_starts_share_one_entry_and_a_truncated_one_is_rebuilt(tmp_path):
    sft = SFTConfig(steps=3, accuracy_band=None, batch_size=8, cache_dir=str(tmp_path))
    task = _task()
    with ThreadPoolExecutor(2) as pool:  # two runs on a cold cache (issue 21: they shared one .tmp)
        outs = list(pool.map(lambda _: warm_start(MODEL, task, TASK_CFG, sft, progress=False), range(2)))
    assert outs[0] == outs[1] == cache_path(MODEL, TASK_CFG, sft, task)
    assert sorted(p.name for p in tmp_path.iterdir()) == [outs[0].name]  # no temporary left behind
    weights = next(outs[0].glob("*.safetensors"))
    before = weights.read_bytes()
    os.truncate(weights, weights.stat().st_size // 2)
    again = warm_start(MODEL, task, TASK_CFG, sft, progress=False)
    # rebuilt whole (not byte-equal: the two threads above shared torch's global RNG while initializing)
    assert again == outs[0] and weights.stat().st_size == len(before)
    assert load_file(weights)


def test_band_checks_screen_a_base_that_cannot_do_the_task_yet():
    from tidal.stages.warm_start import SCREEN_PROMPTS, screened_accuracy

    prompts = list(range(200))
    asked = []

    def successes(right):  # prompts whose index is in ``right`` succeed
        def count(some):
            asked.append(len(some))
            return sum(p in right for p in some)
        return count

    assert screened_accuracy(successes(set(range(100, 200))), prompts, 0.3) == 0.0  # 0 of the first 25
    assert asked == [SCREEN_PROMPTS]  # the other 175 never ran
    asked.clear()
    assert screened_accuracy(successes({0, *range(100, 160)}), prompts, 0.3) == 61 / 200  # passes: all 200
    assert asked == [SCREEN_PROMPTS, 200]
    asked.clear()
    assert screened_accuracy(successes(set(range(100, 200))), prompts, 0.0) == 0.5  # a band from 0: no screen
    assert screened_accuracy(successes(set()), prompts[:60], 0.3) == 0.0 and asked == [200, 60]  # < 100 prompts
