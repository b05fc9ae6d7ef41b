"""tidal's Trainer vs TRL's GRPOTrainer on identical batches: the same loss and gradient for the same data.

Runs ``benchmarks/_trl_parity.py`` (its docstring says how each side is computed and what the cases
are) with the python of ``tidal bench trl``'s virtual environment, which has TRL; skipped when that
environment has not been created (``tidal bench trl`` creates it once). About 10 s.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".tidal_cache" / "bench-trl-venv"
SCRIPT = ROOT / "benchmarks" / "_trl_parity.py"

FLOAT = 1e-6
"""float32 agreement: observed differences are ~1e-8 (losses) and ~1e-7 (largest gradient element)."""
LOSS_REL = 1e-5
"""A loss rescaled by the token-count ratio (case b): float32 sums in another order, 1.2e-6 relative observed
(Nov 2026), so 1e-6 sat on the rounding's edge."""
EPS_REL = 1e-3
"""TRL's advantage eps (1e-4) vs tidal's (1e-6), relative to group stds of 0.5-0.58: ~2e-4."""


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    python = VENV / "bin" / "python"
    if not (python.exists() and (VENV / "tidal-bench.json").exists()):
        pytest.skip(f"no TRL environment at {VENV}: run `tidal bench trl` once to create it")
    out = tmp_path_factory.mktemp("trl_parity") / "parity.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(python), str(SCRIPT), "--out", str(out), "--threads", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _equal(cmp, tol=FLOAT):
    assert cmp["loss_abs_diff"] < tol, cmp
    assert cmp["grad_max_abs_diff"] < tol, cmp
    assert cmp["grad_cosine"] > 1 - 1e-9, cmp
    assert abs(cmp["grad_norm_ratio"] - 1) < tol, cmp


def _equal_up_to_adv_eps(cmp):
    assert abs(cmp["loss_tidal"] - cmp["loss_trl"]) < EPS_REL * abs(cmp["loss_trl"]), cmp
    assert cmp["grad_cosine"] > 1 - 1e-8, cmp
    assert abs(cmp["grad_norm_ratio"] - 1) < EPS_REL, cmp
    assert cmp["grad_norm_ratio"] > 1, cmp  # tidal's smaller eps: slightly larger advantages


@pytest.mark.slow
def test_advantages_agree_up_to_the_eps(parity):
    for name, adv in parity["advantages"].items():
        assert adv["eps"] == {"trl": 1e-4, "tidal": 1e-6}, name
        assert adv["max_abs_diff_same_eps"] < FLOAT, (name, adv)  # TRL's formula with tidal's eps: identical
        assert 0 < adv["max_abs_diff"] < EPS_REL, (name, adv)
    zero = parity["advantages"]["with_zero_group"]
    assert zero["rewards"][1] == [0.0] * 4 and zero["trl"][4:8] == zero["tidal"][4:8] == [0.0] * 4


@pytest.mark.slow
def test_a_on_policy_all_groups_informative_same_loss_and_gradient(parity):
    a = parity["cases"]["a_on_policy"]
    assert a["zero_adv_groups"] == 0 and a["tokens_all_groups"] == a["tokens_informative_groups"]
    assert a["tidal_ratio_mean"] == pytest.approx(1.0, abs=1e-6) and a["tidal_clip_frac"] == 0.0
    _equal(a["same_advantages"])
    _equal_up_to_adv_eps(a["trl_own_advantages"])


@pytest.mark.slow
def test_b_zero_advantage_group_only_changes_the_normalizer(parity):
    b = parity["cases"]["b_zero_adv_group"]
    assert b["zero_adv_groups"] == 1 and b["tokens_all_groups"] > b["tokens_informative_groups"]
    ratio = b["tokens_all_groups"] / b["tokens_informative_groups"]
    assert b["expected_norm_ratio"] == pytest.approx(ratio)
    same = b["same_advantages"]
    assert same["grad_cosine"] > 1 - 1e-9, same  # parallel
    assert same["grad_norm_ratio"] == pytest.approx(ratio, rel=FLOAT), same  # tidal / TRL = all / informative
    assert same["loss_tidal"] == pytest.approx(ratio * same["loss_trl"], rel=LOSS_REL), same
    _equal(b["same_advantages_trl_scaled"])  # TRL times the ratio: equal element by element
    own = b["trl_own_advantages"]
    assert own["grad_cosine"] > 1 - 1e-8 and own["grad_norm_ratio"] == pytest.approx(ratio, rel=EPS_REL), own


@pytest.mark.slow
def test_c_stale_equal_without_dual_clip_and_differs_exactly_where_it_binds(parity):
    c = parity["cases"]["c_stale"]
    tidal, trl = c["tidal_metrics"], c["trl_clip_metrics"]
    # both clip sides and the dual clip are active, and both frameworks count the same clipped tokens
    assert tidal["algo/clip_frac_low"] > 0 and tidal["algo/clip_frac_high"] > 0 and c["dual_clip_tokens"] > 0
    assert tidal["algo/dual_clip_frac"] == pytest.approx(c["dual_clip_tokens"] / c["tokens"])
    assert trl["clip_ratio/low_mean"] == pytest.approx(tidal["algo/clip_frac_low"])
    assert trl["clip_ratio/high_mean"] == pytest.approx(tidal["algo/clip_frac_high"])

    _equal(c["dual_clip_none"]["same_advantages"])  # TRL has no dual clip: tidal without it is TRL
    _equal_up_to_adv_eps(c["dual_clip_none"]["trl_own_advantages"])

    on = c["dual_clip_on"]
    assert on["same_advantages"]["grad_cosine"] < 0.99 and on["same_advantages"]["loss_abs_diff"] > 0.01
    # the whole difference: tokens with A < 0 and ratio > 3, where tidal's loss is the constant -3A
    explained = on["trl_without_dual_clipped_tokens"]
    assert explained["grad_max_abs_diff"] < FLOAT and explained["grad_cosine"] > 1 - 1e-9, explained
    assert explained["loss_abs_diff_minus_cap_term"] < FLOAT, explained
