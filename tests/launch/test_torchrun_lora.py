"""``torchrun --nproc_per_node 2 -m tidal.cli train ... --set model.lora.rank=4``: a LoRA run under FSDP2
trains like one process, writes PEFT-layout checkpoints and resumes (slow: two torchrun launches and a
1-process run)."""

import json

import pytest

from tests.system.test_controller import TINY_OVERRIDES
from tidal.cli import main
from tidal.models import lora

from .test_torchrun import _rows, _torchrun

pytest.importorskip("peft", reason="needs peft: pip install 'tidal[lora]'")


@pytest.mark.slow
def test_two_process_lora_run_matches_one_and_resumes(tmp_path):
    settings = [*TINY_OVERRIDES(tmp_path), "model.num_layers=2", "max_steps=2", "checkpoint_every=1",
                "rollout.prompts_per_step=6", "system.mode=sync", "rollout.max_staleness=0", "model.lora.rank=4",
                "optim.lr=5e-2", "algo.kl_coef=0.05"]
    sets = [x for s in settings for x in ("--set", s)]
    one = tmp_path / "one"
    assert main(["train", "quickstart_grpo", "--out", str(one), *sets]) == 0
    two = tmp_path / "two"
    _torchrun("quickstart_grpo", "--out", str(two), *sets)
    first_one, first_two = (next(r for r in _rows(d) if r["step"] == 1) for d in (one, two))
    assert first_two["reward/mean"] == first_one["reward/mean"]
    for key in ("train/loss", "train/grad_norm", "algo/kl"):
        assert first_two[key] == pytest.approx(first_one[key], rel=1e-4, abs=1e-6), key
    assert first_one["train/grad_norm"] > 0
    assert first_two["perf/weight_sync_bytes"] == first_one["perf/weight_sync_bytes"]
    assert (two / "checkpoints" / "step_2" / lora.ADAPTER_CONFIG).exists()
    _torchrun("quickstart_grpo", "--out", str(two), "--resume", "--set", "max_steps=3")
    assert [r["step"] for r in _rows(two) if "train/loss" in r] == [1, 2, 3]
    assert json.loads((two / "checkpoints" / "step_3" / lora.ADAPTER_CONFIG).read_text())["r"] == 4
