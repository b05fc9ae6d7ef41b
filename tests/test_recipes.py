"""Every named recipe resolves, cites its sources, and trains end to end on the tiny setup."""

import pytest

from tidal.cli import main, show_recipe
from tidal.config import apply_overrides
from tidal.recipes import RECIPES
from tidal.recipes.papers import SOURCES
from tidal.system.run import prepare

from .system.test_controller import TINY_OVERRIDES

PAPERS = ["grpo", "dr_grpo", "dapo", "magistral", "cispo", "gspo", "areal"]


def test_every_paper_recipe_is_registered_and_sourced():
    assert set(PAPERS) <= set(RECIPES)
    for name in PAPERS:
        cfg = RECIPES.get(name)()
        assert SOURCES[name], name
        for key, source in SOURCES[name].items():
            assert "arXiv" in source or "AReaL" in source, (name, key)
        assert cfg.algo.policy_loss and cfg.algo.advantage


def test_paper_specific_settings():
    get = lambda n: RECIPES.get(n)()
    assert (get("dapo").algo.eps_low, get("dapo").algo.eps_high) == (0.2, 0.28)
    assert get("dapo").rollout.dynamic_sampling and get("dapo").algo.kl_coef == 0
    assert get("grpo").algo.kl_coef == 0.04 and get("grpo").algo.loss_agg == "seq_mean_token_mean"
    assert get("dr_grpo").algo.advantage == "dr_grpo" and get("dr_grpo").algo.loss_agg == "seq_mean_token_sum_norm"
    assert get("magistral").algo.loss_agg == "group_length" and get("magistral").algo.advantage == "magistral"
    cispo = get("cispo")
    assert cispo.algo.policy_loss == "cispo" and cispo.optim.betas == (0.9, 0.95) and cispo.optim.eps == 1e-15
    assert (get("gspo").algo.eps_low, get("gspo").algo.eps_high) == (3e-4, 4e-4)
    assert get("areal").algo.policy_loss == "decoupled_ppo" and get("areal").rollout.max_staleness == 4


def test_recipes_show_prints_resolved_config_with_sources(capsys):
    assert main(["recipes", "show", "cispo"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("algo.policy_loss:"))
    assert "cispo" in line and "MiniMax-M1 (arXiv 2506.13585)" in line
    assert "optim.eps: 1.0e-15" in out
    assert "rollout.group_size: 8" in show_recipe("cispo")  # unannotated keys are there too
    assert main(["recipes", "show"]) == 2


@pytest.mark.parametrize("name", PAPERS)
def test_recipe_trains_two_steps(tmp_path, name):
    keep_reward = name == "dapo"  # its composed reward (correctness + overlong penalty) is part of the recipe
    overrides = [o for o in TINY_OVERRIDES(tmp_path) if not (keep_reward and o.startswith("reward.name"))]
    if keep_reward:  # scale the overlong window to the tiny run's 4-token budget so lengths matter
        overrides.append("reward.params.terms=[{reward: exact_match},"
                         " {reward: length, params: {max_len: 4, cache_len: 3}}]")
    cfg = apply_overrides(RECIPES.get(name)(), [*overrides, "max_steps=2", "eval_every=2"])
    controller = prepare(cfg, tmp_path / name)
    try:
        result = controller.run()
    finally:
        controller.tracker.close()
    trained = [r for r in result.history if "train/loss" in r]
    assert result.steps == 2 and trained, f"{name} never took a training step"
    assert all(abs(r["train/loss"]) < 1e3 for r in trained)
