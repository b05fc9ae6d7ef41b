import ast
import dataclasses
import inspect

import pytest
import torch

from tidal.algo import (
    ADVANTAGES,
    CORRECTIONS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    VALUE_ADVANTAGES,
    AlgoConfig,
    bind,
)
from tidal.algo import config as config_module
from tidal.config import apply_overrides


def test_bind_passes_only_what_the_function_accepts():
    cfg = AlgoConfig(adv_eps=0.5, eps_low_is=0.3)
    grpo = bind(ADVANTAGES["grpo"], cfg)
    assert grpo.keywords == {"adv_eps": 0.5}
    assert bind(ADVANTAGES["dr_grpo"], cfg).keywords == {}
    cispo = bind(POLICY_LOSSES["cispo"], cfg)
    assert cispo.keywords["eps_low_is"] == 0.3 and cispo.keywords["eps_high_is"] == 4.0
    assert "dual_clip" not in cispo.keywords and "adv_eps" not in cispo.keywords


def test_none_means_each_function_keeps_its_paper_default():
    cfg = AlgoConfig()
    assert "eps_low" not in bind(POLICY_LOSSES["gspo"], cfg).keywords
    assert "agg" not in bind(POLICY_LOSSES["gspo"], cfg).keywords
    sig = inspect.signature(POLICY_LOSSES["gspo"]).parameters
    assert (sig["eps_low"].default, sig["eps_high"].default, sig["agg"].default) == (3e-4, 4e-4, "seq_mean_token_mean")
    sig = inspect.signature(POLICY_LOSSES["ppo_clip"]).parameters
    assert (sig["eps_low"].default, sig["eps_high"].default, sig["dual_clip"].default) == (0.2, 0.28, 3.0)
    # set explicitly, they reach the function; loss_agg arrives as agg
    cfg = AlgoConfig(eps_low=0.1, eps_high=0.3, loss_agg="group_length")
    assert {"eps_low": 0.1, "eps_high": 0.3, "agg": "group_length"}.items() <= bind(
        POLICY_LOSSES["gspo"], cfg
    ).keywords.items()
    # dual_clip=None is a real value (disabled), not "use the default"
    assert bind(POLICY_LOSSES["ppo_clip"], AlgoConfig(dual_clip=None)).keywords["dual_clip"] is None


def test_bind_data_wins_and_unknown_data_is_ignored():
    g = torch.tensor([0, 1])
    f = bind(POLICY_LOSSES["reinforce"], AlgoConfig(), group_ids_b=g, prox_logp_bt=torch.zeros(1), agg="group_length")
    assert f.keywords["group_ids_b"] is g and f.keywords["agg"] == "group_length" and "prox_logp_bt" not in f.keywords
    assert bind(LOSS_AGGREGATIONS["token_mean"], group_ids_b=g).keywords == {}


def test_every_field_reaches_some_component():
    """No dead knobs: each field is a registry choice, read by the trainer or controller, or a parameter of some
    function."""
    import tidal.algo.correction as correction
    import tidal.algo.distill as distill
    import tidal.algo.entropy as entropy
    import tidal.algo.kl as kl
    import tidal.algo.value as value

    fns = [
        f
        for reg in (ADVANTAGES, POLICY_LOSSES, LOSS_AGGREGATIONS, KL_ESTIMATORS, CORRECTIONS, VALUE_ADVANTAGES)
        for f in map(reg.get, reg)
    ]
    fns += [kl.kl_loss, kl.kl_reward_penalty, correction.ess_lr_scale, entropy.entropy_loss, entropy.high_entropy_mask,
            value.value_loss, distill.distill_advantage]
    params = set().union(*(inspect.signature(f).parameters for f in fns))
    trainer_side = {"advantage", "policy_loss", "correction", "skip_zero_adv_groups", "overlong_filter", "kl_in_reward",
                    "ess_lr_scaling", "guidance", "guidance_reward"}  # guidance: system/controller.py
    for f in dataclasses.fields(AlgoConfig):
        assert f.name in trainer_side or f.metadata.get("param", f.name) in params, f"{f.name} reaches nothing"


def test_every_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(config_module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AlgoConfig")
    documented = set()
    for stmt, nxt in zip(cls.body, cls.body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            documented.add(stmt.target.id)
    assert {f.name for f in dataclasses.fields(AlgoConfig)} == documented


def test_overrides_parse_into_the_new_fields():
    cfg = apply_overrides(
        AlgoConfig(),
        [
            "eps_high=0.3",
            "loss_agg=seq_mean_token_sum_norm",
            "tis_level=sequence",
            "behav_weight_cap=null",
            "max_gen_len=4096",
        ],
    )
    assert (cfg.eps_high, cfg.loss_agg, cfg.tis_level, cfg.behav_weight_cap, cfg.max_gen_len) == (
        0.3,
        "seq_mean_token_sum_norm",
        "sequence",
        None,
        4096,
    )
    with pytest.raises(ValueError):
        apply_overrides(AlgoConfig(), ["tis_level=word"])


def test_registry_item_access_matches_get():
    assert POLICY_LOSSES["ppo_clip"] is POLICY_LOSSES.get("ppo_clip")
    with pytest.raises(KeyError, match="cispo"):
        POLICY_LOSSES["cipso"]
