"""validate_run_config: every value a run cannot use is one ConfigError naming the key, before any work;
and the async generator raises (instead of spinning) if it can never admit a group."""

import threading

import pytest

from tidal.config import ConfigError, apply_overrides
from tidal.recipes import RECIPES
from tidal.system.run import close, prepare
from tidal.system.validate import validate_run_config

from .test_controller import tiny_cfg

BAD = [  # (override, the key the error must name)
    ("rollout.group_size=1", "rollout.group_size"),
    ("env.name=calculatr", "env.name"),
    ("env.max_turns=0", "env.max_turns"),
    ("env.renderer=jinja", "env.renderer"),
    ("env.step_timeout_s=0", "env.step_timeout_s"),
    ("env.max_concurrent_episodes=0", "env.max_concurrent_episodes"),
    ("env.latency_median_s=-1", "env.latency_median_s"),
    ("rollout.group_size=0", "rollout.group_size"),
    ("rollout.group_size=-1", "rollout.group_size"),
    ("rollout.prompts_per_step=0", "rollout.prompts_per_step"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),
    ("rollout.max_batch_size=4", "rollout.max_batch_size"),  # quickstart's group_size is 8
    ("rollout.temperature=-1", "rollout.temperature"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("trainer.temperature=0", "trainer.temperature"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.max_staleness=-1", "rollout.max_staleness"),
    ("rollout.length_schedule=[[0]]", "rollout.length_schedule"),
    ("optim.betas=[0.9]", "optim.betas"),
    ("optim.betas=[0.9, 1.0]", "optim.betas"),
    ("optim.betas=[0.9, 0.99, 0.999]", "optim.betas"),
    ("optim.lr=0", "optim.lr"),
    ("optim.lr=-1e-4", "optim.lr"),
    ("optim.lr=.nan", "optim.lr"),
    ("algo.mis_high=.nan", "algo.mis_high"),  # no range rule: `mis_high <= mis_low` is false for NaN
    ("optim.eps=0", "optim.eps"),
    ("optim.grad_clip=0", "optim.grad_clip"),
    ("optim.decay_steps=0", "optim.decay_steps"),
    ("optim.decay_steps=all", "optim.decay_steps"),  # an integer or max_steps
    ("reward.num_workers=-3", "reward.num_workers"),
    ("reward.timeout_s=0", "reward.timeout_s"),
    ("max_steps=0", "max_steps"),
    ("eval_every=0", "eval_every"),
    ("checkpoint_every=0", "checkpoint_every"),
    ("max_time_s=-5", "max_time_s"),
    ("num_eval=0", "num_eval"),
    ("system.num_threads=0", "system.num_threads"),
    ("system.async_threads=-1", "system.async_threads"),
    ("system.rollout_workers=0", "system.rollout_workers"),
    ("trainer.num_minibatches=0", "trainer.num_minibatches"),
    ("algo.kl_coef=-0.1", "algo.kl_coef"),
    ("algo.mis_high=0.4", "algo.mis_high"),
    ("algo.passk_k=0", "algo.passk_k"),
    ("algo.gamma=1.5", "algo.gamma"),
    ("algo.tis_floor=-0.1", "algo.tis_floor"),
    ("algo.rs_threshold=0", "algo.rs_threshold"),
    ("algo.is_veto_threshold=2", "algo.is_veto_threshold"),
    ("algo.offpolicy_mask_delta=-1", "algo.offpolicy_mask_delta"),
    ("algo.sapo_tau_pos=0", "algo.sapo_tau_pos"),
    ("algo.sapo_tau_neg=-1", "algo.sapo_tau_neg"),
    ("algo.clip_cov_frac=0", "algo.clip_cov_frac"),
    ("algo.clip_cov_high=0.5", "algo.clip_cov_high"),
    ("algo.kl_cov_frac=2", "algo.kl_cov_frac"),
    ("algo.kl_cov_coef=-1", "algo.kl_cov_coef"),
    ("algo.entropy_coef=-0.01", "algo.entropy_coef"),
    ("algo.top_entropy_frac=0", "algo.top_entropy_frac"),
    ("algo.top_entropy_frac=1.5", "algo.top_entropy_frac"),
    ("model.num_heads=3", "model.hidden_size"),
    ("model.num_layers=0", "model.num_layers"),
]


@pytest.mark.parametrize("override,key", BAD, ids=[b[0] for b in BAD])
def test_a_value_the_run_cannot_use_is_one_error_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:  # when the value is set (a non-finite number), else by validate
        validate_run_config(apply_overrides(RECIPES.get("quickstart")(), [override]))
    message = str(info.value)
    assert message.startswith(key) and "\n" not in message, message


BAD_TOGETHER = [  # (overrides, the key the error must name): knobs that only make sense with another one
    (["algo.advantage=pass_at_k", "algo.passk_k=9"], "algo.passk_k"),  # quickstart's group_size is 8
    (["algo.correction=tis", "algo.tis_floor=0.8", "algo.tis_cap=0.5"], "algo.tis_floor"),
    (["algo.correction=reject", "algo.rs_stat=seq_max_ratio"], "algo.rs_threshold"),  # 0.01 bounds a KL
    (["algo.is_veto_threshold=1e-4"], "algo.is_veto_threshold"),  # correction=none never calls it
    (["algo.offpolicy_mask_delta=1e-4"], "algo.offpolicy_mask_delta"),
    (["algo.is_batch_norm=true"], "algo.is_batch_norm"),
    (["algo.correction=reject"], "algo.correction"),
    (["distill.teacher=quickstart", "algo.skip_zero_adv_groups=false"], "algo.guidance"),  # quickstart's guidance
]


@pytest.mark.parametrize("overrides,key", BAD_TOGETHER, ids=[" ".join(b[0]) for b in BAD_TOGETHER])
def test_knobs_that_need_another_are_one_error_naming_the_key(overrides, key):
    cfg = apply_overrides(RECIPES.get("quickstart")(), overrides)
    with pytest.raises(ConfigError) as info:
        validate_run_config(cfg)
    assert str(info.value).startswith(key) and "\n" not in str(info.value), str(info.value)


def test_the_new_estimators_and_corrections_validate():
    for overrides in (["algo.advantage=pass_at_k"], ["algo.advantage=reinforce_pp_token", "algo.gamma=0.9"],
                      ["algo.correction=reject", "algo.offpolicy_mask_delta=1e-4"],
                      ["algo.correction=mis", "algo.mis_level=geometric", "algo.mis_low=0.999", "algo.mis_high=1.001",
                       "algo.is_veto_threshold=1e-4", "algo.rs_stat=seq_max_k3", "algo.is_batch_norm=true"]):
        validate_run_config(apply_overrides(RECIPES.get("quickstart")(), overrides))


def test_every_recipe_is_valid():
    for name in RECIPES:
        validate_run_config(RECIPES.get(name)())


def test_prepare_validates_before_writing_anything(tmp_path):
    with pytest.raises(ConfigError, match="rollout.group_size"):
        prepare(tiny_cfg(tmp_path, "rollout.group_size=1"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_async_generator_raises_instead_of_spinning_when_no_group_fits(tmp_path):
    """A config that slipped past validation (changed after prepare) must end the run, not spin."""
    controller = prepare(tiny_cfg(tmp_path, "system.mode=async"), tmp_path / "run")
    controller.cfg.rollout.max_batch_size = 2  # the engine reads the same config: group_size 4 never fits
    outcome: list = []

    def run():
        try:
            controller.run()
        except BaseException as e:  # noqa: BLE001  (the test inspects it)
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    try:
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the controller spun instead of failing"
    finally:
        close(controller)
    assert len(outcome) == 1 and isinstance(outcome[0], ConfigError), outcome
    assert "rollout.max_batch_size" in str(outcome[0])


def test_unknown_environment_parameter_is_one_config_error_naming_it(tmp_path):
    cfg = tiny_cfg(tmp_path, "task.name=sum_chain", "env.name=calculator", "env.params.precision=3")
    with pytest.raises(ConfigError, match="env.params for 'calculator'.*precision"):
        prepare(cfg, tmp_path / "run")


def test_an_environment_parameter_value_it_rejects_is_one_config_error(tmp_path):
    cfg = tiny_cfg(tmp_path, "task.name=sum_chain", "env.name=calculator", "env.params.call_format=xml")
    with pytest.raises(ConfigError, match="env.params for 'calculator'.*xml"):
        prepare(cfg, tmp_path / "run")
