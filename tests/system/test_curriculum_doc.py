"""docs/curriculum.md: its shell commands run as written (shrunk to a tiny model), and every config field
of the curriculum is in its table."""

import dataclasses
import re

import pytest

from tidal.rewards.monitor import LengthBiasConfig
from tidal.rollout.thinking import ThinkingConfig
from tidal.system.curriculum import CurriculumConfig
from tidal.system.length_growth import LengthGrowthConfig
from tidal.tasks.online import OnlineDifficultyConfig

from ..tasks.test_docs import DOCS, _run, script


def test_every_curriculum_field_is_documented():
    text = (DOCS / "curriculum.md").read_text()
    sections = {"curriculum": CurriculumConfig, "curriculum.difficulty": OnlineDifficultyConfig,
                "rollout.length_growth": LengthGrowthConfig, "rollout.thinking": ThinkingConfig,
                "reward.length_bias": LengthBiasConfig}
    for prefix, cls in sections.items():
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(f.default_factory() if f.default_factory is not dataclasses.MISSING
                                            else f.default):
                assert f"| `{prefix}.{f.name}` |" in text, f"{prefix}.{f.name} is not in docs/curriculum.md"


@pytest.mark.slow  # six tiny runs and an eval through the command line: ~1 minute alone, more when shared
def test_curriculum_doc_commands_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(DOCS.parent))  # the `tidal` command imports this checkout
    commands = script("curriculum.md")
    assert commands.count("tidal train") == 5 and commands.count("tidal eval") == 1
    proc = _run("curriculum.md", tmp_path)
    assert re.search(r'"accuracy_by_thinking_budget": \{\s*"0": ', proc.stdout)
    assert (tmp_path / "runs/mix/metrics.jsonl").exists()
