"""A whole run of PPO with a learned critic (``algo.advantage=gae``): it trains, logs the critic, and a
run stopped and resumed from its checkpoint equals the uninterrupted one, critic included."""

import json
import math

import pytest
import torch

from tidal.config import ConfigError
from tidal.system.validate import validate_run_config

from .test_controller import comparable, params, run, tiny_cfg

GAE = ("system.mode=sync", "algo.advantage=gae", "algo.skip_zero_adv_groups=false", "critic.optim.lr=1e-2")
CRITIC_KEYS = ("critic/value_loss", "critic/values_mean", "critic/clip_frac", "critic/explained_var",
               "critic/grad_norm")


def critic_params(controller):
    return {k: v.clone() for k, v in controller.trainer.critic.model.state_dict().items()}


def test_a_gae_run_trains_and_resumes_exactly(tmp_path):
    full_c, full_r = run(tiny_cfg(tmp_path, *GAE), tmp_path / "full")
    trained = [row for row in full_r.history if row["step"] > 0]
    assert len(trained) == 4
    for row in trained:
        assert all(k in row and math.isfinite(row[k]) for k in CRITIC_KEYS), row
    assert any(row["critic/grad_norm"] > 0 for row in trained) and any(row["train/grad_norm"] > 0 for row in trained)

    run(tiny_cfg(tmp_path, *GAE, "max_steps=2"), tmp_path / "split")
    assert (tmp_path / "split" / "checkpoints" / "step_2" / "critic.pt").exists()
    resumed_c, _ = run(tiny_cfg(tmp_path, *GAE), tmp_path / "split", resume=True)
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    with_critic = ("critic/",)
    assert comparable(rows) == comparable(full_r.history)
    assert [{k: v for k, v in r.items() if k.startswith(with_critic)} for r in rows] == \
           [{k: v for k, v in r.items() if k.startswith(with_critic)} for r in full_r.history]
    for a, b in ((params(full_c), params(resumed_c)), (critic_params(full_c), critic_params(resumed_c))):
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("override, key", [
    ("critic.optim.lr=0", "critic.optim.lr"),
    ("critic.optim.betas=[0.9]", "critic.optim.betas"),
    ("algo.gamma=1.5", "algo.gamma"),
    ("algo.lam=-0.1", "algo.lam"),
    ("algo.value_clip=0", "algo.value_clip"),
])
def test_bad_critic_settings_fail_before_any_work_naming_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_run_config(tiny_cfg(tmp_path, *GAE, override))


def test_critic_settings_are_not_checked_without_gae(tmp_path):
    validate_run_config(tiny_cfg(tmp_path, "critic.optim.lr=0"))
