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


@pytest.mark.parametrize("item, match", [
    ("optim.lr=.nan", r"^optim.lr: nan is not a finite number"),
    ("optim.lr=nan", r"^optim.lr: nan is not a finite number"),  # a string, coerced to the float field
    ("optim.lr=1e999", r"^optim.lr: inf is not a finite number"),
    ("algo.mis_high=.inf", r"^algo.mis_high: inf is not a finite number"),  # no range rule in validate.py
    ("max_time_s=-.inf", r"^max_time_s: -inf is not a finite number"),
    ("optim.betas=[0.9, .nan]", r"^optim.betas\[1\]: nan"),
    ("curriculum.mixture=[{name: a, task: {}, weight: [[0, 1], [5, .nan]]}]",
     r"^curriculum.mixture\[0\].weight\[1\]\[1\]: nan"),
    ("reward.params.scale=.inf", r"^reward.params.scale: inf"),  # a free-form mapping's sub-key
])
def test_a_non_finite_number_is_refused_naming_the_key(item, match):
    """NaN passes every range check (each comparison is false), so it is refused where values are read."""
    with pytest.raises(ConfigError, match=match):
        apply_overrides(RunConfig(), [item])


def test_a_non_finite_number_in_a_yaml_config_is_refused(tmp_path):
    (tmp_path / "c.yaml").write_text("rollout:\n  temperature: .nan\n")
    with pytest.raises(ConfigError, match=r"^rollout.temperature: nan is not a finite number"):
        load_yaml_into(RunConfig(), tmp_path / "c.yaml")


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


def test_on_off_yes_no_stay_words_for_string_keys_and_are_booleans_for_boolean_keys(tmp_path):
    """YAML 1.1 reads off/on/yes/no as booleans: ``rollout.cuda_graphs=off`` became the string "False"."""
    cfg = apply_overrides(RunConfig(), ["rollout.cuda_graphs=off", "trainer.moe.routing_replay=off",
                                        "log.progress=off", "log.tensorboard=yes", "rollout.stop=[no, On]"])
    assert cfg.rollout.cuda_graphs == "off" and cfg.trainer.moe.routing_replay == "off"
    assert cfg.log.progress is False and cfg.log.tensorboard is True and cfg.rollout.stop == ["no", "On"]
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  cuda_graphs: on\nlog:\n  progress: no\n")
    cfg = load_yaml_into(RunConfig(), path)
    assert cfg.rollout.cuda_graphs == "on" and cfg.log.progress is False
