"""The controller sizes the engine's slot cache before the first step's clock starts (issue 51): sync for the
first step's requests (what its ``generate`` would size), async for as many rows as run at once, joining while
others run; no buffer then grows while rows run."""

import pytest

from tidal.rollout.local import LocalEngine

from .test_controller import run, tiny_cfg


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_engine_is_sized_before_the_first_step(tmp_path, monkeypatch, mode):
    calls = []
    real = LocalEngine.prepare

    def spy(self, requests, joins_later=False):
        calls.append((self, len(requests), joins_later, self._slots.num_growths if self._slots else 0))
        return real(self, requests, joins_later)

    monkeypatch.setattr(LocalEngine, "prepare", spy)
    cfg = tiny_cfg(tmp_path, f"system.mode={mode}", "max_steps=2")
    controller, result = run(cfg, tmp_path / "run")
    assert result.steps == 2
    ours = [c for c in calls if c[0] is controller.engine]
    assert len(ours) == 1, "prepared once, before the first step"
    _, count, joins_later, growths_before = ours[0]
    r = cfg.rollout
    if mode == "sync":
        assert (count, joins_later) == (r.prompts_per_step * r.group_size, False)
    else:
        assert joins_later and count > r.max_batch_size  # every slot, and rows that join later
    assert growths_before == 0
    assert controller.engine._slots.num_growths == 0, "the slot cache grew while rows ran"


def test_a_finished_run_prepares_nothing(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(LocalEngine, "prepare", lambda self, *a, **k: calls.append(a))
    cfg = tiny_cfg(tmp_path, "system.mode=sync", "max_steps=1")
    run(cfg, tmp_path / "run")
    calls.clear()
    run(cfg, tmp_path / "run", resume=True)  # already at max_steps: nothing to generate
    assert calls == []
