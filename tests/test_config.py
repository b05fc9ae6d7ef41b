import pytest

from tidal.config import ConfigError, apply_overrides, load_yaml_into, save_yaml
from tidal.recipes import RECIPES
from tidal.system.config import RunConfig


def test_overrides_parse_types():
    cfg = apply_overrides(RunConfig(), ["rollout.max_staleness=3", "optim.lr=2e-4", "system.mode=sync",
                                        "rollout.stop=[x, y]", "target_accuracy=null", "optim.betas=[0.9, 0.95]"])
    assert cfg.rollout.max_staleness == 3 and cfg.optim.lr == 2e-4 and cfg.system.mode == "sync"
    assert cfg.rollout.stop == ["x", "y"] and cfg.target_accuracy is None and cfg.optim.betas == (0.9, 0.95)


def test_unknown_key_names_close_matches():
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.max_stalenes'.*rollout.max_staleness"):
        apply_overrides(RunConfig(), ["rollout.max_stalenes=2"])


@pytest.mark.parametrize("item, match", [
    ("rollout.group_size=abc", "expected an integer"),
    ("system.mode=fast", "not one of"),
    ("rollout", "key=value"),
    ("rollout=3", "is a section"),
])
def test_bad_values_are_clear_errors(item, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(RunConfig(), [item])


def test_yaml_round_trip(tmp_path):
    cfg = apply_overrides(RECIPES.get("quickstart")(), ["optim.lr=5e-4", "rollout.stop=[z]"])
    save_yaml(cfg, tmp_path / "c.yaml")
    assert load_yaml_into(RunConfig(), tmp_path / "c.yaml") == cfg


def test_mapping_fields_take_free_sub_keys(tmp_path):
    cfg = apply_overrides(RunConfig(), ["reward.params.mode=all_pass", "reward.params.inner.k=2"])
    assert cfg.reward.params == {"mode": "all_pass", "inner": {"k": 2}}
    save_yaml(cfg, tmp_path / "c.yaml")
    assert load_yaml_into(RunConfig(), tmp_path / "c.yaml").reward.params == cfg.reward.params


def test_reward_params_reach_the_reward_and_bad_ones_are_named():
    from tidal.rewards import build_reward

    with pytest.raises(ConfigError, match="exact_match.*takes no parameters"):
        build_reward("exact_match", {"mode": "x"})
