"""docs/algorithms.md's porting table: every tidal setting in it is a real key, every registry name a
registered entry, and each row's settings together make a valid run config."""

import re
from pathlib import Path

import pytest

from tidal.algo import ADVANTAGES, CORRECTIONS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, VALUE_ADVANTAGES
from tidal.config import apply_overrides
from tidal.recipes import RECIPES
from tidal.system.validate import validate_run_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"
REGISTRIES = {
    "algo.advantage": [*ADVANTAGES.names(), *VALUE_ADVANTAGES.names()],
    "algo.policy_loss": POLICY_LOSSES.names(),
    "algo.loss_agg": LOSS_AGGREGATIONS.names(),
    "algo.kl_estimator": KL_ESTIMATORS.names(),
    "algo.correction": CORRECTIONS.names(),
}
# A valid stand-in for the user's own number (``<...>`` in the table), per key.
SAMPLE = {"algo.dual_clip": "3.0", "algo.tis_cap": "2.0", "algo.mis_high": "2.0", "algo.mis_low": "0.5",
          "algo.behav_weight_cap": "5.0", "algo.is_veto_threshold": "1e-4", "algo.clip_cov_low": "1.0",
          "algo.clip_cov_high": "5.0", "algo.rs_threshold": "0.01", "algo.offpolicy_mask_delta": "1e-4"}
# Keys that qualify a correction chosen in another row (the table's notes say so): tested under ``tis``.
QUALIFIERS = ("algo.tis_", "algo.is_veto", "algo.is_batch_norm", "algo.rs_", "algo.offpolicy_mask_delta")


def _rows() -> list[tuple[str, str, list[str]]]:
    text = DOC.read_text()
    section = text[text.index("## Porting a config"):]
    section = section[: section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("framework", "---"):
            continue
        settings = re.findall(r"`([a-z_]+\.[a-z_.]+=[^`]*)`", cells[2])
        rows.append((cells[0], cells[1], settings))
    return rows


ROWS = _rows()


def test_table_covers_the_four_frameworks():
    assert {framework for framework, _, _ in ROWS} == {"verl", "TRL", "AReaL", "slime"}
    assert len(ROWS) >= 40
    assert all(settings for _, _, settings in ROWS), "a row without a tidal setting"


@pytest.mark.parametrize("framework,option,settings", ROWS, ids=[f"{f}:{o[:40]}" for f, o, _ in ROWS])
def test_row_applies_to_a_valid_config(framework, option, settings):
    overrides = []
    for setting in settings:
        key, _, value = setting.partition("=")
        if value.startswith("<"):
            value = SAMPLE.get(key, "0.5")
        if key in REGISTRIES:
            assert value in REGISTRIES[key], f"{framework} {option}: {value!r} is not a registered {key}"
        overrides.append(f"{key}={value}")
    if any(o.startswith(QUALIFIERS) for o in overrides) and not any(
            o.startswith("algo.correction=") for o in overrides):
        overrides.append("algo.correction=tis")  # the level/veto rows qualify a correction chosen elsewhere
    cfg = apply_overrides(RECIPES.get("quickstart")(), overrides)  # unknown keys raise ConfigError
    validate_run_config(cfg)
